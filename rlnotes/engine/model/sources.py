"""Cheap checks of model.name_or_path before anything loads: a local Hugging Face model dir holds
the files a load needs and its safetensors files are whole; a path that names no dir, and a hub id
that cannot be had (no network, HF_HUB_OFFLINE, not in the hub cache), are one line before any
request is made. Standard library only, so the config check of `rlnotes train` runs them before
torch or transformers are imported.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import socket
import struct
import threading
from pathlib import Path
from typing import List, Optional
from urllib.parse import urlsplit

from rlnotes.core.errors import ConfigError

TINY, SMOLLM2 = "tiny", "smollm2-135m"  # the models built in (see rlnotes.engine.model.loading)
# The hub ids of the models rlnotes ships (lower case: the hub's ids ignore case) and their presets.
SHIPPED = {"huggingfacetb/smollm2-135m-instruct": SMOLLM2}
# Seconds to wait for the hub's host to accept a connection (name lookup included) before calling
# it unreachable: huggingface_hub otherwise retries for most of a minute with no network.
HUB_PROBE_S = 3.0
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


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a local path: it starts with ./, ../, / or ~, or its first part is
    a dir here (runs/sft-merged when ./runs exists), although org/name is also a hub id's form."""
    if name.startswith((".", "/", "~", os.sep)):
        return True
    first = Path(name).parts[0] if Path(name).parts else ""
    return "/" in name and Path(first).is_dir()


def _no_such_dir(name: str) -> str:
    """The reason `name` (a path to no dir) fails: the deepest dir of it that exists and the
    nearest name there to the part that does not ("did you mean runs/sft-merged?")."""
    path = Path(os.path.abspath(Path(name).expanduser()))
    found = next((p for p in path.parents if p.is_dir()), None)
    if found is None:
        return "no such dir"
    missing = path.relative_to(found).parts[0]
    try:
        dirs = sorted(p.name for p in found.iterdir() if p.is_dir())
    except OSError:
        dirs = []
    near = difflib.get_close_matches(missing, dirs, n=1)
    relative = not name.startswith(("/", "~"))
    where = os.path.relpath(found) if relative else str(found)
    if near:
        return f"no such dir (did you mean {os.path.relpath(found / near[0]) if relative else found / near[0]}?)"
    return f"no such dir ({missing!r} is not in {'this dir' if where == '.' else where})"


def hub_cache() -> Path:
    """Where huggingface_hub keeps the models it downloaded (its own rule, read from the environment)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def in_hub_cache(repo_id: str) -> bool:
    """Whether the hub cache holds a snapshot of `repo_id` with its config.json (ids ignore case)."""
    wanted = "models--" + repo_id.replace("/", "--").lower()
    try:
        folders = [p for p in hub_cache().iterdir() if p.name.lower() == wanted]
    except OSError:
        return False
    return any(any(folder.glob("snapshots/*/config.json")) for folder in folders)


def hub_unreachable() -> Optional[str]:
    """Why the hub cannot be asked for files (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set, or its host
    accepted no connection within HUB_PROBE_S), or None. Behind a proxy (HTTPS_PROXY, ALL_PROXY) it
    is not probed: the proxy decides."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var}={os.environ[var]}"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return _probe(url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))


@functools.lru_cache(maxsize=None)
def _probe(host: str, port: int) -> Optional[str]:
    """Why a connection to host:port failed within HUB_PROBE_S, or None; once a process for each."""
    outcome: List[Optional[OSError]] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_S).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    worker = threading.Thread(target=connect, daemon=True)  # a name lookup has no time-out of its own
    worker.start()
    worker.join(HUB_PROBE_S)
    if not outcome:
        return f"the hub ({host}) did not answer within {HUB_PROBE_S:g} s"
    if outcome[0] is not None:
        return f"the hub ({host}) cannot be reached ({outcome[0].strerror or outcome[0]})"
    return None


def check_model_source(name: str) -> None:
    """model.name_or_path: a built-in name, a hub id (org/name), or a local dir that holds a whole
    model. Raise ConfigError with one line naming the dir and what is missing or damaged, the path
    that names no dir, or the hub id that cannot be had without network (and the preset of a model
    rlnotes ships)."""
    if name in (TINY, SMOLLM2):
        return
    path = Path(name).expanduser()
    if path.exists() and not path.is_dir():
        holder = f" ({path.parent} holds config.json)" if (path.parent / "config.json").is_file() else ""
        raise ConfigError(f"model.name_or_path={name} is a file; give the dir that holds the model: config.json, the "
                          f"weights and the tokenizer, as save_pretrained writes them{holder}")
    if not path.is_dir():
        if looks_local(name):
            raise ConfigError(f"model.name_or_path={name}: {_no_such_dir(name)}; give the dir that holds the model "
                              f"(config.json, the weights and the tokenizer), or {TINY}, {SMOLLM2} or a hub id")
        if name.count("/") != 1 or " " in name:
            raise ConfigError(f"model.name_or_path={name!r} is neither a local model dir nor a hub id (org/name); "
                              f"use {TINY}, {SMOLLM2}, a local dir or org/name")
        check_hub_id(name)
        return
    problems = model_dir_problems(path)
    if problems:
        raise ConfigError(f"model.name_or_path={name}: the dir is not a whole model: {'; '.join(problems)} "
                          "(it needs config.json, the weights and the tokenizer as save_pretrained writes them; "
                          "copy the model again)")


def check_hub_id(name: str) -> None:
    """A hub id that cannot be had, in one line before any request: there is no network (or the
    hub is switched off) and the hub cache has no copy. A model rlnotes ships is named by its preset."""
    offline = hub_unreachable()
    if offline is None or in_hub_cache(name):
        return
    preset = SHIPPED.get(name.lower())
    fix = (f"rlnotes ships this model: use model={preset}" if preset else
           f"download it where there is network and give its local dir, or use model={SMOLLM2} or model={TINY}")
    raise ConfigError(f"model.name_or_path={name} is a hub id, {offline}, and the hub cache ({hub_cache()}) has no "
                      f"copy of it (nor is there a dir {name} here); {fix}")
