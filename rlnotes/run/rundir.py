"""One run per run dir, and one process in it.

A run dir holds a run once a run has written any of RUN_FILES there. A command that would write
over it (a new run, or resuming another dir's checkpoint) is refused, and so is resume=auto of a
finished run that asks for no more steps (`check_run_dir`); the CLI checks this before Hydra writes
its .hydra/ files into the dir, and the run checks it again when it starts.

While a run trains, its process (rank 0 under torchrun) holds an exclusive flock on RUN_DIR/.lock,
its pid written in the file (`own`): a second process is refused in one line naming that pid. The
OS drops the lock when the process ends, however it ends, so a dead owner leaves no stale lock.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Dict, List, Optional

from rlnotes.core.errors import ConfigError
from rlnotes.run.checkpoint import CHECKPOINTS, checkpoints, step_of
from rlnotes.run.restore import resolve
from rlnotes.run.steplogs import last_logged

# The owner's lock file in a run dir.
LOCK = ".lock"
# What a run writes into its dir (Hydra's own .hydra/ and job log come before a run starts, so
# they do not count): a dir holding any of them holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", CHECKPOINTS, "final", "interrupted")


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


def check_run_dir(run_dir: Path, resume: Optional[str], steps: int) -> None:
    """Refuse, before anything in `run_dir` changes, a run that would overwrite another one there:
    a new run (no trainer.resume, or a checkpoint of another dir) into a dir that holds a run, and
    resume=auto of a finished run that asks for no more steps than it took. A run dir's own
    checkpoint, or resume=auto of an unfinished run, continues it."""
    found = run_files(run_dir)
    if not found:
        return
    given = Path(resume).resolve() if resume not in (None, "auto") else None
    ours = resume == "auto" or (given is not None and Path(run_dir).resolve() in (given, *given.parents))
    done = finished_at(run_dir)
    if not ours:
        how = (f"to train it longer, raise trainer.steps above {done}" if done is not None else "to continue it")
        raise ConfigError(f"{run_dir} already holds a run{'' if done is None else f' that finished at step {done}'} "
                          f"({', '.join(found)}); {how} with trainer.resume=auto hydra.run.dir={run_dir}, or start the "
                          "new run in another dir (hydra.run.dir=NEW_DIR)")
    if resume == "auto" and done is not None and not checkpoints(run_dir):
        raise ConfigError(f"{run_dir} holds a finished run (final/) with no checkpoint to continue from; nothing to "
                          "resume: start the new run in another dir (hydra.run.dir=NEW_DIR)")
    start = done if resume == "auto" or done is None else step_of(resolve(resume))
    if done is not None and steps <= start:
        raise ConfigError(f"{run_dir} holds a run that finished at step {done}, and trainer.steps={steps} asks for no "
                          f"more; to train it longer, raise trainer.steps above {start} (with trainer.resume="
                          f"{resume}), or start a new run in another dir (hydra.run.dir=NEW_DIR)")


# ---------------------------------------------------------------------------------------------
# One owner per run dir.

_OWNED: Dict[str, int] = {}  # run dirs this process holds the lock of: resolved path -> lock file descriptor


def _holds(fd: int, lock: Path) -> bool:
    """Whether `fd` is still the open lock file at `lock` (not one since deleted and made anew)."""
    try:
        here, held = os.stat(lock), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def own(run_dir: Path) -> None:
    """Make this process the owner of `run_dir` (created if new): an exclusive flock on RUN_DIR/.lock
    with this pid written in it, held until `release` or the end of the process (the OS drops it
    on any exit, so an owner that died leaves no stale lock). Taking it again is a no-op. Another
    live owner is refused in one line with its pid."""
    run_dir = Path(run_dir)
    key, lock = str(run_dir.resolve()), run_dir / LOCK
    if key in _OWNED:
        if _holds(_OWNED[key], lock):
            return
        os.close(_OWNED.pop(key))  # the dir was deleted and made anew since
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        raise ConfigError(f"{run_dir} is in use by another rlnotes process (pid {pid}, see {lock}); wait for it to "
                          "end or stop it, or start this run in another dir (hydra.run.dir=NEW_DIR)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _OWNED[key] = fd


def release(run_dir: Path) -> None:
    """Give up `run_dir`'s lock if this process holds it."""
    fd = _OWNED.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)


def check_owner(run_dir: Path) -> None:
    """Refuse in one line when another process owns `run_dir` now; takes nothing."""
    if not (Path(run_dir) / LOCK).exists() or str(Path(run_dir).resolve()) in _OWNED:
        return
    own(run_dir)
    release(run_dir)
