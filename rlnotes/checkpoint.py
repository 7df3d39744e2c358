"""Checkpoints a run can resume from exactly: RUN_DIR/checkpoints/step_NNNNNN/.

A checkpoint is the state at the end of a step, after its metrics row was written:

  adapter_model.safetensors ...  the policy as Policy.save writes it (a peft adapter dir, or a full
                                 model dir with model.lora=null), loadable like final/
  <head>.safetensors             each head a runner trains beside the policy (value_head, reward_head)
  trainer_state.pt               optimizer and scheduler state, the RNG states (python, torch CPU,
                                 CUDA, the sampling generator) and the runner's cross-step state
                                 (Context.cache); plain tensors and numbers, read with weights_only.
                                 Under FSDP the optimizer state is a list of every rank's shards,
                                 so such a checkpoint resumes on as many FSDP processes
  config.yaml                    the run's resolved config
  manifest.json                  step, skipped-update count, data position, heads; written last

It is written into a hidden temporary dir that is renamed into place (os.replace) only when
complete, so a crash mid-save leaves the previous checkpoints as they were; `keep_last` prunes
older ones after a save succeeds. Resuming restores every item, so on CPU a run stopped at step k
and resumed writes the same metrics as one that never stopped. With several processes rank 0
writes it (FSDP gathers the weights and optimizer shards to it first) and every rank reads it.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from rlnotes.config import ConfigError

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
FORMAT = 1
# Run logs with one JSON row per step; rows after a resumed checkpoint's step are dropped.
STEP_LOGS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")
# Context.cache entries a runner rebuilds on first use and that are not saved: DPO's reference
# log-probs (a function of the fixed reference model and the data, and as large as the train set).
RECOMPUTED = frozenset({"ref", "eval_ref"})
# Settings whose change makes a checkpoint's weights not fit the model this run builds.
MODEL_KEYS = ("algo.name", "model.name_or_path", "model.lora", "model.tiny")
# Settings that do not touch the training math: a change is not worth a line on resume.
BOOKKEEPING_KEYS = ("trainer.resume", "trainer.save_every", "trainer.keep_last", "logging", "hardware.threads",
                    "hardware.nproc", "eval", "sweep")


# ---------------------------------------------------------------------------------------------
# The state at a step boundary, besides the weights and the optimizer.


@dataclass
class Boundary:
    """What a checkpoint holds besides weights, optimizer and scheduler, captured at the end of a
    step; a Ctrl-C during the next step saves this, since nothing it covers is final until then."""
    step: int
    bad_steps: int
    sampler: Dict[str, int]
    rng: Dict[str, object]
    cache: Dict[str, object]


def rng_state(generator: torch.Generator, device: torch.device) -> Dict[str, object]:
    """Every random stream training draws from: python's, torch's CPU and CUDA ones, and the
    sampling generator (completions, PPO's minibatch order)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "generator": generator.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, object], generator: torch.Generator, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda"])


def set_sampler_state(sampler, state: Dict[str, int]) -> None:
    if state["rows"] != len(sampler.rows) or state["seed"] != sampler.seed:
        raise ConfigError(f"trainer.resume: the checkpoint's data had {state['rows']} train rows shuffled with seed "
                          f"{state['seed']}, this run has {len(sampler.rows)} with seed {sampler.seed}; "
                          "resume with the checkpoint's data and seed settings")
    sampler.load_state_dict(state)


def capture(ctx) -> Boundary:
    """The boundary state of `ctx` now (copies: later steps do not change it)."""
    cache = {k: copy.deepcopy(v) for k, v in ctx.cache.items() if k not in RECOMPUTED}
    return Boundary(ctx.step, ctx.bad_steps, ctx.sampler.state_dict(), rng_state(ctx.generator, ctx.device), cache)


# ---------------------------------------------------------------------------------------------
# Where checkpoints live.


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint: its manifest, written last, is there."""
    return (path / MANIFEST).is_file()


def checkpoints(run_dir: Path) -> List[Path]:
    """The complete checkpoints of a run, oldest first (temporary dirs start with a dot and are skipped)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and is_checkpoint(p)]
    return sorted(found, key=step_of)


# ---------------------------------------------------------------------------------------------
# Saving.


@dataclass
class Shards:
    """What rank 0 needs from the other ranks to write a checkpoint: under FSDP the gathered weights
    and the optimizer shards of all `world` ranks; otherwise None for both (every rank holds the
    whole state)."""
    policy: Optional[Dict[str, torch.Tensor]] = None
    optimizer: Optional[List[dict]] = None
    world: int = 1


def save_policy(policy, out: Path, state: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Policy.save, or from the full state dict FSDP gathered (the same files)."""
    if state is None:
        policy.save(out)
        return
    policy.model.save_pretrained(out, state_dict=state)
    policy.tokenizer.save_pretrained(out)


def _fsync_tree(path: Path) -> None:
    """Flush every file under `path` and the dir itself to disk, so a rename publishes whole files."""
    for f in path.rglob("*"):
        if f.is_file():
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(ctx, boundary: Boundary, out: Path, shards: Optional[Shards] = None) -> None:
    """Every file of a checkpoint into the (new, empty) dir `out`; the manifest last."""
    shards = shards or Shards()
    save_policy(ctx.policy, out, shards.policy)
    for name, head in ctx.heads.items():
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / f"{name}.safetensors"))
    optimizer = shards.optimizer if shards.optimizer is not None else ctx.optimizer.state_dict()
    torch.save({"optimizer": optimizer, "scheduler": ctx.scheduler.state_dict(),
                "rng": boundary.rng, "cache": boundary.cache}, out / STATE)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(ctx.cfg, resolve=True))
    manifest = {"format": FORMAT, "step": boundary.step, "bad_steps": boundary.bad_steps, "algo": ctx.cfg.algo.name,
                "policy": "lora" if ctx.policy.uses_lora else "full", "heads": list(ctx.heads),
                "sampler": boundary.sampler, "device": ctx.device.type,
                "optimizer_shards": shards.world if shards.optimizer is not None else None}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def save(ctx, boundary: Boundary, keep_last: Optional[int], shards: Optional[Shards] = None) -> Path:
    """Write the checkpoint of `boundary` (and the current weights and optimizer, which have not
    moved since) atomically, then prune to the `keep_last` newest. A complete checkpoint of the
    same step is the same state and is kept as it is. `shards`: the state FSDP gathered."""
    final = checkpoint_dir(ctx.run_dir, boundary.step)
    if is_checkpoint(final):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
    tmp.mkdir()
    write(ctx, boundary, tmp, shards)
    _fsync_tree(tmp)
    if final.exists():  # an incomplete dir of that name (no manifest): never a checkpoint
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    prune(ctx.run_dir, keep_last)
    return final


def prune(run_dir: Path, keep_last: Optional[int]) -> List[Path]:
    """Delete all but the `keep_last` newest complete checkpoints (null keeps all), and leftovers
    of saves that died; returns what was deleted."""
    removed = checkpoints(run_dir)[:-keep_last] if keep_last else []
    root = Path(run_dir) / CHECKPOINTS
    removed += [p for p in root.glob(".step_*")] if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


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
        raise ConfigError(f"trainer.resume={resume} is an incomplete checkpoint (no {MANIFEST}: its save did not "
                          "finish); give an earlier one from the same checkpoints/ dir")
    raise ConfigError(f"trainer.resume={resume} holds no checkpoint (no {MANIFEST} and no {CHECKPOINTS}/step_*); "
                      f"give a checkpoint dir (RUN_DIR/{CHECKPOINTS}/step_NNNNNN) or a run dir that has one")


def locate(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint a run starts from, or None to start fresh.

    null: start fresh, but not over another run's checkpoints in the same dir (a later
    resume=auto could not tell them apart); auto: the run dir's latest checkpoint, or a fresh
    start when it has none (so one command line serves the first start and every restart);
    PATH: see `resolve`.
    """
    if resume is None:
        existing = checkpoints(run_dir)
        if existing:
            raise ConfigError(f"{run_dir} already holds checkpoints of a run ({existing[-1].name}); continue it with "
                              "trainer.resume=auto, or start a new run in another dir (hydra.run.dir=...)")
        return None
    if resume == "auto":
        existing = checkpoints(run_dir)
        return existing[-1] if existing else None
    return resolve(resume)


def read_manifest(path: Path) -> Dict[str, object]:
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"trainer.resume: {path} has checkpoint format {manifest.get('format')}, this version of "
                          f"rlnotes reads format {FORMAT}")
    return manifest


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
    differ (a resumed run with changed settings is not the same run)."""
    fatal, changed = config_changes(OmegaConf.load(path / "config.yaml"), cfg)
    if fatal:
        raise ConfigError(f"trainer.resume: {path} was trained with other model settings ({'; '.join(fatal)}); "
                          "resume with the checkpoint's algo and model settings")
    return changed


def carry_logs(source_run: Optional[Path], run_dir: Path, step: int) -> None:
    """Rewrite the run's step logs to the rows of `source_run`'s logs up to `step` (the run the
    checkpoint came from: this run's own dir, or another one's, whose history the new run
    continues); step -1 drops every row. Each file is replaced atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in STEP_LOGS:
        source = source_run / name if source_run is not None else run_dir / name
        if not source.is_file():
            continue
        rows = [line for line in source.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text("".join(line + "\n" for line in rows))
        os.replace(tmp, run_dir / name)


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
        from peft import set_peft_model_state_dict

        file = path / "adapter_model.safetensors"
        if not file.is_file():
            raise ConfigError(f"trainer.resume: {path} holds no LoRA adapter ({file.name}); it was saved by a run "
                              "with model.lora=null: resume with model.lora=null")
        result = set_peft_model_state_dict(policy.model, load_file(str(file), device=str(device)))
        if result.unexpected_keys:
            raise ConfigError(f"trainer.resume: {path}'s adapter does not fit this model "
                              f"({len(result.unexpected_keys)} unknown weights, e.g. {result.unexpected_keys[0]})")
        return
    files = sorted(path.glob("model*.safetensors"))
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
    """Restore everything but the weights (load_policy, before FSDP shards them) and the heads (the
    caller adds those first, so that the optimizer has their parameter groups): optimizer,
    scheduler, RNG, data position, runner state."""
    from rlnotes import distributed

    state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    saved_by = manifest.get("optimizer_shards")
    sharded = distributed.sharded_optimizer(ctx.optimizer)
    if saved_by is not None or sharded:
        world = distributed.world_size()
        if saved_by != world or not sharded:
            raise ConfigError(f"trainer.resume: {path} holds the optimizer state of "
                              + (f"{saved_by} FSDP processes" if saved_by else "unsharded processes")
                              + f"; resume it with the same layout (this run: {world} "
                              + ("FSDP " if sharded else "") + "processes)")
        distributed.load_optimizer_shard(ctx.optimizer, state["optimizer"][distributed.rank()])
    else:
        ctx.optimizer.load_state_dict(state["optimizer"])
    ctx.scheduler.load_state_dict(state["scheduler"])
    if manifest["device"] == ctx.device.type:
        set_rng_state(state["rng"], ctx.generator, ctx.device)
    else:
        ctx.console.print(f"[yellow]resuming on {ctx.device.type} from a {manifest['device']} checkpoint: its "
                          "random streams do not carry over, so sampling will differ from an uninterrupted run[/]")
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
    set_sampler_state(ctx.sampler, manifest["sampler"])
    ctx.cache.update(state["cache"])
    ctx.step, ctx.bad_steps = manifest["step"], manifest["bad_steps"]


# ---------------------------------------------------------------------------------------------
# Stopping on a signal.


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM while training.

    A signal raises KeyboardInterrupt at once when no optimizer update has run since the last
    completed step (`ctx.updating` is off): that step's checkpoint is then exact, and the partial
    step is simply redone on resume. During a step's updates (PPO's minibatches, GRPO's mu passes)
    the step is finished first and `check` stops after it; a second signal stops at once.
    With several processes every first signal waits for the end of the step, and `check` stops
    every rank after the same step when any of them got one (a rank stopping alone would leave the
    others waiting in a collective). Handlers are installed only in the main thread (Python
    delivers signals nowhere else).
    """

    def __init__(self, ctx):
        self.ctx, self.signum, self._previous = ctx, None, {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        from rlnotes import distributed

        first, self.signum = self.signum is None, signum
        if first and (self.ctx.updating or distributed.active()):
            self.ctx.console.print(f"[yellow]{signal.Signals(signum).name}: stopping once this step is done "
                                   "(send it again to stop now, without a checkpoint of this step)[/]")
            return
        raise KeyboardInterrupt

    def check(self) -> None:
        """Stop now if a signal came during the step just finished (to any rank)."""
        from rlnotes import distributed

        if distributed.any_rank(self.signum is not None):
            raise KeyboardInterrupt

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "KeyboardInterrupt"


def resume_command(run_dir: Path) -> str:
    """The command line that continues this run: its own overrides plus resume and run dir."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    overrides = ["..."]
    if HydraConfig.initialized():
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("trainer.resume=")]
    words = ["rlnotes", "train", *overrides, "trainer.resume=auto", f"hydra.run.dir={run_dir}"]
    return " ".join(w if w == "..." else shlex.quote(w) for w in words)
