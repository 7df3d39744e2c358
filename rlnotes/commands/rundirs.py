"""Where the jobs of `rlnotes train` write, settled before Hydra starts: the run and sweep dir
patterns read the clock once (every rank of a torchrun and every member of a sweep then name one
dir), and each dir is claimed, so that a command never overwrites a run or joins one that another
process is running.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf, read_write

from rlnotes.commands import hydra
from rlnotes.commands.usage import UsageError
from rlnotes.core.errors import ConfigError
from rlnotes.run import rundir
from rlnotes.core.overrides import override_value

# The algo= option a job chose, as conf/config.yaml's run and sweep dir patterns name it.
ALGO_CHOICE = "${hydra.runtime.choices.algo}"


def stamp_dirs(pattern: str, now) -> str:
    """A Hydra dir pattern with each ${now:FORMAT} replaced by `now` in that format."""
    return re.sub(r"\$\{now:([^}]*)\}", lambda m: now.strftime(m.group(1)), pattern)


def quoted(value: str) -> str:
    """A value as one Hydra override string (spaces, = and : included)."""
    return "'" + value.replace("'", "\\'") + "'"


def sweep_dir(jobs: list) -> str:
    """The sweep dir pattern of a multirun's jobs, naming the algo= option they chose once for all
    of them (`dapo+grpo` when the sweep varies it): each job would otherwise resolve the pattern to
    its own choice, and the sweep would scatter over several dirs."""
    pattern = OmegaConf.to_container(jobs[0].hydra, resolve=False)["sweep"]["dir"]
    return pattern.replace(ALGO_CHOICE, "+".join(dict.fromkeys(job.hydra.runtime.choices.algo for job in jobs)))


def pin_dirs(jobs: list, now) -> List[str]:
    """Overrides that fix hydra.run.dir and hydra.sweep.dir at `now` (each ${now:...} read once),
    and the same pins in the composed `jobs`: the run dir check, Hydra and every rank of a
    torchrun then name one dir. Empty when the dirs do not read the clock."""
    dirs = OmegaConf.to_container(jobs[0].hydra, resolve=False)
    patterns = {"run": dirs["run"]["dir"], "sweep": sweep_dir(jobs)}
    pinned = {key: stamp_dirs(pattern, now) for key, pattern in patterns.items()}
    for cfg in jobs:
        with read_write(cfg.hydra):
            cfg.hydra.run.dir, cfg.hydra.sweep.dir = pinned["run"], pinned["sweep"]
    return [f"hydra.{key}.dir={quoted(pinned[key])}" for key in pinned if pinned[key] != dirs[key]["dir"]]


def run_dirs(jobs: list, multirun: bool) -> List[Optional[Path]]:
    """The dir each job will write, as Hydra resolves it (RUN_DIR, or SWEEP_DIR/SUBDIR of job number
    i); None for a dir pattern that reads what only Hydra's launcher sets (the job's own checks
    then stand alone)."""
    keys = ("hydra.sweep.dir", "hydra.sweep.subdir") if multirun else ("hydra.run.dir",)
    return hydra.job_dirs(jobs, keys)


def claim_run_dirs(jobs: list, multirun: bool, now) -> List[str]:
    """Refuse, before Hydra writes its .hydra/ files into a run dir, a command that would
    overwrite a run there or that another process is running in (rundir.check_run_dir,
    rundir.own); a single run takes its dir's lock now and keeps it, a sweep takes its sweep
    dir's for the whole multirun (`claim_sweep_dir`) and its members each take theirs when they
    start. Returns overrides: a command that resumes runs in their dirs records itself in
    .hydra/resumed_<time>/, leaving the .hydra/ files of the command that started them (even if
    the resume is refused later)."""
    held = []
    try:
        if multirun:
            claim_sweep_dir(jobs)
        for cfg, run_dir in zip(jobs, run_dirs(jobs, multirun)):
            if run_dir is None:
                held.append(False)
                continue
            rundir.check_run_dir(run_dir, cfg.trainer.resume, cfg.trainer.steps, member=multirun)
            if multirun:
                rundir.check_owner(run_dir)
            else:
                rundir.own(run_dir)
            held.append(bool(rundir.run_files(run_dir)))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return [f"hydra.output_subdir='.hydra/resumed_{now:%Y-%m-%d_%H-%M-%S}'"] if all(held) else []


def sweep_dir_of(jobs: list) -> Optional[Path]:
    """The sweep dir of a multirun's jobs (None for a pattern only Hydra's launcher resolves)."""
    return hydra.job_dirs(jobs[:1], ("hydra.sweep.dir",))[0]


def claim_sweep_dir(jobs: list) -> None:
    """Take the sweep dir's lock for the whole multirun, so that two sweeps into one dir at once
    cannot rewrite each other's members (their .hydra/ files, their runs) or summaries: the second
    is refused in one line naming the first's pid. The dir must not be, or lie inside, a run, a
    policy or a checkpoint, and must be writable."""
    sweep = sweep_dir_of(jobs)
    if sweep is None:
        return
    kind = rundir.contents(sweep)
    if kind in ("file", "run", "evaluation", "checkpoint", "policy"):
        raise ConfigError(f"hydra.sweep.dir={sweep} is {'a file' if kind == 'file' else f'a {kind} dir'}, not a sweep "
                          "dir; start the sweep in another dir (hydra.sweep.dir=NEW_DIR)")
    problem = rundir.enclosing(sweep)
    if problem:
        raise ConfigError(f"{problem}; start the sweep in another dir (hydra.sweep.dir=NEW_DIR)")
    if not rundir.writable(sweep):
        raise ConfigError(f"hydra.sweep.dir={sweep} is not writable by this user; start the sweep in another dir "
                          "(hydra.sweep.dir=NEW_DIR)")
    rundir.own(sweep, elsewhere="start this sweep in another dir (hydra.sweep.dir=NEW_DIR)", deep=False)


def release_sweep_dir(jobs: list) -> None:
    """Give up the sweep dir's lock (claim_sweep_dir) once the multirun is over."""
    sweep = sweep_dir_of(jobs)
    if sweep is not None:
        rundir.release(sweep)


def job_dir_override(run_dir) -> str:
    """The override that runs a job in `run_dir` (a path, read literally)."""
    return f"hydra.run.dir={override_value(str(run_dir))}"
