"""Cheap checks of model.name_or_path before anything loads: a local Hugging Face model dir holds
the files a load needs and its safetensors files are whole. Standard library only, so the config
check of `rlnotes train` runs them before torch or transformers are imported.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import List, Optional

from rlnotes.core.errors import ConfigError

TINY, SMOLLM2 = "tiny", "smollm2-135m"  # the models built in (see rlnotes.engine.models)
# A model dir as save_pretrained writes it: its config, its weights (one file or an index of
# shards), and its tokenizer (any one of these is what AutoTokenizer starts from).
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def safetensors_problem(path: Path) -> Optional[str]:
    """Why `path` is not a whole safetensors file, or None: the file is an 8-byte header length, a
    JSON header of that length, then the tensors, which end where the header says they do."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            return f"{path.name} is truncated ({size:,} bytes, less than its own header)"
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return f"{path.name} has a damaged header"
    if 8 + n + end != size:
        return f"{path.name} is truncated ({size:,} of the {8 + n + end:,} bytes its header describes)"
    return None


def _shards(index: Path) -> List[str]:
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def model_dir_problems(path: Path) -> List[str]:
    """What keeps the model dir `path` from loading (empty when nothing is seen): missing config,
    weights, shards or tokenizer, and truncated or damaged safetensors files. A LoRA adapter dir
    (adapter_config.json: its base is named inside) needs no config or weights of its own."""
    problems = []
    adapter = (path / "adapter_config.json").is_file()
    if not adapter and not (path / "config.json").is_file():
        problems.append("no config.json")
    weights = [name for name in WEIGHTS if (path / name).is_file()]
    if not adapter and not weights:
        problems.append(f"no weights ({', '.join(WEIGHTS)})")
    for index in (path / name for name in weights if name.endswith(".index.json")):
        try:
            missing = [shard for shard in _shards(index) if not (path / shard).is_file()]
        except (ValueError, KeyError, AttributeError):
            problems.append(f"{index.name} is damaged")
            continue
        if missing:
            problems.append(f"{index.name} names missing shards ({', '.join(missing[:3])})")
    if not any((path / name).is_file() for name in TOKENIZER):
        problems.append(f"no tokenizer files ({', '.join(TOKENIZER)})")
    for file in sorted(path.glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem:
            problems.append(problem)
    return problems


def custom_code(path: Path) -> List[str]:
    """The classes of its own code a model dir names for transformers to import ("auto_map" in its
    config.json or tokenizer_config.json), as "file: module.Class"; rlnotes never runs them."""
    found = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((path / name).read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):  # no such file, or not a JSON object: not ours to judge
            continue
        for value in auto_map.values() if isinstance(auto_map, dict) else ():
            refs = value if isinstance(value, list) else [value]  # a tokenizer's: [slow class, fast class]
            found += [f"{name}: {ref}" for ref in refs if isinstance(ref, str)]
    return found


def check_policy_dir(path: Path, key: str = "eval.policy") -> None:
    """A saved policy: a LoRA adapter dir (adapter_config.json) or a whole model dir (config.json).
    A run dir, or its checkpoints/ dir, is named as such with the policies it holds."""
    if (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return
    run = path.parent if path.name == "checkpoints" else path
    saved = [p for p in (run / "final", run / "interrupted") if p.is_dir()]
    saved += sorted((run / "checkpoints").glob("step_*"), reverse=True)[:1]  # the newest checkpoint
    if saved:
        raise ConfigError(f"{key}={path} is a run's {'checkpoints ' * (run != path)}dir, not a policy it saved; "
                          f"give {saved[0]}"
                          + "".join(f" (or {p})" for p in saved[1:2]))
    raise ConfigError(f"{key}={path} holds neither a LoRA adapter (adapter_config.json) nor a whole model "
                      "(config.json); give a run's final/ dir (RUN_DIR/final) or a checkpoint "
                      "(RUN_DIR/checkpoints/step_N)")


def check_model_source(name: str) -> None:
    """model.name_or_path: a built-in name, a hub id (org/name), or a local dir that holds a whole
    model. Raise ConfigError with one line naming the dir and what is missing or damaged."""
    if name in (TINY, SMOLLM2):
        return
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        holder = f" ({path.parent} holds config.json)" if (path.parent / "config.json").is_file() else ""
        raise ConfigError(f"model.name_or_path={name} is a file; give the dir that holds the model: config.json, the "
                          f"weights and the tokenizer, as save_pretrained writes them{holder}")
    if not path.is_dir():
        if name.startswith((".", "/", "~")) or name.count("/") != 1:
            raise ConfigError(f"model.name_or_path={name!r} is neither a local model dir nor a hub id (org/name); "
                              f"use {TINY}, {SMOLLM2}, a local dir or org/name")
        return
    problems = model_dir_problems(path)
    if problems:
        raise ConfigError(f"model.name_or_path={name}: the dir is not a whole model: {'; '.join(problems)} "
                          "(it needs config.json, the weights and the tokenizer as save_pretrained writes them; "
                          "copy the model again)")
