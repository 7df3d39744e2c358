"""`rlnotes plot`: PNG figures of runs overlaid (or of every member of a sweep), and their table.

Each figure shows one quantity against the optimizer step, one colour per run, labelled by the
overrides that set the run apart; a held-out version of the quantity, when logged, is dashed.
Only figures whose metrics some run logged are drawn. Usable from Python too:

    from rlnotes.commands.plot import plot, plot_metrics
    plot(["multirun/2025-01-01/12-00-00-grpo"])                  # figures + table, like the command
                                                                 # (an Optuna sweep: also objective.png)
    plot_metrics(["multirun/..."], ["reward/mean", "eval/accuracy"], "reward.png")  # one PNG, a panel each

matplotlib (the `plot` extra) draws through its Agg canvas, without pyplot's global state.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

from rlnotes.commands.sweep import (
    Summary,
    objective_sense,
    optuna_history,
    print_summary,
    summarize,
    sweep_sections,
    write_summary,
)
from rlnotes.commands.usage import Parser, UsageError
from rlnotes.run import files, places
from rlnotes.run.display import stdout_console
from rlnotes.run.records import (
    OPTUNA_FILE,
    Run,
    RunError,
    expand,
    has_runs,
    is_sweep,
    labels,
    load_run,
    sweep_dir_of,
)

PathLike = Union[str, Path]

# (file stem, title, metrics): the first metric solid, a second one (its held-out version) dashed.
FIGURES: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("reward", "reward (batch mean)", ("reward/mean",)),
    ("eval_accuracy", "eval accuracy", ("eval/accuracy",)),
    ("kl", "KL to the reference (per token)", ("kl/ref",)),
    ("loss", "loss", ("loss", "eval/sft_loss")),
    ("length", "completion length (tokens)", ("completion/len_mean",)),
    ("dpo_margin", "DPO margin", ("dpo/margin", "eval/dpo_margin")),
    ("dpo_accuracy", "DPO accuracy", ("dpo/accuracy", "eval/dpo_accuracy")),
    ("rm_accuracy", "reward-model accuracy", ("rm/accuracy", "eval/rm_accuracy")),
    ("warmup_loss", "SFT warm-up loss", ("sft_warmup/loss",)),
    ("tool_calls", "tool calls per episode", ("tools/calls", "eval/tools/calls")),
)
STYLES = ("-", "--")


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RunError("rlnotes plot needs matplotlib; install it with: pip install 'rlnotes[plot]'") from None
    return Figure


def ema(values: Sequence[float], weight: float) -> List[float]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing):
    s_t = w s_{t-1} + (1 - w) x_t, shown as s_t / (1 - w^t); weight 0 returns the values."""
    if weight <= 0:
        return list(values)
    out, s = [], 0.0
    for t, x in enumerate(values, start=1):
        s = weight * s + (1 - weight) * x
        out.append(s / (1 - weight ** t))
    return out


def _draw(ax, runs: Sequence[Run], names: Sequence[str], metrics: Sequence[str], smooth: float) -> bool:
    """Draw `metrics` of every run on `ax`; False when no run logged any of them."""
    drawn = False
    for i, (run, name) in enumerate(zip(runs, names)):
        color = f"C{i % 10}"
        for j, metric in enumerate(metrics):
            steps, values = run.series(metric)
            if not steps:
                continue
            label = name if j == 0 or not run.series(metrics[0])[0] else None
            sparse = len(steps) <= 30
            if smooth > 0 and not sparse:
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                values = ema(values, smooth)
            ax.plot(steps, values, STYLES[min(j, 1)], color=color, label=label, linewidth=1.5,
                    marker="o" if sparse else None, markersize=3)
            drawn = True
    return drawn


def _finish(ax, title: str, n_runs: int) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if n_runs > 1:
        ax.legend(fontsize="small", loc="best")


def _save(fig, path: Path) -> None:
    """The figure as a PNG at `path`, written aside and renamed (rlnotes.run.files): never through a
    link planted there, nor into a file a hard-linked copy of the run dir shares."""
    image = io.BytesIO()
    fig.savefig(image, format="png")
    files.write_bytes(path, image.getvalue())


def figure(runs: Sequence[Run], names: Sequence[str], metrics: Sequence[str], title: str, path: Path,
           smooth: float = 0.0) -> Optional[Path]:
    """One PNG of `metrics` overlaid for every run; None (nothing written) if no run logged them."""
    Figure = _matplotlib()
    fig = Figure(figsize=(7, 4.2), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    if not _draw(ax, runs, names, metrics, smooth):
        return None
    held_out = [m for m in metrics[1:] if any(run.series(m)[0] for run in runs)]
    _finish(ax, title + (f"  (dashed: {', '.join(held_out)})" if held_out else ""), len(runs))
    _save(fig, path)
    return path


def plot_metrics(paths: Sequence[PathLike], metrics: Sequence[str], path: PathLike, smooth: float = 0.0,
                 title: Optional[str] = None, names: Optional[Sequence[str]] = None) -> Path:
    """One PNG with a panel per metric (side by side), every run overlaid: for a README figure.
    `names` labels the runs (default: the overrides that differ between them)."""
    runs = [load_run(p) for p in expand(paths)]
    missing = [m for m in metrics if not any(run.series(m)[0] for run in runs)]
    if missing:
        raise RunError(f"no run logged {', '.join(missing)}; logged: {', '.join(_logged(runs))}")
    Figure = _matplotlib()
    fig = Figure(figsize=(5.5 * len(metrics), 4), dpi=120, layout="constrained")
    if names is not None and len(names) != len(runs):
        raise RunError(f"{len(names)} names for {len(runs)} runs")
    names = list(names) if names is not None else labels(runs)
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        _draw(ax, runs, names, [metric], smooth)
        _finish(ax, metric, len(runs))
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)
    return path


def objective_figure(summary: Summary, sense: str, path: Path) -> Optional[Path]:
    """An Optuna study's history: each trial's objective (a dot), the best so far (a step line), and
    a dotted line at each failed trial; None when no trial returned an objective."""
    history = optuna_history(summary, sense)
    done = [(h["trial"], h["objective"]) for h in history if h["objective"] is not None]
    if not done:
        return None
    Figure = _matplotlib()
    fig = Figure(figsize=(7, 4.2), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    ax.plot([t for t, _ in done], [v for _, v in done], "o", color="C0", label="trial")
    best = [(h["trial"], h["best"]) for h in history if h["best"] is not None]
    ax.step([t for t, _ in best], [b for _, b in best], where="post", color="C1", label="best so far")
    for i, h in enumerate(h for h in history if h["status"] == "failed"):
        ax.axvline(h["trial"], color="C3", linestyle=":", alpha=0.6, label="failed" if i == 0 else None)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial")
    ax.set_ylabel(summary.sort_by or "objective")
    ax.set_title(f"objective by trial ({'higher' if sense == 'max' else 'lower'} is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    _save(fig, path)
    return path


def _logged(runs: Sequence[Run]) -> List[str]:
    return list(dict.fromkeys(m for run in runs for m in run.metrics()))


@dataclass
class PlotResult:
    figures: List[Path]
    summary: Summary
    out: Path
    written: List[Path] = field(default_factory=list)


def default_out(paths: Sequence[PathLike], run_dirs: Sequence[Path]) -> Path:
    """Where figures go without --out: the one run or sweep dir given; the sweep dir every run
    belongs to; else a dir beside the first one given, named for the dirs it compares
    (outputs/DATE/plot-12-00-00-grpo+12-05-00-rloo; the first one and the count, for more than 3)."""
    if len(paths) == 1:
        return Path(paths[0])
    sweeps = {sweep_dir_of(run) for run in run_dirs}
    if len(sweeps) == 1 and None not in sweeps:
        return sweeps.pop()
    names = [Path(p).resolve().name for p in paths]
    name = "+".join(names) if len(names) <= 3 else f"{names[0]}+{len(names) - 1}-more"
    return Path(paths[0]).parent / f"plot-{name}"


def plot(paths: Sequence[PathLike], out: Optional[PathLike] = None, sort_by: Optional[str] = None,
         smooth: float = 0.0, console=None) -> PlotResult:
    """Figures of every run in `paths` (run dirs and sweep dirs) into `out`, and their summary table
    printed (best first by `sort_by`); with several runs, also summary.md and summary.csv in `out`.
    Among several dirs, those without runs (a run that stopped before its first step, as a shell
    glob over outputs/ picks up) are left out, and the console names them."""
    empty = [p for p in paths if Path(p).is_dir() and not has_runs(p)]
    if empty and len(empty) < len(paths):
        paths = [p for p in paths if p not in empty]
        if console is not None:
            console.print(f"left out (no metrics.jsonl, no runs): {', '.join(map(str, empty))}", highlight=False)
    run_dirs = expand(paths)
    chosen = out is None
    out = Path(out) if out is not None else default_out(paths, run_dirs)
    _matplotlib()  # fail before any work when it is missing
    runs = [load_run(p) for p in run_dirs]
    if not any(run.rows for run in runs):
        raise RunError(f"the metrics.jsonl of {', '.join(map(str, run_dirs))} hold no rows yet")
    summary = summarize(runs, sort_by)
    problem = places.enclosing(out)
    if problem:  # the run's next save or resume would delete the figures with that folder
        raise RunError(f"--out {problem}; choose a dir outside it")
    out.mkdir(parents=True, exist_ok=True)
    names = labels(runs)
    figures = [f for stem, title, metrics in FIGURES
               if (f := figure(runs, names, metrics, title, out / f"{stem}.png", smooth)) is not None]
    if len(paths) == 1 and (Path(paths[0]) / OPTUNA_FILE).exists():  # an Optuna study: its history
        study = objective_figure(summarize(runs), objective_sense(runs), out / "objective.png")
        figures += [study] if study is not None else []
    several = len(runs) > 1 or any(is_sweep(p) for p in paths)
    sections = sweep_sections(paths[0], runs, summary, sort_by)[0] if len(paths) == 1 and is_sweep(paths[0]) else []
    written = write_summary(summary, out, sections) if several else []
    print_summary(summary, console, title=" ".join(map(str, paths)))
    if chosen and len(paths) > 1 and console is not None:
        console.print(f"no --out given: figures and table written to {out}", highlight=False)
    return PlotResult(figures=figures, summary=summary, out=out, written=written)


def main(argv: List[str]) -> int:
    """`rlnotes plot DIR [DIR...] [--out DIR] [--sort METRIC] [--smooth W]`."""
    parser = Parser(prog="rlnotes plot", description="PNG figures of runs overlaid (reward, eval accuracy, KL, "
                    "loss, length; DPO margin and accuracy) and a table of their final metrics.")
    parser.add_argument("paths", nargs="+", metavar="DIR", help="run dirs (with metrics.jsonl) or multirun sweep dirs")
    parser.add_argument("--out", help="where the PNGs go (default: the one run or sweep dir given, the sweep dir the "
                        "runs share, or a plot-... dir beside the first one)")
    parser.add_argument("--sort", metavar="METRIC", help="sort the table by this metric's final value, best first "
                        "(default: reward/mean or the first key metric logged)")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="W",
                        help="exponential smoothing weight in [0, 1) for dense curves (default 0: none)")
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        raise UsageError(f"--smooth {args.smooth} must be in [0, 1)")
    console = stdout_console()
    try:
        result = plot(args.paths, args.out, args.sort, args.smooth, console)
    except RunError as e:
        raise UsageError(str(e)) from None
    console.print(f"figures: {', '.join(str(f) for f in result.figures + result.written)}")
    return 0
