"""The algorithms, one module each, and the registry built from their declarations.

Each module reads like its algorithm (a `train_step(ctx) -> metrics`) and ends with its
`ALGORITHM`: its config schema, default task, batch arithmetic, checks and evaluation (see
rlnotes.core.algorithm.Algorithm). Adding an algorithm is one module here, listed below, and its
YAML in conf/algo/.
"""

from __future__ import annotations

from typing import Dict

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.checks import check_choice
from rlnotes.runners import dpo, grpo, ppo, reinforce, rm, sft

REGISTRY: Dict[str, Algorithm] = {m.ALGORITHM.name: m.ALGORITHM for m in (grpo, reinforce, ppo, dpo, sft, rm)}


def algorithm(name: str) -> Algorithm:
    """The algorithm that algo.name names (one line listing the names when it names none)."""
    check_choice("algo.name", name, REGISTRY)
    return REGISTRY[name]
