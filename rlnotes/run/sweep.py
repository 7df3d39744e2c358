"""Finished runs and sweeps on disk: their metrics, their overrides, and the summary table.

A run dir holds `metrics.jsonl` (one JSON object per logged step) and Hydra's
`.hydra/overrides.yaml` (the command-line overrides of that run); a multirun sweep dir holds
`multirun.yaml` and one numbered run dir per member. Everything here reads those files only, so
it works on runs that are still going and on runs copied from another machine.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

METRICS_FILE = "metrics.jsonl"
SWEEP_FILE = "multirun.yaml"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
# What a sweep member returned: {"status": "completed" | "failed", "objective": metric,
# "direction": "maximize" | "minimize", "value": x, "error": line}.
RESULT_FILE = "result.json"
# What Hydra's Optuna sweeper writes into the sweep dir at the end of a study.
OPTUNA_FILE = "optimization_results.yaml"

# The metrics a summary shows, in this order, when at least one run logged them, each with the
# direction that is better ("max", "min", or None where neither is: only the final value is shown).
KEY_METRICS: Tuple[Tuple[str, Optional[str]], ...] = (
    ("reward/mean", "max"), ("eval/accuracy", "max"), ("eval/reward", "max"),
    ("dpo/accuracy", "max"), ("dpo/margin", "max"), ("eval/dpo_accuracy", "max"), ("eval/dpo_margin", "max"),
    ("rm/accuracy", "max"), ("eval/rm_accuracy", "max"), ("eval/sft_loss", "min"),
    ("loss", None), ("kl/ref", None), ("completion/len_mean", None),
)
# Words in a metric's name that make lower values better when it is not in KEY_METRICS.
LOWER_IS_BETTER = ("loss", "kl", "ppl", "time/", "grad_norm", "truncated", "zero_std", "failures", "skipped", "len")


class RunError(ValueError):
    """A path that is not a run or a sweep, or a metric no run logged; the message says what to pass."""


@dataclass
class Run:
    """One run dir: its metrics rows (in step order) and its command-line overrides."""

    path: Path
    rows: List[Dict[str, Optional[float]]]
    overrides: List[str] = field(default_factory=list)
    # RESULT_FILE's content for a sweep member that finished (or failed); None otherwise.
    result: Optional[Dict[str, object]] = None

    def metrics(self) -> List[str]:
        """Every metric name the run logged, in first-seen order."""
        return list(dict.fromkeys(k for row in self.rows for k in row if k != "step"))

    def series(self, key: str) -> Tuple[List[float], List[float]]:
        """(steps, values) of `key`, leaving out the rows where it is missing or null."""
        points = [(row["step"], row[key]) for row in self.rows if row.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    def final(self, key: str) -> Optional[float]:
        """The last logged value of `key` (None if never logged)."""
        values = self.series(key)[1]
        return values[-1] if values else None

    def best(self, key: str, direction: Optional[str]) -> Optional[float]:
        """The largest ("max") or smallest ("min") logged value of `key`."""
        values = self.series(key)[1]
        if not values or direction is None:
            return None
        return max(values) if direction == "max" else min(values)

    @property
    def steps(self) -> Optional[int]:
        return int(self.rows[-1]["step"]) if self.rows else None

    @property
    def wall_s(self) -> Optional[float]:
        """Seconds from the start of training to the last logged row."""
        return self.final("time/elapsed_s")


def read_metrics(path: Path) -> List[Dict[str, Optional[float]]]:
    """The rows of a metrics.jsonl; a line that does not parse (a run killed mid-write) is skipped,
    and a step lower than the one before (a run resumed from an earlier checkpoint) replaces the
    rows from that step on."""
    rows: List[Dict[str, Optional[float]]] = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or "step" not in row:
            continue
        if rows and row["step"] < rows[-1]["step"]:
            rows = [r for r in rows if r["step"] < row["step"]]
        rows.append(row)
    return rows


def read_overrides(run_dir: Path) -> List[str]:
    """The run's command-line overrides as Hydra recorded them (empty for a run started without Hydra)."""
    path = Path(run_dir) / OVERRIDES_FILE
    if not path.exists():
        return []
    return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]


def read_result(run_dir: Path) -> Optional[Dict[str, object]]:
    """A sweep member's RESULT_FILE, or None (not a member, or one still running or killed)."""
    path = Path(run_dir) / RESULT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_result(run_dir: Path, status: str, objective: Tuple[str, str], value: Optional[float],
                 error: str = "") -> None:
    """Record what a sweep member returned: its (metric, direction) objective and value; a failed
    member has value None and its error line."""
    result = {"status": status, "objective": objective[0], "direction": objective[1],
              "value": value if value is not None and math.isfinite(value) else None, "error": error}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / RESULT_FILE).write_text(json.dumps(result) + "\n")


def load_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    result = read_result(run_dir)
    if not (run_dir / METRICS_FILE).exists():
        if result is not None:  # a member that failed before its first step
            return Run(run_dir, [], read_overrides(run_dir), result)
        raise RunError(f"{run_dir} has no {METRICS_FILE}; pass a run dir (one with {METRICS_FILE}) or a sweep dir")
    return Run(run_dir, read_metrics(run_dir / METRICS_FILE), read_overrides(run_dir), result)


def _member_order(path: Path) -> Tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def sweep_members(sweep_dir: Path) -> List[Path]:
    """The run dirs of a multirun sweep (its subdirs with a metrics.jsonl, or with a result of a
    member that failed before logging), by job number."""
    found = {p.parent for name in (METRICS_FILE, RESULT_FILE) for p in Path(sweep_dir).glob(f"*/{name}")}
    return sorted(found, key=_member_order)


def expand(paths: Iterable[Path]) -> List[Path]:
    """Run dirs from a mix of run dirs and sweep dirs, in the order given (a sweep's by job number)."""
    runs: List[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise RunError(f"{path} is not a directory; pass a run dir or a sweep dir")
        if (path / METRICS_FILE).exists():
            runs.append(path)
            continue
        members = sweep_members(path)
        if not members:
            raise RunError(f"{path} has no {METRICS_FILE} and no run dirs with one; pass a run dir or a sweep dir")
        runs.extend(members)
    return runs


def is_sweep(path: Path) -> bool:
    """True for a sweep dir: Hydra's multirun.yaml, or no metrics of its own but run dirs with them."""
    path = Path(path)
    return (path / SWEEP_FILE).exists() or (not (path / METRICS_FILE).exists() and bool(sweep_members(path)))


# ---------------------------------------------------------------------------------------------
# Telling runs apart by their overrides


def _split(override: str) -> Tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def differing_overrides(overrides: Sequence[Sequence[str]]) -> List[List[str]]:
    """For each run, its overrides whose key is missing from or set differently in another run.

    [["seed=0", "trainer.steps=2"], ["seed=1", "trainer.steps=2"]] -> [["seed=0"], ["seed=1"]].
    """
    parsed = [dict(_split(o) for o in run) for run in overrides]
    keys = list(dict.fromkeys(k for run in parsed for k in run))
    varying = [k for k in keys if len({run.get(k) for run in parsed}) > 1]
    return [[f"{k}={run[k]}" for k in varying if k in run] for run in parsed]


def labels(runs: Sequence[Run]) -> List[str]:
    """A short, distinct name per run for legends and tables: the overrides that set it apart,
    else its dir name; a clash is resolved by prefixing the parent dir's name."""
    names = [" ".join(d) or run.path.name for d, run in zip(differing_overrides([r.overrides for r in runs]), runs)]
    if len(set(names)) < len(names):
        names = [f"{run.path.parent.name}/{run.path.name}" + (f" {n}" if n != run.path.name else "")
                 for n, run in zip(names, runs)]
    return names


def sweep_dir_of(run_dir: Path) -> Optional[Path]:
    """The sweep dir a run belongs to (the parent with Hydra's multirun.yaml), or None."""
    parent = Path(run_dir).resolve().parent
    return parent if (parent / SWEEP_FILE).exists() else None


def swept_keys(sweep_overrides: Sequence[str]) -> List[str]:
    """The keys a sweep's command line varies: ["seed"] for ["seed=0,1", "trainer.steps=2"]."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(sweep_overrides))
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def swept_overrides(run_dir: Path) -> List[str]:
    """The overrides of a sweep member that its sweep varied ("seed=1" for `-m seed=0,1 x=2`).
    Empty outside a sweep."""
    sweep = sweep_dir_of(run_dir)
    if sweep is None:
        return []
    config = yaml.safe_load((sweep / SWEEP_FILE).read_text()) or {}
    keys = set(swept_keys(((config.get("hydra") or {}).get("overrides") or {}).get("task") or []))
    return [o for o in read_overrides(run_dir) if _split(o)[0] in keys]


# ---------------------------------------------------------------------------------------------
# The summary table


def direction(metric: str) -> str:
    """Which way `metric` is better, for sorting: its KEY_METRICS direction, else by its name."""
    known = dict(KEY_METRICS).get(metric)
    if known:
        return known
    return "min" if any(word in metric for word in LOWER_IS_BETTER) else "max"


def sort_metric(runs: Sequence[Run], sort_by: Optional[str]) -> Optional[str]:
    """The metric to sort by: `sort_by` (which some run must have logged), else the first key
    metric any run logged."""
    logged = list(dict.fromkeys(m for run in runs for m in run.metrics()))
    if sort_by is not None:
        if sort_by not in logged:
            raise RunError(f"sort metric {sort_by!r} was not logged by these runs; choose one of: {', '.join(logged)}")
        return sort_by
    return next((m for m, _ in KEY_METRICS if m in logged), None)


# ---------------------------------------------------------------------------------------------
# The objective a sweep member returns to its sweeper

# The held-out score an algorithm's runs always log (their own eval_every): the auto objective.
def objective_metric(cfg, algo) -> Tuple[str, str]:
    """(metric, "maximize" or "minimize") of sweep.objective and sweep.direction, auto resolved: the
    algorithm `algo`'s held-out score when the run evaluates, else its training metric
    (reward/mean when it samples); the sense follows the metric."""
    metric = cfg.sweep.objective
    if metric == "auto":
        metric = algo.objective if cfg.trainer.eval_every else algo.train_objective
    return metric, cfg.sweep.direction or ("maximize" if direction(metric) == "max" else "minimize")


def objective_value(rows: Sequence[Dict[str, Optional[float]]], metric: str, last_steps: int) -> Optional[float]:
    """A held-out metric (eval/*): its final value, the score of the trained policy. A training
    metric: its mean over the last `last_steps` rows that logged it. None if never logged."""
    values = [row[metric] for row in rows if row.get(metric) is not None]
    if not values:
        return None
    if metric.startswith("eval/"):
        return float(values[-1])
    tail = values[-last_steps:]
    return float(sum(tail) / len(tail))


@dataclass
class Summary:
    """One row per run: run, overrides, steps, wall_s, then `<metric>` (final) and `<metric> best`."""

    columns: List[str]
    rows: List[Dict[str, object]]
    sort_by: Optional[str]


def _sort(rows: List[Dict[str, object]], key: Optional[str], sense: Optional[str]) -> None:
    """Best first by column `key` ("max" or "min" better); rows without it last, in their order."""
    if key is not None:
        sign = -1.0 if sense == "max" else 1.0
        rows.sort(key=lambda r: (r[key] is None, sign * r[key] if r[key] is not None else 0.0))


def summarize(runs: Sequence[Run], sort_by: Optional[str] = None) -> Summary:
    """Final and best values of the key metrics of every run, best run first by `sort_by`; sweep
    members add their status and the objective they returned, which ranks them unless `sort_by`
    is given."""
    metric = sort_metric(runs, sort_by)
    logged = {m for run in runs for m in run.metrics()}
    shown = [(m, d) for m, d in KEY_METRICS if m in logged]
    if metric is not None and metric not in dict(shown):
        shown.insert(0, (metric, None))
    results = [run.result for run in runs if run.result is not None]
    failed = any(r.get("status") == "failed" for r in results)
    columns = ["run", "overrides"] + (["status", "objective"] if results else []) + ["steps", "wall_s"]
    for m, d in shown:
        columns += [m, f"{m} best"] if d else [m]
    columns += ["error"] if failed else []
    same_parent = len({run.path.resolve().parent for run in runs}) == 1
    rows = []
    for run, label in zip(runs, differing_overrides([r.overrides for r in runs])):
        row: Dict[str, object] = {"run": run.path.name if same_parent else str(run.path),
                                  "overrides": " ".join(label), "steps": run.steps, "wall_s": run.wall_s}
        if results:  # a member without a result is still running, or was killed
            result = run.result or {}
            row.update(status=result.get("status", "unfinished"), objective=result.get("value"))
        if failed:
            row["error"] = (run.result or {}).get("error") or None
        for m, d in shown:
            row[m] = run.final(m)
            if d:
                row[f"{m} best"] = run.best(m, d)
        rows.append(row)
    key, sense = metric, direction(metric) if metric is not None else None
    if sort_by is None and results:
        key, sense = "objective", objective_sense(runs)
        metric = f"objective ({results[0].get('objective')})"
    _sort(rows, key, sense)
    return Summary(columns, rows, metric)


def _mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (n - 1; None for one value) of the finite values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, std


def seed_groups(runs: Sequence[Run], sort_by: Optional[str] = None) -> Optional[Summary]:
    """Members that differ only by their seed, one row per configuration: its seeds (completed of
    all) and the mean and spread (sample std) over them of the objective and of the key metrics'
    final values, best configuration first. None when no configuration ran with several seeds."""
    unseeded = differing_overrides([[o for o in run.overrides if _split(o)[0] != "seed"] for run in runs])
    groups: Dict[str, List[Run]] = {}
    for run, label in zip(runs, unseeded):
        groups.setdefault(" ".join(label), []).append(run)
    if all(len(members) < 2 for members in groups.values()):
        return None
    results = [run.result for run in runs if run.result is not None]
    logged = {m for run in runs for m in run.metrics()}
    metrics = [(m, d) for m, d in KEY_METRICS if d and m in logged]
    if sort_by is not None and sort_by not in dict(metrics):
        metrics.insert(0, (sort_by, direction(sort_by)))
    if results:
        metrics.insert(0, ("objective", objective_sense(runs)))
    columns = ["configuration", "seeds"] + [f"{m} {stat}" for m, _ in metrics for stat in ("mean", "std")]
    rows = []
    for label, members in groups.items():
        done = [r for r in members if (r.result or {}).get("status", "completed") == "completed"]
        row: Dict[str, object] = {"configuration": label or "(one configuration)",
                                  "seeds": f"{len(done)}/{len(members)}"}
        for m, _ in metrics:
            values = [(r.result or {}).get("value") if m == "objective" else r.final(m) for r in done]
            row[f"{m} mean"], row[f"{m} std"] = _mean_std(values)
        rows.append(row)
    key, sense = (f"{metrics[0][0]} mean", metrics[0][1]) if metrics else (None, None)
    if sort_by is not None:
        key, sense = f"{sort_by} mean", direction(sort_by)
    _sort(rows, key, sense)
    return Summary(columns, rows, key)


def optuna_best(sweep_dir: Path) -> Optional[str]:
    """The best trial of an Optuna study as a line (its overrides and objective) from what Hydra's
    optuna sweeper wrote into the sweep dir; None for other sweeps (or a multi-objective study:
    its Pareto front stays in OPTUNA_FILE)."""
    path = Path(sweep_dir) / OPTUNA_FILE
    best = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    if "best_params" not in best:
        return None
    overrides = " ".join(f"{k}={v}" for k, v in (best.get("best_params") or {}).items())
    return f"best trial: {overrides} with objective {_cell(best.get('best_value'))}"


def optuna_section(sweep_dir: Path, summary: Summary, sense: str) -> Optional[str]:
    """Markdown for an Optuna study: its best trial and its history, trial by trial with the best
    objective so far."""
    best = optuna_best(sweep_dir)
    if best is None:
        return None
    lines = ["## Optuna study", "", best, "", "| trial | status | objective | best so far | overrides |",
             "|---|---|---|---|---|"]
    lines += [f"| {h['trial']} | {h['status']} | {_cell(h['objective'])} | {_cell(h['best'])} | {h['overrides']} |"
              for h in optuna_history(summary, sense)]
    return "\n".join(lines) + "\n"


def objective_sense(runs: Sequence[Run]) -> str:
    """"max" or "min": which way the objective of these sweep members is better ("max" without one)."""
    result = next((run.result for run in runs if run.result is not None), {})
    return "min" if result.get("direction") == "minimize" else "max"


def optuna_history(summary: Summary, sense: str) -> List[Dict[str, object]]:
    """The members of a sweep summary in trial order (job number), each with the best objective so
    far (`sense`: "max" or "min" is better)."""
    rows = sorted((r for r in summary.rows if str(r["run"]).isdigit()), key=lambda r: int(str(r["run"])))
    history, best = [], None
    pick = min if sense == "min" else max
    for row in rows:
        value = row.get("objective")
        if value is not None:
            best = value if best is None else pick(best, value)
        history.append({"trial": int(str(row["run"])), "status": row.get("status"), "objective": value,
                        "best": best, "overrides": row["overrides"]})
    return history


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def to_markdown(summary: Summary) -> str:
    """The summary as a GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(summary.columns) + " |", "|" + "---|" * len(summary.columns)]
    lines += ["| " + " | ".join(_cell(row[c]).replace("|", "\\|") for c in summary.columns) + " |"
              for row in summary.rows]
    return "\n".join(lines) + "\n"


def write_csv(summary: Summary, path: Path) -> Path:
    """The summary's rows at full precision; an empty cell for a missing value."""
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=summary.columns)
        writer.writeheader()
        writer.writerows({c: ("" if row[c] is None else row[c]) for c in summary.columns} for row in summary.rows)
    return Path(path)


def write_summary(summary: Summary, out_dir: Path, sections: Sequence[str] = ()) -> List[Path]:
    """summary.md (a markdown table, then `sections`) and summary.csv (full precision) in `out_dir`."""
    out_dir = Path(out_dir)
    md = out_dir / "summary.md"
    note = f"sorted by {summary.sort_by}, best first\n\n" if summary.sort_by else ""
    md.write_text(note + to_markdown(summary) + "".join(f"\n{section}" for section in sections))
    return [md, write_csv(summary, out_dir / "summary.csv")]


def stdout_console():
    """A rich console on stdout; when stdout is not a terminal (a log file, a pipe) it is wide
    enough that a table keeps one line per run."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=240)


def print_summary(summary: Summary, console=None, title: Optional[str] = None) -> None:
    """The summary as a rich table on `console` (stdout by default)."""
    from rich.table import Table

    console = console or stdout_console()
    sorted_by = f" (sorted by {summary.sort_by}, best first)" if summary.sort_by else ""
    table = Table(title=(title or "runs") + sorted_by, title_justify="left")
    for column in summary.columns:
        text = column in ("run", "overrides", "configuration", "error")
        table.add_column(column, justify="left" if text else "right", overflow="fold", no_wrap=not text)
    for row in summary.rows:
        table.add_row(*(_cell(row[c]) for c in summary.columns))
    console.print(table)


def sweep_sections(sweep_dir: Path, runs: Sequence[Run], summary: Summary,
                   sort_by: Optional[str] = None) -> Tuple[List[str], Optional[Summary]]:
    """What summary.md adds below the table for a sweep: its configurations over their seeds (also
    returned, for summary_by_config.csv) and an Optuna study's best trial and history."""
    sections = []
    groups = seed_groups(runs, sort_by)
    if groups is not None:
        sections.append("## Configurations over their seeds (mean and sample std)\n\n" + to_markdown(groups))
    study = optuna_section(sweep_dir, summary, objective_sense(runs))
    if study is not None:
        sections.append(study)
    return sections, groups


def summarize_sweep(sweep_dir: Path, sort_by: Optional[str] = None, console=None) -> Summary:
    """Summarize every member of a sweep: print the table and write summary.md/csv into the sweep
    dir; with several seeds per configuration also their mean and spread (summary_by_config.csv),
    and for an Optuna study its best trial and history (in summary.md)."""
    runs = [load_run(p) for p in expand([sweep_dir])]
    summary = summarize(runs, sort_by)
    print_summary(summary, console, title=f"sweep {Path(sweep_dir)}")
    sections, groups = sweep_sections(sweep_dir, runs, summary, sort_by)
    written = write_summary(summary, sweep_dir, sections)
    if groups is not None:
        print_summary(groups, console, title="configurations over their seeds")
        written.append(write_csv(groups, Path(sweep_dir) / "summary_by_config.csv"))
    best = optuna_best(sweep_dir)
    if console is not None:
        if best is not None:
            console.print(best, highlight=False)
        console.print(f"written: {', '.join(map(str, written))}")
    return summary


def failed_members(summary: Summary) -> List[str]:
    """The runs of a sweep summary whose member failed."""
    return [str(row["run"]) for row in summary.rows if row.get("status") == "failed"]


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency; this keeps the module importable alone
    Callback = object  # type: ignore[assignment,misc]


class SweepSummary(Callback):
    """Hydra callback (see conf/config.yaml): after `rlnotes train -m ...`, the summary table of
    every member, printed and written to the sweep dir, sorted by `logging.sort_by` (else by the
    objective the members returned). The members that failed are kept in `failed` for the command's
    exit status."""

    failed: List[str] = []

    def on_multirun_end(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        console = stdout_console()
        sweep_dir = Path(config.hydra.sweep.dir)
        sort_by = OmegaConf.select(config, "logging.sort_by", default=None)
        # The runs are done and saved: a summary that cannot be made must not fail the sweep.
        for attempt in (sort_by, None) if sort_by is not None else (None,):
            try:
                summary = summarize_sweep(sweep_dir, attempt, console)
            except RunError as e:
                console.print(f"[yellow]rlnotes: {e}[/]" + (" (logging.sort_by)" if attempt else ""))
                continue
            SweepSummary.failed = failed_members(summary)
            if SweepSummary.failed:
                console.print(f"[red]rlnotes: {len(SweepSummary.failed)} of {len(summary.rows)} members failed[/] "
                              f"(runs {', '.join(SweepSummary.failed)} of {sweep_dir}: the error column of "
                              "summary.md, and their logs)", highlight=False)
            return
