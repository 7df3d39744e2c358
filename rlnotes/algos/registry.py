"""The registry of the algorithms, built from their declarations: every module of rlnotes.algos that
declares an ALGORITHM (its config schema, default task, batch arithmetic, checks and evaluation;
see rlnotes.core.algorithm.Algorithm), so adding an algorithm is one module there and its YAML in
conf/algo/.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict

import rlnotes.algos as algos
from rlnotes.core.algorithm import Algorithm
from rlnotes.core.checks import check_choice


def _declared() -> Dict[str, Algorithm]:
    found = {}
    for info in pkgutil.iter_modules(algos.__path__):
        if info.name == __name__.rsplit(".", 1)[1]:
            continue
        declaration = getattr(importlib.import_module(f"{algos.__name__}.{info.name}"), "ALGORITHM", None)
        if isinstance(declaration, Algorithm):
            found[declaration.name] = declaration
    return found


REGISTRY: Dict[str, Algorithm] = _declared()


def algorithm(name: str) -> Algorithm:
    """The algorithm that algo.name names (one line listing the names when it names none)."""
    check_choice("algo.name", name, REGISTRY)
    return REGISTRY[name]
