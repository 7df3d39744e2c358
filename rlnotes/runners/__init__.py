"""Algorithm runners, chosen by `algo.name`. Each is a `train_step(ctx) -> metrics` function
that reads like its algorithm; `train` drives any of them."""

from __future__ import annotations

import importlib
from typing import Callable

# algo.name -> module whose train_step implements it; imported only when chosen.
RUNNERS = {name: f"rlnotes.runners.{name}" for name in ("grpo", "reinforce", "ppo", "dpo", "sft", "rm")}


def get_runner(name: str) -> Callable:
    return importlib.import_module(RUNNERS[name]).train_step
