"""How a run looks on screen: its key metrics, a number in a few characters, the samples table, the
progress bar with the latest key metrics under it, the plain progress line for logs, and the
end-of-run summary. rlnotes.run.logger decides when each is shown.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

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
    ("sft_warmup/loss", "warm-up loss", None),
    ("kl/ref", "kl", None),
    ("loss", "loss", None),
    ("policy/entropy", "entropy", None),
    ("completion/len_mean", "length", None),
)


def stdout_console() -> Console:
    """A rich console on stdout; when stdout is not a terminal (a log file, a pipe, CI) it is wide
    enough that a table keeps one line per row, and a line printed with soft_wrap stays whole."""
    return Console() if sys.stdout.isatty() else Console(width=240)


def fmt(value: Optional[float]) -> str:
    """A metric in a few characters: 3 decimals below 10, 1 from 10, 3 significant digits when tiny or huge."""
    if value is None:
        return "-"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3g}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


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


def metrics_panel(latest: Mapping[str, float]) -> Optional[Table]:
    """The latest key metrics, label over value, for the live display."""
    shown = [(key, label) for key, label, _ in KEY_METRICS if key in latest]
    if not shown:
        return None
    table = Table.grid(padding=(0, 2))
    for _ in shown:
        table.add_column(justify="right")
    table.add_row(*[Text(label, style="dim") for _, label in shown])
    table.add_row(*[fmt(latest[key]) for key, _ in shown])
    return table


def live_progress(console: Console, total_steps: int, metrics: Callable[[], Optional[RenderableType]]) -> LiveProgress:
    """The started progress bar of a run of `total_steps` (task "train"), `metrics()` shown under it."""
    progress = LiveProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), SpeedColumn(),
                            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), metrics=metrics,
                            console=console, transient=False, speed_estimate_period=300.0)
    progress.add_task("train", total=total_steps)
    progress.start()
    return progress
