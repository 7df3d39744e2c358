"""The registry is built from the algorithms' own declarations: each algorithm module declares its
algorithm, each preset in conf/algo names one, and a new module is found without being listed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import yaml

import rlnotes.algos
import rlnotes.algos.registry
from rlnotes.algos.registry import REGISTRY
from rlnotes.core.algorithm import Algorithm

CONF = Path(__file__).resolve().parent.parent / "conf" / "algo"


def test_every_algorithm_module_declares_its_algorithm_and_the_registry_has_them_all():
    names = {p.stem for p in Path(rlnotes.algos.__file__).parent.glob("*.py") if p.stem not in ("__init__", "registry")}
    assert names == set(REGISTRY) == {"grpo", "reinforce", "ppo", "dpo", "sft", "rm"}
    for name, algo in REGISTRY.items():
        assert isinstance(algo, Algorithm) and algo.name == name and algo.schema.name == name


def test_every_preset_names_a_registered_algorithm():
    for path in CONF.glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        algo = data.get("algo", data)  # offline presets are global packages with an algo: section
        assert algo["name"] in REGISTRY, path.name
        assert algo["preset"] == path.stem, path.name


def test_a_new_module_with_a_declaration_is_registered_without_being_listed(tmp_path, monkeypatch):
    """One file is all it takes: a module beside the others that declares ALGORITHM."""
    (tmp_path / "echo.py").write_text(
        "from dataclasses import dataclass\n"
        "from rlnotes.core.algorithm import Algorithm, Shape\n"
        "from rlnotes.core.schema import AlgoConfig\n"
        "@dataclass\nclass EchoConfig(AlgoConfig):\n    name: str = 'echo'\n"
        "ALGORITHM = Algorithm(name='echo', schema=EchoConfig, train_step=lambda ctx: {}, samples=False,\n"
        "                      default_task='arith_sft', shape=lambda cfg: Shape('rows', 1, 1, 'rows'),\n"
        "                      evaluate=lambda ctx: {}, objective='eval/x', train_objective='loss')\n")
    monkeypatch.setattr(rlnotes.algos, "__path__", [*rlnotes.algos.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "rlnotes.algos.echo", raising=False)
    found = rlnotes.algos.registry._declared()
    assert set(found) == set(REGISTRY) | {"echo"} and found["echo"].default_task == "arith_sft"
    importlib.invalidate_caches()
