"""Run outputs: metrics.jsonl (one JSON object per step), the console, and the trackers' sinks.

Metric names are grouped by what they measure (`reward/`, `kl/`, `policy/`, `completion/`,
`optim/`, `time/`, `perf/`, `eval/`) and are the same in the file and on screen; the README lists
them. On a terminal the run shows a progress bar (step, steps/s, elapsed, ETA) with the key
metrics under it; with `logging.progress=false` or when the output is not a terminal (CI, a log
file) it prints a plain line now and then instead. Every `logging.samples_every` steps a small
table shows a few sampled prompts, their completions and rewards (also appended to
samples.jsonl). Diagnostics (rlnotes.run.diagnostics) warn once per kind, on screen and in
warnings.log. The run ends with a one-screen summary: final and best key metrics, steps, wall
time, run dir.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from rich.console import Console, Group, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

# The metrics shown beside the progress bar and in the summary, in this order, when a run logs
# them: (key, label, which value is best: "max", "min", or None when neither is better).
KEY_METRICS = (
    ("reward/mean", "reward", "max"),
    ("eval/accuracy", "eval acc", "max"),
    ("eval/reward", "eval reward", "max"),
    ("dpo/accuracy", "pair acc", "max"),
    ("eval/dpo_accuracy", "eval pair acc", "max"),
    ("rm/accuracy", "rm acc", "max"),
    ("eval/rm_accuracy", "eval rm acc", "max"),
    ("eval/sft_loss", "eval loss", "min"),
    ("kl/ref", "kl", None),
    ("loss", "loss", None),
    ("policy/entropy", "entropy", None),
    ("completion/len_mean", "length", None),
)

# The diagnostics' warnings of a run, one line each: "step N kind: message".
WARNINGS = "warnings.log"

# Plain mode prints about this many lines a run when logging.print_every is null.
PLAIN_LINES = 20


def _clean(value):
    """JSON has no NaN: write null for a value that is not finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def fmt(value: Optional[float]) -> str:
    """A metric in a few characters: 3 decimals below 10, 1 from 10, 3 significant digits when tiny or huge."""
    if value is None:
        return "-"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3g}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def passed_multiple(previous: int, step: int, every: Optional[int]) -> bool:
    """Whether going from step `previous` to `step` passed a multiple of `every` (steps may jump:
    PPO takes several optimizer steps a batch); never for null or 0. The schedule of samples
    tables, plain lines, checkpoints (trainer.save_every) and evaluations (trainer.eval_every)."""
    return bool(every) and step // every > previous // every


def shorten(text: str, width: int) -> str:
    """One line of at most `width` characters: newlines shown as ⏎, the middle cut out (an answer
    is often at the end of a completion, the question at the end of a prompt)."""
    text = text.replace("\r", "").replace("\n", "⏎")
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def readable(value) -> str:
    """A prompt or completion as text: itself, or a conversation's turns as "role: content" lines."""
    if isinstance(value, str):
        return value
    return "\n".join(f"{m['role']}: {m['content']}" for m in value)


def pick(n: int, k: int) -> List[int]:
    """k indices spread evenly over n (a batch lists a prompt's G completions together, so evenly
    spaced picks show different prompts)."""
    k = min(k, n)
    return [i * n // k for i in range(k)]


def samples_table(step: int, samples: Mapping[str, Sequence], k: int, width: int = 100) -> Table:
    """A few of a batch's prompts, completions (shortened) and rewards, then the columns reward
    functions added with log_extra (samples["extra"]: column -> one value per sample)."""
    table = Table(title=f"samples at step {step}", title_justify="left", show_lines=False, expand=False)
    table.add_column("prompt", overflow="fold", max_width=width * 2 // 5)
    table.add_column("completion", overflow="fold", max_width=width * 3 // 5)
    table.add_column("reward", justify="right")
    extra = samples.get("extra") or {}
    for column in extra:
        table.add_column(column, overflow="fold", max_width=width // 5)
    for i in pick(len(samples["completions"]), k):
        prompt, completion = samples["prompts"][i], samples["completions"][i]
        table.add_row(shorten(readable(prompt), width * 2 // 5), shorten(readable(completion), width * 3 // 5),
                      fmt(samples["rewards"][i]), *[shorten(str(values[i]), width // 5) for values in extra.values()])
    return table


def summarize(rows: Iterable[Mapping[str, object]]) -> List[Dict[str, object]]:
    """Final and best value of each key metric that `rows` (metrics.jsonl rows) hold, in KEY_METRICS
    order: [{key, label, final, final_step, best, best_step}] (best None where neither is better)."""
    found: Dict[str, Dict[str, object]] = {}
    for row in rows:
        step = row.get("step")
        for key, label, better in KEY_METRICS:
            value = row.get(key)
            if value is None or not math.isfinite(value):
                continue
            s = found.setdefault(key, {"key": key, "label": label, "best": None, "best_step": None})
            s["final"], s["final_step"] = value, step
            if better and (s["best"] is None or (value > s["best"] if better == "max" else value < s["best"])):
                s["best"], s["best_step"] = value, step
    return [found[key] for key, _, _ in KEY_METRICS if key in found]


def summary_table(rows: Sequence[Mapping[str, object]], run_dir: Path, wall_s: float,
                  alerts: Sequence[object] = (), saved: Optional[Path] = None, start: int = 0) -> Group:
    """The end-of-run summary: steps and wall time, final and best key metrics, warnings, where it all is.
    `wall_s` is this process's time, from step `start` (a resumed run's checkpoint) on."""
    steps = max((int(r.get("step", 0)) for r in rows), default=0)
    done = steps - start
    head = Text.assemble(("done", "bold green"), f": {steps} steps"
                         + (f", resumed at step {start}: {done} steps" if start else "") + f" in {wall_s:.1f} s")
    if done > 0 and wall_s > 0:
        head.append(f" ({done / wall_s:.3g} steps/s)" if done >= wall_s else f" ({wall_s / done:.3g} s/step)")
    table = Table(box=None, padding=(0, 2), show_edge=False)
    for column, justify in (("metric", "left"), ("final", "right"), ("best", "right"), ("at step", "right")):
        table.add_column(column, justify=justify, style="bold" if column == "metric" else None)
    for s in summarize(rows):
        best = s["best"] is not None
        table.add_row(s["label"], fmt(s["final"]), fmt(s["best"]) if best else "", str(s["best_step"]) if best else "")
    lines: List[RenderableType] = [head, table]
    for alert in alerts:
        lines.append(Text(f"warned at step {alert.step}: {alert.kind} (see warnings.log)", style="yellow"))
    lines.append(Text(f"run dir: {run_dir}"))
    if saved:
        lines.append(Text(f"policy:  {saved}"))
    return Group(*lines)


def plain_line(step: int, total: int, latest: Mapping[str, float], elapsed: float, start: int = 0) -> str:
    """One progress line for logs: step, key metrics, speed and time left (`elapsed` seconds since
    this process started at step `start`)."""
    parts = [f"step {step}/{total}"]
    parts += [f"{label} {fmt(latest[key])}" for key, label, _ in KEY_METRICS if key in latest]
    if step > start and elapsed > 0:
        rate = (step - start) / elapsed
        parts.append(f"{rate:.3g} steps/s" if rate >= 1 else f"{1 / rate:.3g} s/step")
        parts.append(f"eta {time.strftime('%H:%M:%S', time.gmtime(max(total - step, 0) / rate))}")
    return "  ".join(parts)


class SpeedColumn(ProgressColumn):
    """Steps per second, or seconds per step when a step takes longer than a second."""

    def render(self, task: Task) -> Text:
        speed = task.speed
        if not speed:
            return Text("- steps/s", style="progress.data.speed")
        return Text(f"{speed:.3g} steps/s" if speed >= 1 else f"{1 / speed:.3g} s/step", style="progress.data.speed")


class LiveProgress(Progress):
    """The progress bar with a compact table of the latest key metrics under it."""

    def __init__(self, *columns, metrics, **kwargs):
        self.metrics = metrics  # before Progress.__init__, which renders once
        super().__init__(*columns, **kwargs)

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        panel = self.metrics()
        if panel is not None:
            yield panel


class MetricsLogger:
    """metrics.jsonl, the console and the trackers of one run.

    `log(step, metrics)` writes a row (to the file and to each sink: `sink.log(step, row)`);
    `observe(step, metrics, samples)` gets every step, logged or not: it moves the progress bar,
    runs the diagnostics watcher, and shows the samples table when due. `close()` ends the
    display and closes the sinks; `summary()` prints the end-of-run summary.
    """

    def __init__(self, run_dir: Path, total_steps: int, console: Console, progress: bool = True,
                 sinks: Sequence[object] = (), samples_every: Optional[int] = None, samples_shown: int = 4,
                 print_every: Optional[int] = None, watcher=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.console, self.total = console, total_steps
        self.sinks = list(sinks)
        self.samples_every, self.samples_shown = samples_every, samples_shown
        self.print_every = print_every or max(1, math.ceil(total_steps / PLAIN_LINES))
        self.watcher = watcher
        self.start = time.perf_counter()
        self.latest: Dict[str, float] = {}   # the last finite value of each metric: eval rows come now and then
        self.alerts: List[object] = []
        self._last_samples = self._last_plain = 0   # the steps of the last samples table and plain line
        self._base = 0   # the step this process started from: a resumed run's checkpoint (see begin)
        self.progress: Optional[LiveProgress] = None
        if progress and console.is_terminal:
            self.progress = LiveProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), SpeedColumn(),
                                         TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                         metrics=self.metrics_panel, console=console, transient=False,
                                         speed_estimate_period=300.0)
            self.task = self.progress.add_task("train", total=total_steps)
            self.progress.start()

    @classmethod
    def for_run(cls, cfg, algo, run_dir: Path, console: Console, sinks: Sequence[object] = ()) -> "MetricsLogger":
        """The logger a training run gets from its config (logging.*), with the diagnostics watcher."""
        from rlnotes.run.diagnostics import Watcher

        log = cfg.logging
        return cls(run_dir, cfg.trainer.steps, console, log.progress, sinks=sinks, samples_every=log.samples_every,
                   samples_shown=log.samples_shown, print_every=log.print_every, watcher=Watcher(cfg, algo))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    # -- every step ---------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """The run starts at optimizer step `step` (0, or a resumed checkpoint's): the progress bar,
        its speed, and the samples and plain-line schedules count from there."""
        self._base = self._last_samples = self._last_plain = step
        if self.progress is not None:
            self.progress.reset(self.task, completed=step)
        if step and self.watcher is not None:  # resumed: the diagnostics see the steps before, and stay quiet on
            earlier = read_warnings(self.run_dir / WARNINGS)  # what they warned of then (logs cut to `step`)
            self.watcher.restore(self.rows(), earlier)
            self.alerts.extend(earlier)

    def _advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def observe(self, step: int, metrics: Mapping[str, float], samples: Optional[Mapping[str, Sequence]] = None):
        """A finished step, logged or not: progress, diagnostics, and the samples table when due."""
        self._advance(step)
        if self.watcher is not None:
            for alert in self.watcher.observe(step, metrics):
                self.warn(alert)
        if samples and samples.get("completions") and passed_multiple(self._last_samples, step, self.samples_every):
            self._last_samples = step
            self.show_samples(step, samples)

    def warn(self, alert) -> None:
        """Show a diagnostic once, and append it to warnings.log."""
        self.alerts.append(alert)
        self.console.print(f"[yellow]warning at step {alert.step} ({alert.kind}):[/] {alert.message}", highlight=False)
        with (self.run_dir / WARNINGS).open("a") as f:
            f.write(f"step {alert.step} {alert.kind}: {alert.message}\n")

    def show_samples(self, step: int, samples: Mapping[str, Sequence]) -> None:
        width = max(60, min(self.console.width, 160))
        self.console.print(samples_table(step, samples, self.samples_shown, width))
        with (self.run_dir / "samples.jsonl").open("a") as f:
            extra = samples.get("extra") or {}
            for i in pick(len(samples["completions"]), self.samples_shown):
                logged = {column: _clean(values[i]) for column, values in extra.items()}   # reward functions' log_extra
                f.write(json.dumps({"step": step, "prompt": samples["prompts"][i],
                                    "completion": samples["completions"][i],
                                    "reward": _clean(float(samples["rewards"][i])), **logged}, default=str) + "\n")

    # -- logged rows --------------------------------------------------------------------------

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(float(v)) for k, v in metrics.items()}, "time/elapsed_s": self.elapsed()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.log(step, row)
        self.latest.update({k: v for k, v in row.items() if v is not None})
        self._advance(step)
        if self.progress is None and (passed_multiple(self._last_plain, step, self.print_every) or step >= self.total):
            self._last_plain = step
            self.console.print(plain_line(step, self.total, self.latest, self.elapsed(), self._base), highlight=False,
                               soft_wrap=True)

    def metrics_panel(self) -> Optional[Table]:
        """The latest key metrics, label over value, for the live display."""
        shown = [(key, label) for key, label, _ in KEY_METRICS if key in self.latest]
        if not shown:
            return None
        table = Table.grid(padding=(0, 2))
        for _ in shown:
            table.add_column(justify="right")
        table.add_row(*[Text(label, style="dim") for _, label in shown])
        table.add_row(*[fmt(self.latest[key]) for key, _ in shown])
        return table

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the display, close metrics.jsonl and every sink; a second call does nothing."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if not self.file.closed:
            self.file.close()
            for sink in self.sinks:
                sink.close()

    def rows(self) -> List[dict]:
        """Every row of metrics.jsonl, those of an earlier, resumed process included."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def summary(self, saved: Optional[Path] = None) -> None:
        """Print the end-of-run summary (after close)."""
        self.console.print(summary_table(self.rows(), self.run_dir, self.elapsed(), self.alerts, saved, self._base),
                           soft_wrap=True)


def read_warnings(path: Path) -> List[object]:
    """The diagnostics.Alert of each line MetricsLogger.warn wrote to a warnings.log (none without one)."""
    from rlnotes.run.diagnostics import Alert

    if not path.is_file():
        return []
    alerts = []
    for line in path.read_text().splitlines():
        head, _, message = line.partition(": ")
        _, step, kind = head.split(" ", 2)
        alerts.append(Alert(kind, int(step), message))
    return alerts


class NullLogger:
    """The logger of every rank but 0 when several processes train: they compute the same metrics
    rank 0 logs, so they write, show and warn nothing."""

    def begin(self, step: int) -> None:
        pass

    def observe(self, step: int, metrics: Mapping[str, float], samples: Optional[Mapping[str, Sequence]] = None):
        pass

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass

    def summary(self, saved: Optional[Path] = None) -> None:
        pass


# Loggers whose warnings speak to the developers of those libraries, not to a user of rlnotes.
QUIET_LOGGERS = ("transformers", "peft", "datasets", "huggingface_hub", "accelerate")


def quiet_libraries() -> None:
    """Hide the deprecation notices and advice that libraries below rlnotes print for their own
    developers; rlnotes' own warnings and every error still show."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
