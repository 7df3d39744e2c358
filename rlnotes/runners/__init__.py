"""Algorithm runners, chosen by `algo.name`. Each is a `train_step(ctx) -> metrics` function
that reads like its algorithm; `train` drives any of them."""

from __future__ import annotations

import importlib
from typing import Callable

# algo.name -> module whose train_step implements it; imported only when chosen.
RUNNERS = {"grpo": "rlnotes.runners.grpo"}
RUNNERS.update({"reinforce": "rlnotes.runners.reinforce", "ppo": "rlnotes.runners.ppo"})
RUNNERS.update({"dpo": "rlnotes.runners.dpo", "sft": "rlnotes.runners.sft", "rm": "rlnotes.runners.rm"})


def get_runner(name: str) -> Callable:
    return importlib.import_module(RUNNERS[name]).train_step
