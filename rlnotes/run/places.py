"""What a dir on disk holds, told from its names without loading anything (no torch: `rlnotes
plot` asks too): a new dir, a run, a checkpoint, a saved policy, an evaluation or something else
(`contents`); whether a path lies inside a policy or a run's folders that rlnotes replaces or
prunes (`enclosing`); whether this user may write there (`writable`). rlnotes.run.rundir decides
from these where a run may start; rlnotes eval, export and plot, where they may write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import yaml

from rlnotes.run.config_file import VERSION_KEY

# A run's checkpoints dir, and what makes one of its dirs a checkpoint (rlnotes.run.checkpoint).
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
# A damaged checkpoint is renamed to this prefix + its name (rlnotes.run.checkpoint.set_aside).
DAMAGED = "damaged_"
# The owner's lock file in a run dir.
LOCK = ".lock"
# What Hydra (its .hydra/ files and the job's log, <hydra.job.name>.log: train.log, unless a
# launcher or hydra.job.name names the job otherwise) and the lock leave in a dir before a run
# starts: a dir holding only these is still new.
BEFORE_RUN = (".hydra", LOCK)


def before_run(name: str) -> bool:
    """Whether `name` in a dir is something BEFORE_RUN allows (a leftover lock file of a process
    that died mid-swap, a Hydra job log of any job name)."""
    return name in BEFORE_RUN or name.startswith(LOCK + ".") or (name.endswith(".log") and name != "warnings.log")


# A run's folders that rlnotes replaces (final/, interrupted/) or prunes (checkpoints/), and its
# evaluations' samples (eval/): nothing of anyone else's may live inside them.
MANAGED = (CHECKPOINTS, "final", "interrupted", "eval")
# What `rlnotes eval` writes into its own dir; with config.yaml and none of a run's logs, an evaluation.
EVAL_FILES = ("eval.jsonl", "samples.jsonl")


def is_run_config(path: Path) -> bool:
    """Whether `path` is a config.yaml that rlnotes wrote for a run (its version line, or a
    trainer section as runs before the version line have), not a user's file of that name."""
    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and (VERSION_KEY in cfg or "trainer" in cfg)


def contents(path: Path) -> str:
    """What the dir `path` holds: "new" (nothing, or only BEFORE_RUN; also a path not made yet),
    "file" (it is not a dir), "checkpoint" (a manifest with trainer state), "policy" (a LoRA adapter,
    or a model's config.json with its weights: final/, interrupted/, an exported model),
    "evaluation", "run", or "other"."""
    path = Path(path)
    if not path.exists():
        return "new"
    if not path.is_dir():
        return "file"
    names = {p.name for p in path.iterdir()}
    if MANIFEST in names and (STATE in names or path.name.startswith(("step_", ".step_", DAMAGED))):
        return "checkpoint"
    weights = any(n.endswith((".safetensors", ".bin")) for n in names)
    if "adapter_config.json" in names or ("config.json" in names and weights):
        return "policy"
    if all(before_run(name) for name in names):
        return "new"
    if "config.yaml" in names and is_run_config(path / "config.yaml"):
        ran = names & {"metrics.jsonl", CHECKPOINTS, "final", "interrupted", "eval"}
        return "evaluation" if "eval.jsonl" in names and not ran else "run"
    return "other"


def enclosing(path: Path) -> Optional[str]:
    """Why nothing may be written at `path` because of where it is: inside a saved policy or a
    checkpoint, or inside one of a run's MANAGED folders; None when it may."""
    path = Path(os.path.abspath(path))
    for child, parent in zip([path, *path.parents], path.parents):
        if parent != path and contents(parent) in ("checkpoint", "policy"):
            return f"{path} is inside {parent}, a saved policy or checkpoint that rlnotes replaces or prunes whole"
        if child.name in MANAGED and contents(parent) == "run":
            return (f"{path} is inside {child}, the {child.name}/ folder of the run in {parent}, which rlnotes "
                    "replaces or prunes")
    return None


def writable(path: Path) -> bool:
    """Whether this process can make and change files at `path` (a dir, or the nearest existing
    dir above a path not made yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK | os.X_OK)
