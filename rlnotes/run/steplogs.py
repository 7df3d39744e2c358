"""The run's step logs: metrics.jsonl, eval.jsonl, samples.jsonl and warnings.log, each line of which
belongs to a step. Their rows (a torn last line noted and dropped), the last step logged, and the
logs cut back to a checkpoint's step when a run resumes from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional, Tuple

from rlnotes.core.errors import ConfigError
from rlnotes.run import files

# Run logs whose lines each belong to a step (JSON rows with a "step", warnings.log's "step N ...");
# lines after a resumed checkpoint's step are dropped.
STEP_LOGS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "warnings.log")


def log_rows(path: Path) -> Tuple[List[Tuple[str, dict]], Optional[str]]:
    """The (line, row) pairs of a step log, and a note when its last line was torn (a process
    killed mid-write: that line is dropped). Any other line that is not a row is an error."""
    lines = Path(path).read_text().splitlines()
    rows, torn = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = {"step": _line_step(line)} if line.startswith("step ") else json.loads(line)
            row["step"] + 0
        except (ValueError, TypeError, KeyError, IndexError):
            if number == len(lines):
                torn = f"{path}: its last line is torn (a write was cut off) and was dropped: {line[:60]!r}"
                break
            raise ConfigError(f"{path} line {number} is not a row of a step log ({line[:60]!r}); repair or delete "
                              "that line, then run again") from None
        rows.append((line, row))
    return rows, torn


def last_logged(run_dir: Path) -> Optional[int]:
    """The step of the last complete row of RUN_DIR/metrics.jsonl (None without one); reads its tail."""
    path = Path(run_dir) / STEP_LOGS[0]
    if not path.is_file():
        return None
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - (1 << 16)))
        tail = f.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, TypeError, KeyError):
            continue
    rows, _ = log_rows(path)  # a last row longer than the tail read
    return rows[-1][1]["step"] if rows else None


def _line_step(line: str) -> int:
    return int(line.split(" ", 2)[1]) if line.startswith("step ") else json.loads(line)["step"]


def logged_steps(run_dir: Path) -> Optional[List[int]]:
    """The steps of RUN_DIR/metrics.jsonl's rows (a torn last line left out); None without the file."""
    path = Path(run_dir) / STEP_LOGS[0]
    return [row["step"] for _, row in log_rows(path)[0]] if path.is_file() else None


def carry_logs(source_run: Optional[Path], run_dir: Path, step: int) -> List[str]:
    """Rewrite the run's step logs to the rows of `source_run`'s logs up to `step` (the run the
    checkpoint came from: this run's own dir, or another one's, whose history the new run
    continues); step -1 drops every row. Each file is replaced atomically. Returns a note for
    each torn last line dropped."""
    run_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    for name in STEP_LOGS:
        source = source_run / name if source_run is not None else run_dir / name
        if not source.is_file():
            continue
        rows, torn = log_rows(source)
        notes += [torn] if torn else []
        files.write_text(run_dir / name, "".join(line + "\n" for line, row in rows if row["step"] <= step))
    return notes
