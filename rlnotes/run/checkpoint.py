"""Checkpoints a run can resume from exactly: RUN_DIR/checkpoints/step_NNNNNN/, how they are written and verified.

A checkpoint is the state at the end of a step, after its metrics row was written:

  adapter_model.safetensors ...  the policy as Policy.save writes it (a peft adapter dir, or a full
                                 model dir with model.lora=null), loadable like final/
  <head>.safetensors             each head an algorithm trains beside the policy (value_head, reward_head)
  trainer_state.pt               optimizer and scheduler state, the RNG states (python, torch CPU,
                                 CUDA, the sampling generator) and the algorithm's cross-step state
                                 (Context.cache); plain tensors and numbers, read with weights_only.
                                 Under FSDP the optimizer state is a list of every rank's shards,
                                 so such a checkpoint resumes on as many FSDP processes
  config.yaml                    the run's resolved config and rlnotes version (rlnotes.run.config_file)
  manifest.json                  step, skipped-update count, data position, heads, the step of the
                                 last metrics.jsonl row, the sha256 of the train rows (a resume on
                                 other rows is refused), and the size and sha256 of every other
                                 file; written last

It is written into a hidden temporary dir that is renamed into place (os.replace) only when
complete, so a crash mid-save leaves the previous checkpoints as they were; `keep_last` prunes
older ones after a save succeeds, counting only checkpoints that verify. On resume a checkpoint is
verified (`verify`) and a damaged one is set aside (renamed damaged_step_NNNNNN) for the newest one
that verifies; nothing is deleted in favour of a damaged checkpoint. Resuming (rlnotes.run.restore)
restores every item, so on CPU a run stopped at step k and resumed writes the same metrics as one
that never stopped. With several processes rank 0 writes it (FSDP gathers the weights and optimizer
shards to it first) and every rank reads it. A signal stops a run at a step boundary
(rlnotes.run.signals), whose state `capture` keeps for the checkpoint of that stop.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from rlnotes.core.errors import ConfigError
from rlnotes.engine.model.loading import usual_modes
from rlnotes.run import config_file
# The names of a checkpoint's dir and files; a damaged checkpoint is renamed to DAMAGED + its name:
# out of checkpoints(), kept for a look.
from rlnotes.run.places import CHECKPOINTS, DAMAGED, MANIFEST, STATE  # noqa: F401 - CHECKPOINTS, STATE: checkpoint.X
from rlnotes.run.steplogs import last_logged

# Format 2 adds the size and sha256 of every file and the last logged step. Format 1 checkpoints
# still load: what they hold is checked (the files they need are there, the step fits its dir and
# run), their bytes cannot be.
FORMAT = 2
READABLE_FORMATS = (1, 2)
# Run.cache entries (training.context) an algorithm rebuilds on first use and that are not saved: DPO's reference
# log-probs (a function of the fixed reference model and the data, and as large as the train set).
RECOMPUTED = frozenset({"ref", "eval_ref"})


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


def capture(run, sampler, device: torch.device) -> Boundary:
    """The boundary state now of the run (training.context.Run: its step counters, random stream
    and the algorithm's state) and of its data `sampler` (copies: later steps do not change it)."""
    cache = {k: copy.deepcopy(v) for k, v in run.cache.items() if k not in RECOMPUTED}
    return Boundary(run.step, run.bad_steps, sampler.state_dict(), rng_state(run.generator, device), cache)


# ---------------------------------------------------------------------------------------------
# Where checkpoints live.


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step:06d}"


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint: its manifest, written last, is there."""
    return (path / MANIFEST).is_file()


def checkpoints(run_dir: Path, complete: bool = True) -> List[Path]:
    """The complete checkpoints of a run, oldest first (temporary dirs start with a dot and are
    skipped); complete=False adds step dirs without a manifest, which only damage leaves (a save
    renames its dir into place whole)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (is_checkpoint(p) or not complete)]
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


def save_heads(heads: Dict[str, torch.nn.Module], out: Path) -> None:
    for name, head in heads.items():
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / f"{name}.safetensors"))


def save_whole(policy, heads: Dict[str, torch.nn.Module], out: Path, state=None) -> None:
    """The policy and its heads into the dir `out` (final/, interrupted/), written aside and renamed
    into place whole (`publish`), so that a dir of that name is always complete."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a process that died while writing it
    policy.save(tmp, state)
    save_heads(heads, tmp)
    usual_modes(tmp)  # safetensors writes 0600, a temporary dir is 0700: a shipped model gets the usual modes
    publish(tmp, out)


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
    """Every file of a checkpoint of the run `ctx` (training.context.Context: its model, its data's
    rows and its run dir) into the (new, empty) dir `out`; the manifest last."""
    shards, model = shards or Shards(), ctx.model
    model.policy.save(out, shards.policy)
    save_heads(model.heads, out)
    optimizer = shards.optimizer if shards.optimizer is not None else model.optimizer.state_dict()
    torch.save({"optimizer": optimizer, "scheduler": model.scheduler.state_dict(),
                "rng": boundary.rng, "cache": boundary.cache}, out / STATE)
    config_file.write(out / "config.yaml", ctx.cfg)
    manifest = {"format": FORMAT, "step": boundary.step, "bad_steps": boundary.bad_steps, "algo": ctx.cfg.algo.name,
                "policy": "lora" if model.policy.uses_lora else "full", "heads": list(model.heads),
                "sampler": boundary.sampler, "device": model.device.type,
                "optimizer_shards": shards.world if shards.optimizer is not None else None,
                "logged": last_logged(ctx.out.run_dir), "rows_sha256": ctx.data.rows_sha256,
                "files": file_table(out)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def save(ctx, boundary: Boundary, keep_last: Optional[int], shards: Optional[Shards] = None) -> Path:
    """Write the checkpoint of `boundary` (and the current weights and optimizer, which have not
    moved since) atomically, then prune to the `keep_last` newest. A complete checkpoint of the
    same step is the same state and is kept as it is. `shards`: the state FSDP gathered."""
    final = checkpoint_dir(ctx.out.run_dir, boundary.step)
    if not is_checkpoint(final):  # else resumed from its last checkpoint: prune anyway (a kill may have come first)
        if final.exists():  # a dir of that name without a manifest (lost after the save): not deleted
            set_aside(final)
        tmp = final.parent / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        tmp.mkdir(parents=True)
        try:
            write(ctx, boundary, tmp, shards)
            publish(tmp, final)  # flushes every file (a full disk may show only then), then renames
        except BaseException as e:  # a failed or abandoned save leaves nothing half-written behind
            full = out_of_space(e, tmp.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            if full and not (isinstance(e, OSError) and e.errno == errno.ENOSPC):
                raise OSError(errno.ENOSPC, f"No space left on device ({e})") from e
            raise
    for path, problem in prune(ctx.out.run_dir, keep_last, written=final)[1]:
        ctx.out.console.print(f"[yellow]checkpoint {path.name} is damaged ({problem}); set aside, not counted in "
                          "trainer.keep_last[/]", highlight=False)
    return final


def publish(tmp: Path, final: Path) -> None:
    """Flush the complete dir `tmp` and rename it to `final`, replacing an older `final`: a process
    that dies leaves the old dir or the new one whole (between the two renames, as .NAME.old)."""
    _fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def out_of_space(error: BaseException, where: Path) -> bool:
    """Whether a failed write ran out of disk space: ENOSPC itself (Python's own writes), the OS
    error in the message (safetensors says "No space left on device (os error 28)"), or, for
    torch.save's bare "unexpected pos", less than 1 MiB left where it wrote."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    if not isinstance(error, Exception):
        return False
    if "No space left on device" in str(error) or "os error 28" in str(error):
        return True
    try:
        return shutil.disk_usage(where).free < 2**20
    except OSError:
        return False


def prune(run_dir: Path, keep_last: Optional[int],
          written: Optional[Path] = None) -> Tuple[List[Path], List[Tuple[Path, str]]]:
    """Delete all but the `keep_last` newest checkpoints that verify (null keeps all), and leftovers
    of saves that died; a damaged one met among the newest is set aside and not counted, so a good
    checkpoint is never deleted in favour of a bad one. `written`: the checkpoint just saved, whose
    files were hashed as they were written (reading them back now would only read the page cache).
    Returns (deleted, [(damaged, problem)])."""
    removed, damaged, kept = [], [], 0
    for path in reversed(checkpoints(run_dir)) if keep_last else []:
        if kept == keep_last:
            removed.append(path)
        elif path != written and (problem := verify(path)) is not None:
            damaged.append((set_aside(path), problem))
        else:
            kept += 1
    root = Path(run_dir) / CHECKPOINTS
    removed += [p for p in root.glob(".step_*")] if root.is_dir() else []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed, damaged


def file_table(path: Path) -> Dict[str, Dict[str, object]]:
    """{relative path: {size, sha256}} of every file under the dir `path` but the manifest."""
    return {f.relative_to(path).as_posix(): {"size": f.stat().st_size, "sha256": sha256(f)}
            for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST}


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Verifying a checkpoint.


def required_files(manifest: Dict[str, object]) -> List[str]:
    """The files a format-1 checkpoint (no file table) must hold; a glob for sharded full weights."""
    policy = "adapter_model.safetensors" if manifest.get("policy") == "lora" else "model*.safetensors"
    return [policy, STATE, "config.yaml", *(f"{name}.safetensors" for name in manifest.get("heads", []))]


def _check_files(path: Path, manifest: Dict[str, object]) -> Optional[str]:
    table = manifest.get("files")
    if table is None:
        return next((f"{name} is missing" for name in required_files(manifest) if not any(path.glob(name))), None)
    for name, want in table.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["size"]:
            return f"{name} has {size:,} bytes, the manifest says {want['size']:,}"
        if sha256(file) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest (its bytes changed)"
    return None


def verify(path: Path, logged: Optional[List[int]] = None) -> Optional[str]:
    """What is wrong with the checkpoint at `path`, in a few words naming the file, or None when
    it verifies: the manifest parses, its step is the dir's (step_NNNNNN) and not past its run's
    trainer.steps, every file has its recorded size and sha256 (format 1: the files it needs are
    there), and, given the steps of its run's metrics.jsonl rows (`logged`), the row it was saved
    after is one of them."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        step = int(manifest["step"])
        known = manifest["format"] in READABLE_FORMATS
    except (OSError, ValueError, TypeError, KeyError):
        return f"{MANIFEST} is unreadable or incomplete"
    if not known:
        return f"{MANIFEST} has format {manifest['format']}; this rlnotes reads formats {READABLE_FORMATS}"
    if path.name.startswith("step_") and path.name[5:].isdigit() and step != step_of(path):
        return f"{MANIFEST} says step {step} but the dir is {path.name}"
    problem = _check_files(path, manifest)
    if problem:
        return problem
    try:
        steps = int(OmegaConf.load(path / "config.yaml").trainer.steps)
    except Exception:  # noqa: BLE001 - any unreadable config is the same finding
        return "config.yaml is unreadable"
    if step > steps:
        return f"{MANIFEST} says step {step}, past its run's trainer.steps={steps}"
    row = manifest.get("logged")
    if logged is not None and row is not None and row not in logged:
        return f"{MANIFEST} says it was saved after metrics.jsonl's row of step {row}, and metrics.jsonl has none"
    return None


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to damaged_<name> beside it (a number added if taken); its path."""
    target, n = path.with_name(DAMAGED + path.name), 1
    while target.exists():
        target, n = path.with_name(f"{DAMAGED}{path.name}.{n}"), n + 1
    os.replace(path, target)
    return target


def read_manifest(path: Path) -> Dict[str, object]:
    """The manifest of the checkpoint at `path`; a format this version cannot read is an error."""
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"trainer.resume: {path} has checkpoint format {manifest.get('format')}, this version of "
                          f"rlnotes reads formats {', '.join(map(str, READABLE_FORMATS))}")
    return manifest
