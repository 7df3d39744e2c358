"""One run per run dir, and one process in it.

A run dir holds a run once a run has written its config.yaml there (rlnotes.run.config_file), and
then the rest of RUN_FILES. `contents` tells such a dir from a new one (nothing in it, or only what
Hydra and the lock leave before a run starts: BEFORE_RUN), from a policy or a checkpoint (final/,
checkpoints/step_N), from an evaluation's output (rlnotes eval) and from a dir of anything else.
`check_run_dir` refuses, before anything in the dir changes, a run that would write over something
there: a new run into a dir that holds a run (or anything else), resume=auto of a finished run that
asks for no more steps, trainer.steps below the checkpoint resumed, a dir inside a run's or a
policy's folders (which rlnotes replaces or prunes whole), a dir holding symbolic links among its
files (written through, they would change the files they point to) or one this user cannot write.
The CLI checks this before Hydra writes its .hydra/ files into the dir, and the run checks it again
when it starts.

While a run trains, its process (rank 0 under torchrun) holds an exclusive flock on RUN_DIR/.lock,
its pid written in the file (`own`): a second process is refused in one line naming that pid. The
OS drops the lock when the process ends, however it ends, so a dead owner leaves no stale lock. A
sweep's process holds its sweep dir's lock the same way for the whole multirun.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import yaml

from rlnotes.core.errors import ConfigError
from rlnotes.run import files
from rlnotes.run.checkpoint import checkpoints, is_checkpoint, step_of
from rlnotes.run.places import (  # noqa: F401 - contents, enclosing, writable: asked of rundir by the commands
    CHECKPOINTS,
    EVAL_FILES,
    LOCK,
    MANIFEST,
    before_run,
    contents,
    enclosing,
    writable,
)
from rlnotes.run.restore import resolve
from rlnotes.core.overrides import override_value
from rlnotes.run.steplogs import last_logged

# What a run writes into its dir (Hydra's own .hydra/ and job log come before a run starts, so
# they do not count): a dir holding an rlnotes config.yaml holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", CHECKPOINTS, "final", "interrupted")
NEW_DIR = "start the run in another dir (hydra.run.dir=NEW_DIR)"


def run_files(run_dir: Path) -> List[str]:
    """What a run wrote into `run_dir` (see RUN_FILES); empty for a new dir, or one where Hydra
    alone wrote (a command that stopped before training began)."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


def finished_at(run_dir: Path) -> Optional[int]:
    """The last step of a finished run (one with final/): its newest checkpoint's, or its last
    logged row's; None when the run is not finished."""
    if not (Path(run_dir) / "final").exists():
        return None
    steps = [step_of(p) for p in checkpoints(run_dir)] + [last_logged(run_dir) or 0]
    return max(steps)


def check_place(run_dir: Path) -> None:
    """Refuse a run dir that is a file, lies inside a policy or a run's folders, holds symbolic
    links among its files, or cannot be written; one line each, saying what to do."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is a file, not a dir; {NEW_DIR}")
    problem = enclosing(run_dir)
    if problem:
        raise ConfigError(f"{problem}; {NEW_DIR}")
    links = files.symlinks(run_dir) if run_dir.is_dir() else []
    if links:
        named = ", ".join(f"{p.relative_to(run_dir)} -> {os.readlink(p)}" for p in links[:3])
        raise ConfigError(f"{run_dir} holds symbolic links among its files ({named}{', ...' if len(links) > 3 else ''})"
                          "; rlnotes writes a run's files in its dir and never through a link: replace each link "
                          f"with a copy of what it points to, or {NEW_DIR}")
    if not all(writable(p) for p in (run_dir, run_dir / CHECKPOINTS) if p == run_dir or p.is_dir()):
        raise ConfigError(f"{run_dir} is not writable by this user (permissions, or a read-only file system); make "
                          f"it writable (chmod -R u+w {run_dir}), or {NEW_DIR}")


def finished_member(run_dir: Path, resume: Optional[str], steps: int) -> bool:
    """A sweep member that a re-run of its sweep command (trainer.resume=auto) leaves as it is: its
    run finished at exactly `steps`, so there is nothing to resume and its result stands."""
    return resume == "auto" and finished_at(Path(run_dir)) == steps


def check_run_dir(run_dir: Path, resume: Optional[str], steps: int, member: bool = False) -> None:
    """Refuse, before anything in `run_dir` changes, a run that would overwrite anything there or
    that could not finish (see the module's docstring). A run dir's own checkpoint, or
    resume=auto of an unfinished run, continues it; `member` (a sweep's): a finished member that asks
    for no more steps is left as it is (finished_member)."""
    run_dir = Path(run_dir)
    kind = contents(run_dir)
    if kind in ("checkpoint", "policy"):  # said as such rather than as a place inside a run's folders
        _refuse_other(run_dir, kind)
    check_place(run_dir)
    _refuse_other(run_dir, kind)
    _check_steps(run_dir if resume == "auto" else resume, steps)
    if kind == "new":
        return
    found = run_files(run_dir)
    given = Path(resume).resolve() if resume not in (None, "auto") else None
    ours = resume == "auto" or (given is not None and Path(run_dir).resolve() in (given, *given.parents))
    done = finished_at(run_dir)
    if not ours:
        how = (f"to train it longer, raise trainer.steps above {done}" if done is not None else "to continue it")
        raise ConfigError(f"{run_dir} already holds a run{'' if done is None else f' that finished at step {done}'} "
                          f"({', '.join(found)}); {how} with trainer.resume=auto hydra.run.dir={_arg(run_dir)}, or start the "
                          "new run in another dir (hydra.run.dir=NEW_DIR)")
    if resume == "auto" and done is not None and not checkpoints(run_dir):
        raise ConfigError(f"{run_dir} holds a finished run (final/) with no checkpoint to continue from; nothing to "
                          "resume: start the new run in another dir (hydra.run.dir=NEW_DIR)")
    start = done if resume == "auto" or done is None else step_of(resolve(resume))
    if member and finished_member(run_dir, resume, steps):
        return
    if done is not None and steps <= start:
        raise ConfigError(f"{run_dir} holds a run that finished at step {done}, and trainer.steps={steps} asks for no "
                          f"more; to train it longer, raise trainer.steps above {start} (with trainer.resume="
                          f"{resume}), or start a new run in another dir (hydra.run.dir=NEW_DIR)")


def _refuse_other(run_dir: Path, kind: str) -> None:
    """Refuse a dir that holds something other than a run (see `contents`)."""
    if kind in ("checkpoint", "policy"):
        run = run_dir.parent.parent if kind == "checkpoint" and run_dir.parent.name == CHECKPOINTS else run_dir.parent
        what = "a checkpoint" if kind == "checkpoint" else "a saved policy (final/, interrupted/ or a model dir)"
        how = (f"to continue its run: trainer.resume=auto hydra.run.dir={_arg(run)}; to start a new run from it: "
               f"trainer.resume={_arg(run_dir)} hydra.run.dir=NEW_DIR" if kind == "checkpoint" else NEW_DIR)
        raise ConfigError(f"{run_dir} is {what}, not a run dir; {how}")
    if kind == "evaluation":
        raise ConfigError(f"{run_dir} holds an evaluation (rlnotes eval's {', '.join(EVAL_FILES)}), not a run; "
                          f"{NEW_DIR}")
    if kind == "other":
        names = sorted(p.name for p in run_dir.iterdir() if not before_run(p.name))
        raise ConfigError(f"{run_dir} is not empty and holds no rlnotes run ({', '.join(names[:5])}"
                          f"{', ...' if len(names) > 5 else ''}); a run writes only into a new or empty dir: {NEW_DIR}")


def _arg(path: Path) -> str:
    """A path as an override's value that pastes (signals.override_value)."""
    return override_value(str(path))


def resumed_step(path: Path) -> Optional[Tuple[Path, int]]:
    """The checkpoint a resume from `path` (a checkpoint, or a run dir: its newest one) would start
    at, and its step, judged without reading its weights: the newest whose manifest agrees with its
    dir's name and its run's trainer.steps (one that does not is damaged, and set aside when the
    run starts); None when there is none."""
    path = Path(path)
    for candidate in reversed([path] if is_checkpoint(path) else checkpoints(path)):
        try:
            step = int(json.loads((candidate / MANIFEST).read_text())["step"])
            trained = yaml.safe_load((candidate / "config.yaml").read_text())["trainer"]["steps"]
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
            continue
        named = step_of(candidate) if candidate.name[5:].isdigit() else step
        if step == named and step <= int(trained):
            return candidate, step
    return None


def check_steps(checkpoint_step: Optional[int], path, steps: int) -> None:
    """Refuse trainer.steps below the step of the checkpoint resumed (a run is not trained back:
    its checkpoints past trainer.steps would never verify again)."""
    if checkpoint_step is not None and steps < checkpoint_step:
        raise ConfigError(f"trainer.resume: {path} is at step {checkpoint_step}, past trainer.steps={steps}; a run "
                          f"cannot be trained back: resume with trainer.steps={checkpoint_step} or more, or start a new "
                          "run in another dir (hydra.run.dir=NEW_DIR)")


def _check_steps(resume, steps: int) -> None:
    found = resumed_step(Path(resume)) if resume is not None and Path(resume).is_dir() else None
    if found is not None:
        check_steps(found[1], found[0], steps)


# ---------------------------------------------------------------------------------------------
# One owner per run dir.

_OWNED: Dict[str, int] = {}  # run dirs this process holds the lock of: resolved path -> lock file descriptor
# What taking a dir's lock found (`own`, `discard_unstarted`): resolved path -> (the dirs it made, the
# run dir first and then those above it; the names the run dir held when it was there already).
_FOUND: Dict[str, Tuple[List[Path], Optional[Set[str]]]] = {}


def _drop_inherited_locks() -> None:
    """In a forked child (the reference pass's process, rlnotes.engine.hardware.beside): close its
    copies of the lock descriptors, which would keep the parent's flocks after the parent gives them
    up; the parent's own descriptors keep its locks."""
    for fd in _OWNED.values():
        os.close(fd)
    _OWNED.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _holds(fd: int, lock: Path) -> bool:
    """Whether `fd` is still the open lock file at `lock` (not one since deleted and made anew)."""
    try:
        here, held = os.stat(lock), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def own(run_dir: Path, elsewhere: str = "start this run in another dir (hydra.run.dir=NEW_DIR)",
        deep: bool = True) -> None:
    """Make this process the owner of `run_dir` (created if new): an exclusive flock on RUN_DIR/.lock
    with this pid written in it, held until `release` or the end of the process (the OS drops it
    on any exit, so an owner that died leaves no stale lock). Taking it again is a no-op. Another
    live owner is refused in one line with its pid, which ends with `elsewhere`. The files the dir
    shares with another by hard links (a `cp -al` copy) get their own copies first (files.detach;
    deep=False: only those directly in it, as for a sweep dir, whose members see to theirs), the
    lock file included, so that this run changes nothing of the other dir's."""
    run_dir = Path(run_dir)
    key, lock = str(run_dir.resolve()), run_dir / LOCK
    if key in _OWNED:
        if _holds(_OWNED[key], lock):
            return
        os.close(_OWNED.pop(key))  # the dir was deleted and made anew since
    made = list(itertools.takewhile(lambda p: not p.exists(), [run_dir, *run_dir.parents]))
    try:
        held = None if made else set(os.listdir(run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = _locked(run_dir, lock, elsewhere)
    except OSError as e:
        raise ConfigError(_lock_problem(run_dir, lock, e)) from None
    _FOUND[key] = (made, held)
    files.detach_tree(run_dir, skip=(CHECKPOINTS, "final", "interrupted"), deep=deep)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _OWNED[key] = fd


def _locked(run_dir: Path, lock: Path, elsewhere: str) -> int:
    """An open descriptor of the lock file at `lock`, flocked by this process and the only name of its
    file (one shared with another dir by a hard link is replaced by a file of its own)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise ConfigError(f"{run_dir} is in use by another rlnotes process (pid {pid}, see {lock}); wait for it "
                              f"to end or stop it, or {elsewhere}") from None
        if not _holds(fd, lock):  # the file was replaced since it was opened: lock the one there now
            os.close(fd)
            continue
        if os.fstat(fd).st_nlink == 1:
            return fd
        own_file = lock.with_name(f"{LOCK}.{os.getpid()}")  # a lock file of this dir's own, locked, then renamed in
        if os.path.lexists(own_file):
            os.unlink(own_file)
        new = os.open(own_file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(own_file, lock)
        os.close(fd)
        return new


def _lock_problem(run_dir: Path, lock: Path, error: OSError) -> str:
    """One line for a run dir whose lock cannot be taken."""
    if error.errno == errno.ELOOP:
        return (f"{lock} is a symbolic link; rlnotes never writes through one (it would change the file it points "
                "to): remove it, or start this run in another dir (hydra.run.dir=NEW_DIR)")
    if error.errno == errno.EISDIR:
        return (f"{lock} is a directory, where rlnotes keeps the lock file of the run dir; remove it if it is not "
                "yours, or start this run in another dir (hydra.run.dir=NEW_DIR)")
    if error.errno in (errno.EEXIST, errno.ENOTDIR):
        return f"{run_dir} (or a dir above it) is a file, not a dir; start this run in another dir (hydra.run.dir=NEW_DIR)"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"{run_dir} is not writable by this user (permissions, or a read-only file system); make it "
                f"writable (chmod -R u+w {run_dir}), or start this run in another dir (hydra.run.dir=NEW_DIR)")
    if files.is_full(error):
        return f"no space left on device for {lock}; free space, then run again"
    return f"{lock} cannot be made or locked ({error.strerror}); start this run in another dir (hydra.run.dir=NEW_DIR)"


def release(run_dir: Path) -> None:
    """Give up `run_dir`'s lock if this process holds it."""
    fd = _OWNED.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def discard_unstarted(run_dir: Path) -> bool:
    """Remove what this process added to `run_dir` since it first took its lock, when no run wrote
    there (`contents` is still "new": Hydra's .hydra/ and job log and the lock alone): the dir, and
    the empty dirs above it, when this process made it; else only the entries it added, so that a
    dir the user named keeps all it held. Whether anything went. A run that never started has
    nothing of value; one that wrote its config.yaml, a row or a checkpoint is never touched."""
    key = str(Path(run_dir).resolve())
    found = _FOUND.pop(key, None)
    if found is None:
        return False
    try:
        own(run_dir)  # no other process may start in it while it goes
    except ConfigError:
        return False
    finally:
        _FOUND.pop(key, None)
    made, before = found
    try:
        if contents(run_dir) != "new":
            return False
        for name in [name for name in os.listdir(run_dir) if before is None or name not in before]:
            path = Path(run_dir) / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        for path in made:  # the run dir first, then those above it this process made, while empty
            try:
                path.rmdir()
            except OSError:
                break
        return True
    finally:
        release(run_dir)


def check_owner(run_dir: Path) -> None:
    """Refuse in one line when another process owns `run_dir` now; takes nothing."""
    if not (Path(run_dir) / LOCK).exists() or str(Path(run_dir).resolve()) in _OWNED:
        return
    own(run_dir)
    release(run_dir)
