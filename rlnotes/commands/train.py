"""A training run from a composed config: the algorithm algo.name names, trained in `run_dir`."""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from rich.console import Console

from rlnotes.runners import algorithm
from rlnotes.training import loop


def train(cfg, run_dir: Path, console: Console) -> Dict[str, float]:
    """Train the policy of `cfg` (composed, resolved and validated) with its algorithm; the last
    step's metrics."""
    return loop.train(cfg, algorithm(cfg.algo.name), run_dir, console)
