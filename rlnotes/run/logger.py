"""Run outputs: metrics.jsonl (one JSON object per step), the console, and the trackers' sinks.

Metric names are grouped by what they measure (`reward/`, `kl/`, `policy/`, `completion/`,
`optim/`, `time/`, `perf/`, `eval/`) and are the same in the file and on screen; docs/runs.md lists
them. On a terminal the run shows a progress bar (step, steps/s, elapsed, ETA) with the key
metrics under it; with `logging.progress=false` or when the output is not a terminal (CI, a log
file) it prints a plain line now and then instead. Every `logging.samples_every` steps a small
table shows a few sampled prompts, their completions and rewards (also appended to
samples.jsonl). Diagnostics (rlnotes.run.diagnostics) warn once per kind, on screen and in
warnings.log. The run ends with a one-screen summary: final and best key metrics, steps, wall
time, run dir. What each of these looks like is rlnotes.run.display.
"""

from __future__ import annotations

import io
import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from rich.console import Console, NewLine
from rich.control import Control
from rich.table import Table

from rlnotes.run import files
from rlnotes.run.diagnostics import Alert, Watcher
from rlnotes.run.display import (
    live_progress,
    metrics_panel,
    pick,
    plain_line,
    samples_table,
    summary_table,
)

# The diagnostics' warnings of a run, one line each: "step N kind: message".
WARNINGS = "warnings.log"

# Plain mode prints about this many lines a run when logging.print_every is null.
PLAIN_LINES = 20

# What the run's console said, as plain text (RunConsole); Hydra's log of the job (Python's logging)
# is the same file.
LOG = "train.log"


class RunConsole(Console):
    """The console of a run that also appends what it prints to RUN_DIR/train.log as plain text,
    from the moment the run owns its dir (open_log). What it printed before (the start line, a
    resume's notes) waits until then, and is dropped if the run is refused first: a refused command
    writes nothing. A quiet console (a rank other than 0) writes nothing either. The live progress
    bar is not printed; MetricsLogger gives the log its plain line instead (plain_log). A log that
    cannot be written (a full disk) is given up, never raised: the console's own output goes on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log_path: Optional[Path] = None
        self.pending: List[str] = []

    def print(self, *objects, **kwargs) -> None:
        super().print(*objects, **kwargs)
        if objects and not all(isinstance(o, (Control, NewLine)) for o in objects):  # not the live display's
            self.plain_log(*objects, **kwargs)

    def plain_log(self, *objects, **kwargs) -> None:
        """Append `objects` to the log as print would render them, without colours; not printed."""
        if self.quiet:
            return
        out = io.StringIO()
        Console(file=out, width=self.width, color_system=None, force_terminal=False,
                soft_wrap=self.soft_wrap).print(*objects, **kwargs)
        self.pending.append(out.getvalue())
        if self.log_path is not None:
            self._flush()

    def open_log(self, run_dir: Path) -> None:
        """From now on the run owns `run_dir`: what was said so far, and all that follows, goes to its log."""
        self.log_path = Path(run_dir) / LOG
        self._flush()

    def _flush(self) -> None:
        try:
            with files.append(self.log_path) as f:
                f.write("".join(self.pending))
        except OSError:
            self.log_path = None
        self.pending = []


def _clean(value):
    """JSON has no NaN: write null for a value that is not finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def passed_multiple(previous: int, step: int, every: Optional[int]) -> bool:
    """Whether going from step `previous` to `step` passed a multiple of `every` (steps may jump:
    PPO takes several optimizer steps a batch); never for null or 0. The schedule of samples
    tables, plain lines, checkpoints (trainer.save_every) and evaluations (trainer.eval_every)."""
    return bool(every) and step // every > previous // every


class MetricsLogger:
    """metrics.jsonl, the console and the trackers of one run.

    `log(step, metrics)` writes a row (to the file and to each sink: `sink.log(step, row)`);
    `observe(step, metrics, samples)` gets every step, logged or not: it moves the progress bar,
    runs the diagnostics watcher, and shows the samples table when due. `close()` ends the
    display and closes the sinks; `summary()` prints the end-of-run summary.
    """

    def __init__(self, run_dir: Path, total_steps: int, console: Console, progress: bool = True,
                 sinks: Sequence[object] = (), samples_every: Optional[int] = None, samples_shown: int = 4,
                 print_every: Optional[int] = None, watcher: Optional[Watcher] = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.file = files.append(self.path)  # never through a link, never into a hard-linked copy's file
        self.console, self.total = console, total_steps
        self.sinks = list(sinks)
        self.samples_every, self.samples_shown = samples_every, samples_shown
        self.print_every = print_every or max(1, math.ceil(total_steps / PLAIN_LINES))
        self.watcher = watcher
        self.start = time.perf_counter()
        self.latest: Dict[str, float] = {}   # the last finite value of each metric: eval rows come now and then
        self.alerts: List[Alert] = []
        self._last_samples = self._last_plain = 0   # the steps of the last samples table and plain line
        self._base = 0   # the step this process started from: a resumed run's checkpoint (see begin)
        self.progress = None
        if progress and console.is_terminal:
            self.progress = live_progress(console, total_steps, self.metrics_panel)
            self.task = self.progress.task_ids[0]

    @classmethod
    def for_run(cls, log, total_steps: int, run_dir: Path, console: Console, sinks: Sequence[object] = (),
                watcher: Optional[Watcher] = None) -> "MetricsLogger":
        """The logger a training run of `total_steps` gets from its `logging` config section `log`."""
        return cls(run_dir, total_steps, console, log.progress, sinks=sinks, samples_every=log.samples_every,
                   samples_shown=log.samples_shown, print_every=log.print_every, watcher=watcher)

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
        with files.append(self.run_dir / WARNINGS) as f:
            f.write(f"step {alert.step} {alert.kind}: {alert.message}\n")

    def show_samples(self, step: int, samples: Mapping[str, Sequence]) -> None:
        width = max(60, min(self.console.width, 160))
        self.console.print(samples_table(step, samples, self.samples_shown, width))
        with files.append(self.run_dir / "samples.jsonl") as f:
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
        if passed_multiple(self._last_plain, step, self.print_every) or step >= self.total:
            self._last_plain = step
            line = plain_line(step, self.total, self.latest, self.elapsed(), self._base)
            if self.progress is None:
                self.console.print(line, highlight=False, soft_wrap=True)
            elif isinstance(self.console, RunConsole):  # the live bar shows it; the log gets the line
                self.console.plain_log(line, highlight=False, soft_wrap=True)

    def metrics_panel(self) -> Optional[Table]:
        """The latest key metrics, label over value, for the live display."""
        return metrics_panel(self.latest)

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the display, close metrics.jsonl and every sink; a second call does nothing."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if not self.file.closed:
            try:
                self.file.close()
            except OSError:  # a row the disk had no room for: the write already raised, and said so
                pass
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


def read_warnings(path: Path) -> List[Alert]:
    """The diagnostics.Alert of each line MetricsLogger.warn wrote to a warnings.log (none without one)."""
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
