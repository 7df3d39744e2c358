"""docs/trl.md's GRPOConfig/DPOConfig table against what it describes: every rlnotes key it names
exists, the rlnotes default it states is the one `rlnotes train algo=grpo|dpo` composes, and
(where trl is installed: pip extra bench) the TRL default it states is the one TRL's config has."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import compose

DOC = Path(__file__).resolve().parents[1] / "docs" / "trl.md"
KEY = re.compile(r"^(algo|optim|trainer|rollout|model|reward|hardware|data)\.[a-z_.]+$")


def tables() -> dict:
    """{"GRPOConfig": rows, "DPOConfig": rows} of the key-by-key section, each row its 4 cells."""
    text = DOC.read_text()
    found = {}
    for name in ("GRPOConfig", "DPOConfig"):
        head = text.index(f"| TRL ({name}) |")
        lines = text[head:].split("\n\n")[0].splitlines()[2:]
        found[name] = [[c.strip() for c in line.strip()[1:-1].split("|")] for line in lines]
        assert all(len(row) == 4 for row in found[name]), name
    return found


def ticked(cell: str) -> list:
    return re.findall(r"`([^`]+)`", cell)


def first_value(cell: str):
    """The value a default cell starts with (`x` or a plain token), as Python reads it; None when it
    starts with words ("LoRA", "none", "no single key")."""
    word = cell[1:cell.index("`", 1)] if cell.startswith("`") else re.split(r"[\s,;:]", cell)[0]
    if word in ("null", "None"):
        return None
    if word.lower() in ("true", "false"):
        return word.lower() == "true"
    try:
        return ast.literal_eval(word)
    except (ValueError, SyntaxError):
        return word if cell.startswith("`") else ...   # ...: not a value


def test_the_table_names_only_keys_that_exist_and_their_defaults():
    rows = tables()
    assert len(rows["GRPOConfig"]) >= 20 and len(rows["DPOConfig"]) >= 5
    checked = 0
    for name, algo in (("GRPOConfig", "grpo"), ("DPOConfig", "dpo")):
        cfg = compose(f"algo={algo}")
        keys = {".".join(k) for k in _paths(OmegaConf.to_container(cfg))}
        for trl, _, ours, default in rows[name]:
            named = [k.split("=")[0] for k in ticked(ours) if KEY.match(k.split("=")[0])]
            for key in named:
                assert key.replace("[]", "") in keys or any(k.startswith(key + ".") for k in keys), (trl, key)
            if not ours.startswith("`") or "=" in ticked(ours)[0] or "[]" in ticked(ours)[0]:
                continue
            value = first_value(default)
            if value is ...:
                continue
            assert OmegaConf.select(cfg, ticked(ours)[0]) == value, (trl, ticked(ours)[0], default)
            checked += 1
    assert checked >= 15


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


def test_the_trl_defaults_are_trls():
    """TRL 1.16's, read off its configs; skipped where trl is not installed (pip extra bench)."""
    trl = pytest.importorskip("trl")
    checked = 0
    for name, rows in tables().items():
        config = getattr(trl, name)(output_dir="unused", use_cpu=True)
        for cell, default, _, _ in rows:
            names = ticked(cell)
            if cell != f"`{names[0]}`" or not hasattr(config, names[0]):
                continue
            value = getattr(config, names[0])
            value = getattr(value, "value", value)   # transformers' enums (lr_scheduler_type)
            assert value == first_value(default), (name, names[0], default, value)
            checked += 1
    assert checked >= 15
