"""Run outputs: metrics.jsonl (one JSON object per step) and the live console.

Metric names are grouped by what they measure (`reward/`, `kl/`, `policy/`, `completion/`,
`optim/`, `time/`, `perf/`) and are the same in the file and on screen; the README lists them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Dict, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Shown live beside the progress bar, in this order, when present.
LIVE = (("reward/mean", "reward"), ("kl/ref", "kl"), ("loss", "loss"))


def _clean(value):
    """JSON has no NaN: write null for a value that is not finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, console: Console, progress: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = self.path.open("a")
        self.console = console
        self.start = time.perf_counter()
        self.history: list[Dict[str, float]] = []
        self.progress: Optional[Progress] = None
        if progress:
            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[live]}"),
                                     console=console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, live="")
            self.progress.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(float(v)) for k, v in metrics.items()}, "time/elapsed_s": self.elapsed()}
        self.history.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.progress is not None:
            live = "  ".join(f"{short} {row[key]:.3g}" for key, short in LIVE if row.get(key) is not None)
            self.progress.update(self.task, completed=step, live=live)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.file.close()
