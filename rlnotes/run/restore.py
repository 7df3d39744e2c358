"""Restoring a run from a checkpoint (rlnotes.run.checkpoint) to resume it: which checkpoint
(`resolve`, `locate`), whether it fits this run (`check_config`), the run dir's later checkpoints
dropped (`drop_later`; its step logs are cut back by rlnotes.run.steplogs.carry_logs), and loading
it (`load_policy`, `load_heads`, `load`).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from rlnotes import __version__
from rlnotes.core.errors import ConfigError
from rlnotes.engine.hardware import distributed
from rlnotes.run import config_file
from rlnotes.run.checkpoint import (
    CHECKPOINTS,
    MANIFEST,
    STATE,
    checkpoints,
    is_checkpoint,
    read_manifest,
    set_aside,
    step_of,
    verify,
)
from rlnotes.run.steplogs import logged_steps

# Settings whose change makes a checkpoint's weights not fit the model this run builds.
MODEL_KEYS = ("algo.name", "model.name_or_path", "model.lora", "model.tiny")
# Settings that do not touch the training math: a change is not worth a line on resume.
BOOKKEEPING_KEYS = ("trainer.resume", "trainer.save_every", "trainer.keep_last", "logging", "hardware.threads",
                    "hardware.nproc", "eval", "sweep")


# ---------------------------------------------------------------------------------------------
# Finding the checkpoint to resume from.


def resolve(resume: str) -> Path:
    """trainer.resume=PATH: a checkpoint dir, or a run dir (its latest checkpoint)."""
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"trainer.resume={resume}: no such directory; give a checkpoint dir "
                          f"(RUN_DIR/{CHECKPOINTS}/step_NNNNNN), a run dir, or auto")
    if is_checkpoint(path):
        return path
    found = checkpoints(path)
    if found:
        return found[-1]
    if path.name.startswith("step_") or path.name.startswith(".step_"):
        raise ConfigError(f"trainer.resume={resume} is an incomplete checkpoint (no {MANIFEST}: it was damaged, or "
                          "its save did not finish); give an earlier one from the same checkpoints/ dir")
    raise ConfigError(f"trainer.resume={resume} holds no checkpoint (no {MANIFEST} and no {CHECKPOINTS}/step_*); "
                      f"give a checkpoint dir (RUN_DIR/{CHECKPOINTS}/step_NNNNNN) or a run dir that has one")


def locate(resume: Optional[str], run_dir: Path, notes: Optional[List[str]] = None) -> Optional[Path]:
    """The checkpoint a run starts from, or None to start fresh (see `check_run_dir` for which
    run dirs a run may start in).

    null: start fresh; auto: the run dir's newest checkpoint that verifies, or a fresh start when
    it has none (so one command line serves the first start and every restart); PATH: see
    `resolve`. A damaged checkpoint newer than the one taken is named in a line added to `notes`;
    in the run dir itself it is also set aside, where resume=auto would otherwise save over it.
    A checkpoint dir given by path that does not verify is an error.
    """
    if resume is None:
        return None
    path = run_dir if resume == "auto" else resolve(resume)
    if resume != "auto" and is_checkpoint(path):
        problem = verify(path, logged_steps(path.parent.parent))
        if problem:
            raise ConfigError(f"trainer.resume={resume} is damaged ({problem}); give an earlier checkpoint, or "
                              "trainer.resume=auto with its run dir to take the newest one that verifies")
        return path
    found, logged, damaged = checkpoints(path, complete=False), logged_steps(path), []
    good = None
    for candidate in reversed(found):
        problem = verify(candidate, logged)
        if problem is None:
            good = candidate
            break
        damaged.append(f"checkpoint {candidate} is damaged ({problem})")
    if found and good is None:
        raise ConfigError(f"no checkpoint in {Path(path) / CHECKPOINTS} verifies ({damaged[0]}); start the run "
                          "again in a new dir (hydra.run.dir=NEW_DIR)")
    own = Path(path).resolve() == Path(run_dir).resolve()
    for line, candidate in zip(damaged, reversed(found)):
        moved = set_aside(candidate) if own else candidate
        if notes is not None:
            notes.append(line + (f"; set aside as {moved.name}" if own else "") + f"; resuming from {good.name}")
    return good


def _flat(node, prefix: str = "") -> Dict[str, object]:
    if isinstance(node, dict):
        out = {prefix: None} if not node and prefix else {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def config_changes(old, new) -> Tuple[List[str], List[str]]:
    """(changes that stop the weights from loading, other changes), each "key old -> new"."""
    a = _flat(OmegaConf.to_container(old, resolve=True))
    b = _flat(OmegaConf.to_container(new, resolve=True))
    under = lambda key, prefixes: any(key == p or key.startswith(p + ".") for p in prefixes)  # noqa: E731
    changed = [f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b))
               if a.get(k) != b.get(k) and not under(k, BOOKKEEPING_KEYS)]
    fatal = [c for c in changed if under(c.split(" ")[0], MODEL_KEYS)]
    return fatal, [c for c in changed if c not in fatal]


def check_config(path: Path, cfg) -> List[str]:
    """Raise if the checkpoint's model does not match this run's; return the other settings that
    differ (a resumed run with changed settings is not the same run), and the rlnotes version when
    another one saved the checkpoint."""
    saved = OmegaConf.load(path / "config.yaml")
    made_by = saved.pop(config_file.VERSION_KEY, None)  # None: saved before config.yaml recorded the version
    fatal, changed = config_changes(saved, cfg)
    if fatal:
        raise ConfigError(f"trainer.resume: {path} was trained with other model settings ({'; '.join(fatal)}); "
                          "resume with the checkpoint's algo and model settings")
    if made_by not in (None, __version__):
        changed.append(f"{config_file.VERSION_KEY} {made_by} -> {__version__}")
    return changed


def drop_later(run_dir: Path, step: int) -> List[Path]:
    """Delete the run dir's checkpoints after `step`: on resuming from an earlier one they belong
    to a history that no longer happened (and keep_last would otherwise prune the new ones)."""
    later = [p for p in checkpoints(run_dir) if step_of(p) > step]
    for path in later:
        shutil.rmtree(path)
    return later


# ---------------------------------------------------------------------------------------------
# Loading.


def load_heads(path: Path, manifest: Dict[str, object], device: torch.device) -> Dict[str, torch.nn.Module]:
    """The checkpoint's heads, rebuilt as the linear layers (hidden -> out) they are."""
    heads = {}
    for name in manifest["heads"]:
        weights = load_file(str(path / f"{name}.safetensors"))
        out_features, in_features = weights["weight"].shape
        head = torch.nn.Linear(in_features, out_features, bias="bias" in weights, device=device)
        head.load_state_dict(weights)
        heads[name] = head
    return heads


def load_policy(policy, path: Path) -> None:
    """Copy the checkpoint's weights into the policy's parameters (in place: the optimizer keeps
    pointing at them)."""
    device = next(policy.model.parameters()).device
    if policy.uses_lora:
        file = path / "adapter_model.safetensors"
        if not file.is_file() and read_manifest(path).get("policy") == "lora":
            raise ConfigError(f"trainer.resume: {path} is missing its LoRA adapter ({file.name}); resume from "
                              "another checkpoint")
        if not file.is_file():
            raise ConfigError(f"trainer.resume: {path} holds no LoRA adapter ({file.name}); it was saved by a run "
                              "with model.lora=null: resume with model.lora=null")
        result = set_peft_model_state_dict(policy.model, load_file(str(file), device=str(device)))
        if result.unexpected_keys:
            raise ConfigError(f"trainer.resume: {path}'s adapter does not fit this model "
                              f"({len(result.unexpected_keys)} unknown weights, e.g. {result.unexpected_keys[0]})")
        return
    files = sorted(path.glob("model*.safetensors"))
    if not files and read_manifest(path).get("policy") == "full":
        raise ConfigError(f"trainer.resume: {path} is missing its weights (model*.safetensors); resume from another "
                          "checkpoint")
    if not files:
        raise ConfigError(f"trainer.resume: {path} holds no full model weights (model*.safetensors); it was saved "
                          "with LoRA on: resume without model.lora=null")
    state = {k: v for f in files for k, v in load_file(str(f), device=str(device)).items()}
    result = policy.model.load_state_dict(state, strict=False)
    loaded = {p.data_ptr() for n, p in policy.model.named_parameters(remove_duplicate=False) if n in state}
    missing = [n for n, p in policy.model.named_parameters(remove_duplicate=False)
               if n in result.missing_keys and p.data_ptr() not in loaded]  # a tied copy of a loaded weight is fine
    if missing or result.unexpected_keys:
        raise ConfigError(f"trainer.resume: {path}'s weights do not fit this model "
                          f"(missing {missing[:2]}, unknown {result.unexpected_keys[:2]})")


def load(ctx, path: Path, manifest: Dict[str, object]) -> None:
    """Restore into the run `ctx` (training.context.Context) everything but the weights (load_policy,
    before FSDP shards them) and the heads (the caller adds those first, so that the optimizer has
    their parameter groups): optimizer, scheduler, RNG, data position, the algorithm's state."""
    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    model, run = ctx.model, ctx.run
    saved_by = manifest.get("optimizer_shards")
    sharded = distributed.sharded_optimizer(model.optimizer)
    if saved_by is not None or sharded:
        world = distributed.world_size()
        if saved_by != world or not sharded:
            raise ConfigError(f"trainer.resume: {path} holds the optimizer state of "
                              + (f"{saved_by} FSDP processes" if saved_by else "unsharded processes")
                              + f"; resume it with the same layout (this run: {world} "
                              + ("FSDP " if sharded else "") + "processes)")
        distributed.load_optimizer_shard(model.optimizer, state["optimizer"][distributed.rank()])
    else:
        model.optimizer.load_state_dict(state["optimizer"])
    model.scheduler.load_state_dict(state["scheduler"])
    if manifest["device"] == model.device.type:
        set_rng_state(state["rng"], run.generator, model.device)
    else:
        ctx.out.console.print(f"[yellow]resuming on {model.device.type} from a {manifest['device']} checkpoint: "
                              "its random streams do not carry over, so sampling will differ from an uninterrupted "
                              "run[/]")
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
    set_sampler_state(ctx.data.sampler, manifest["sampler"])
    run.cache.update(state["cache"])
    run.step, run.bad_steps = manifest["step"], manifest["bad_steps"]


def set_rng_state(state: Dict[str, object], generator: torch.Generator, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda"])


def set_sampler_state(sampler, state: Dict[str, int]) -> None:
    _check_sampler(sampler, state)
    sampler.load_state_dict(state)


def _check_sampler(sampler, state: Dict[str, int]) -> None:
    if state["rows"] != len(sampler.rows) or state["seed"] != sampler.seed:
        raise ConfigError(f"trainer.resume: the checkpoint's data had {state['rows']} train rows shuffled with seed "
                          f"{state['seed']}, this run has {len(sampler.rows)} with seed {sampler.seed}; "
                          "resume with the checkpoint's data and seed settings")


def rows_sha256(rows: List[dict]) -> str:
    """The sha256 of the train rows in their order, each as sorted-key JSON (a value JSON cannot
    hold as its text): the same file read the same way gives the same digest, any changed cell,
    added, removed or reordered row another one."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str, ensure_ascii=False).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def check_data(path: Path, sampler, digest: Optional[str]) -> None:
    """Refuse to resume the checkpoint at `path` on train rows other than those it was trained on: a
    different count or seed (its data position would index other rows) or, with the same count, other
    content (`digest`: rows_sha256 of this run's rows; a checkpoint from before the digest was kept
    is not compared). Called before the run dir changes."""
    manifest = read_manifest(path)
    _check_sampler(sampler, manifest["sampler"])
    saved = manifest.get("rows_sha256")
    if saved is not None and digest is not None and saved != digest:
        raise ConfigError(f"trainer.resume: the train rows differ from those {path} was trained on (the same "
                          f"{len(sampler.rows)} rows, other content: the data file or a data setting changed since "
                          "it was saved); resume with the data it was trained on, or start a new run in another dir "
                          "(hydra.run.dir=NEW_DIR)")
