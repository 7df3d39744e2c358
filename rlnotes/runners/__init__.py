"""The algorithms, one module each, and the registry built from their declarations.

Each module reads like its algorithm (a `train_step(ctx) -> metrics`) and ends with its
`ALGORITHM`: its config schema, default task, batch arithmetic, checks and evaluation (see
rlnotes.core.algorithm.Algorithm). The registry takes every module of this package that declares
one, so adding an algorithm is one module here and its YAML in conf/algo/.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.checks import check_choice


def _declared() -> Dict[str, Algorithm]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        declaration = getattr(importlib.import_module(f"{__name__}.{info.name}"), "ALGORITHM", None)
        if isinstance(declaration, Algorithm):
            found[declaration.name] = declaration
    return found


REGISTRY: Dict[str, Algorithm] = _declared()


def algorithm(name: str) -> Algorithm:
    """The algorithm that algo.name names (one line listing the names when it names none)."""
    check_choice("algo.name", name, REGISTRY)
    return REGISTRY[name]
