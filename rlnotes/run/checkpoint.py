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
  manifest.json                  step, skipped-update count, data position, heads, the step of the
                                 last metrics.jsonl row, and the size and sha256 of every other
                                 file; written last

It is written into a hidden temporary dir that is renamed into place (os.replace) only when
complete, so a crash mid-save leaves the previous checkpoints as they were; `keep_last` prunes
older ones after a save succeeds, counting only checkpoints that verify. On resume a checkpoint is
verified (`verify`) and a damaged one is set aside (renamed damaged_step_NNNNNN) for the newest one
that verifies; nothing is deleted in favour of a damaged checkpoint. Resuming restores every
item, so on CPU a run stopped at step k and resumed writes the same metrics as one that never
stopped. With several processes rank 0 writes it (FSDP gathers the weights and optimizer shards to
it first) and every rank reads it.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from rlnotes.core.errors import ConfigError, Interrupted
from rlnotes.engine.models import usual_modes

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
# Format 2 adds the size and sha256 of every file and the last logged step. Format 1 checkpoints
# still load: what they hold is checked (the files they need are there, the step fits its dir and
# run), their bytes cannot be.
FORMAT = 2
READABLE_FORMATS = (1, 2)
# A damaged checkpoint is renamed to this prefix + its name: out of checkpoints(), kept for a look.
DAMAGED = "damaged_"
# Run logs whose lines each belong to a step (JSON rows with a "step", warnings.log's "step N ...");
# lines after a resumed checkpoint's step are dropped.
STEP_LOGS = ("metrics.jsonl", "eval.jsonl", "samples.jsonl", "warnings.log")
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


def save_policy(policy, out: Path, state: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Policy.save, or from the full state dict FSDP gathered (the same files)."""
    if state is None:
        policy.save(out)
        return
    policy.model.save_pretrained(out, state_dict=state)
    policy.tokenizer.save_pretrained(out)


def save_heads(heads: Dict[str, torch.nn.Module], out: Path) -> None:
    for name, head in heads.items():
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / f"{name}.safetensors"))


def save_whole(policy, heads: Dict[str, torch.nn.Module], out: Path, state=None) -> None:
    """The policy and its heads into the dir `out` (final/, interrupted/), written aside and renamed
    into place whole (`publish`), so that a dir of that name is always complete."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a process that died while writing it
    save_policy(policy, tmp, state)
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
    """Every file of a checkpoint into the (new, empty) dir `out`; the manifest last."""
    shards = shards or Shards()
    save_policy(ctx.policy, out, shards.policy)
    save_heads(ctx.heads, out)
    optimizer = shards.optimizer if shards.optimizer is not None else ctx.optimizer.state_dict()
    torch.save({"optimizer": optimizer, "scheduler": ctx.scheduler.state_dict(),
                "rng": boundary.rng, "cache": boundary.cache}, out / STATE)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(ctx.cfg, resolve=True))
    manifest = {"format": FORMAT, "step": boundary.step, "bad_steps": boundary.bad_steps, "algo": ctx.cfg.algo.name,
                "policy": "lora" if ctx.policy.uses_lora else "full", "heads": list(ctx.heads),
                "sampler": boundary.sampler, "device": ctx.device.type,
                "optimizer_shards": shards.world if shards.optimizer is not None else None,
                "logged": last_logged(ctx.run_dir), "files": file_table(out)}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def save(ctx, boundary: Boundary, keep_last: Optional[int], shards: Optional[Shards] = None) -> Path:
    """Write the checkpoint of `boundary` (and the current weights and optimizer, which have not
    moved since) atomically, then prune to the `keep_last` newest. A complete checkpoint of the
    same step is the same state and is kept as it is. `shards`: the state FSDP gathered."""
    final = checkpoint_dir(ctx.run_dir, boundary.step)
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
    for path, problem in prune(ctx.run_dir, keep_last, written=final)[1]:
        ctx.console.print(f"[yellow]checkpoint {path.name} is damaged ({problem}); set aside, not counted in "
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
    """Hex sha256 of a file (about 1.7 GB/s on a Zen 3 core: 0.3 s for a 538 MB float32 SmolLM2)."""
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


def logged_steps(run_dir: Path) -> Optional[List[int]]:
    """The steps of RUN_DIR/metrics.jsonl's rows (a torn last line left out); None without the file."""
    path = Path(run_dir) / STEP_LOGS[0]
    return [row["step"] for _, row in log_rows(path)[0]] if path.is_file() else None


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to damaged_<name> beside it (a number added if taken); its path."""
    target, n = path.with_name(DAMAGED + path.name), 1
    while target.exists():
        target, n = path.with_name(f"{DAMAGED}{path.name}.{n}"), n + 1
    os.replace(path, target)
    return target


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


def read_manifest(path: Path) -> Dict[str, object]:
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"trainer.resume: {path} has checkpoint format {manifest.get('format')}, this version of "
                          f"rlnotes reads formats {', '.join(map(str, READABLE_FORMATS))}")
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


def log_rows(path: Path) -> Tuple[List[Tuple[str, dict]], Optional[str]]:
    """The (line, row) pairs of a step log, and a note when its last line was torn (a process
    killed mid-write: that line is dropped). Any other line that is not a row is an error."""
    lines = Path(path).read_text().splitlines()
    rows, torn = [], None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = {"step": _line_step(line)} if line.startswith("step ") else json.loads(line)
            row["step"] + 0
        except (ValueError, TypeError, KeyError, IndexError):
            if number == len(lines):
                torn = f"{path}: its last line is torn (a write was cut off) and was dropped: {line[:60]!r}"
                break
            raise ConfigError(f"{path} line {number} is not a row of a step log ({line[:60]!r}); repair or delete "
                              "that line, then run again") from None
        rows.append((line, row))
    return rows, torn


def last_logged(run_dir: Path) -> Optional[int]:
    """The step of the last complete row of RUN_DIR/metrics.jsonl (None without one); reads its tail."""
    path = Path(run_dir) / STEP_LOGS[0]
    if not path.is_file():
        return None
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - (1 << 16)))
        tail = f.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, TypeError, KeyError):
            continue
    rows, _ = log_rows(path)  # a last row longer than the tail read
    return rows[-1][1]["step"] if rows else None


def carry_logs(source_run: Optional[Path], run_dir: Path, step: int) -> List[str]:
    """Rewrite the run's step logs to the rows of `source_run`'s logs up to `step` (the run the
    checkpoint came from: this run's own dir, or another one's, whose history the new run
    continues); step -1 drops every row. Each file is replaced atomically. Returns a note for
    each torn last line dropped."""
    run_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    for name in STEP_LOGS:
        source = source_run / name if source_run is not None else run_dir / name
        if not source.is_file():
            continue
        rows, torn = log_rows(source)
        notes += [torn] if torn else []
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text("".join(line + "\n" for line, row in rows if row["step"] <= step))
        os.replace(tmp, run_dir / name)
    return notes


def _line_step(line: str) -> int:
    return int(line.split(" ", 2)[1]) if line.startswith("step ") else json.loads(line)["step"]


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
    """Restore everything but the weights (load_policy, before FSDP shards them) and the heads (the
    caller adds those first, so that the optimizer has their parameter groups): optimizer,
    scheduler, RNG, data position, runner state."""
    from rlnotes.engine import distributed

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
    """SIGINT (Ctrl-C) and SIGTERM while training, and while the stop saves.

    A signal raises Interrupted at once when no optimizer update has run since the last
    completed step (`ctx.updating` is off): that step's checkpoint is then exact, and the partial
    step is simply redone on resume. During a step's updates (PPO's minibatches, GRPO's mu passes)
    the step is finished first and `check` stops after it; a second signal stops at once.
    With several processes every first signal waits for the end of the step, and `check` stops
    every rank after the same step when any of them got one (a rank stopping alone would leave the
    others waiting in a collective).

    A save (`saving`: a checkpoint, or the policy to interrupted/) is never cut short by the signal
    that stopped the run nor by the next one: the first signal after the stop began (or during a
    save) says what is being saved and that one more abandons it; only that one more does (its
    temporary dir is removed, the previous checkpoints stay). So Ctrl-C pressed twice in quick
    succession still saves, and a third press abandons the save. Handlers are installed only in
    the main thread (Python delivers signals nowhere else).
    """

    def __init__(self, ctx):
        self.ctx, self.signum, self._previous = ctx, None, {}
        self.stopping = False  # Interrupted was raised: the run is on its way out
        self.writing: Optional[str] = None  # what is being saved now
        self.warned = False  # the user was told that one more signal abandons the save
        self.abandoned = False  # and sent it: a save was abandoned

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextmanager
    def saving(self, what: str):
        """Mark the block as writing `what` (for the message a signal gets meanwhile)."""
        self.writing = what
        try:
            yield
        finally:
            self.writing = None

    def _say(self, text: str) -> None:
        from rich.markup import escape

        self.ctx.console.print(f"[yellow]{escape(text)}[/]", soft_wrap=True, highlight=False)

    def _handle(self, signum, frame) -> None:
        from rlnotes.engine import distributed

        first, self.signum = self.signum is None, self.signum or signum
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {signal.Signals(signum).name} again"
        if self.stopping or self.writing:
            if self.writing and self.warned:
                self.abandoned, self.stopping = True, True
                raise Interrupted(self.signum)
            if not self.warned:
                self.warned = True
                self._say(f"{signal.Signals(signum).name}: saving {self.writing or 'a checkpoint'} before stopping; "
                          f"{again} to abandon it (the previous checkpoints are kept)")
            return
        if first and (self.ctx.updating or distributed.active()):
            self._say(f"{signal.Signals(signum).name}: stopping once this step is done ({again} to stop now, "
                      "without a checkpoint of this step)")
            return
        self.stopping = True
        raise Interrupted(self.signum)

    def check(self) -> None:
        """Stop now if a signal came during the step just finished (to any rank)."""
        from rlnotes.engine import distributed

        if distributed.any_rank(self.signum is not None):
            self.stopping = True
            raise Interrupted(self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "KeyboardInterrupt"


def resume_command(run_dir: Path) -> str:
    """The command line that continues this run: its --config-dir, --config-name and overrides
    (a multirun member's own), then trainer.resume=auto and its run dir."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    words, overrides = ["rlnotes", "train"], ["..."]
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        for source in hydra.runtime.config_sources:
            if source.provider == "command-line" and source.schema == "file":  # --config-dir
                words += ["--config-dir", source.path]
        if hydra.job.config_name != "config":
            words += ["--config-name", hydra.job.config_name]
        overrides = [o for o in hydra.overrides.task if not o.startswith("trainer.resume=")]
    words += [*overrides, "trainer.resume=auto", f"hydra.run.dir={run_dir}"]
    return " ".join(w if w == "..." else shlex.quote(w) for w in words)
