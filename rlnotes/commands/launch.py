"""How the jobs of `rlnotes train` are started: as one process, as torchrun's processes
(hardware.nproc), each configuration once per seed (sweep.seeds), and with the settings a sweeper
or launcher needs from the run config (the Optuna sweeper's direction, the joblib launcher's
share of the cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from rlnotes.algos.registry import algorithm
from rlnotes.commands import hydra
from rlnotes.commands.rundirs import job_dir_override, pin_dirs
from rlnotes.commands.usage import UsageError
from rlnotes.core.errors import TrainingError
from rlnotes.engine.hardware import distributed
from rlnotes.engine.hardware.devices import resolve_device
from rlnotes.run.records import objective_metric


def torchrun_command(nproc: int, argv: List[str]) -> List[str]:
    """What `rlnotes train hardware.nproc=N ...` becomes: torchrun (from this Python) with N processes
    on this machine, each running the same `rlnotes train ...`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "rlnotes", "train", *argv]


def processes(jobs: list) -> int:
    """hardware.nproc of the command's jobs: one number for a whole sweep, whose jobs share the processes."""
    counts = {cfg.hardware.nproc or 1 for cfg in jobs}
    if len(counts) > 1:
        raise UsageError(f"hardware.nproc takes {len(counts)} values in this sweep; the processes are started once "
                         "for all of its jobs, so give it one value")
    return counts.pop()


def launch(nproc: int, argv: List[str]) -> int:
    """Hand this command over to torchrun (the process becomes torchrun: signals reach it directly)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # cores shared out
    print(f"rlnotes: starting {nproc} processes: torchrun --standalone --nproc_per_node={nproc} -m rlnotes train "
          + " ".join(argv), file=sys.stderr, flush=True)
    command = torchrun_command(nproc, argv)
    os.execv(command[0], command)
    return 1  # not reached


def rank_overrides(jobs: list) -> List[str]:
    """Overrides for a process torchrun started. Hydra names run and sweep dirs by the clock, which
    can read another second on each rank: every rank takes rank 0's time, so all write to one dir;
    ranks other than 0 leave Hydra's own files (.hydra/, the job log, the sweep summary) to it.
    Joins the process group first (once per process; it serves every job of a sweep)."""
    distributed.init(resolve_device(jobs[0].hardware.device))
    extra = pin_dirs(jobs, distributed.agreed_now())
    if not distributed.is_main():
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                  "~hydra.callbacks.sweep_summary"]
    return extra


def member_torchrun(nproc: int, run_dir: Path) -> None:
    """hardware.nproc=N in a sweep member that a launcher runs in its own process (joblib, submitit):
    the member starts torchrun with N processes for a single run of its overrides in its run dir."""
    command = torchrun_command(nproc, [*hydra.job_overrides(), job_dir_override(run_dir)])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, cores() // nproc))))
    code = subprocess.run(command, env=env).returncode
    if code:
        raise TrainingError(f"torchrun with {nproc} processes exited with status {code}; see the logs in {run_dir}")


def cores() -> int:
    """CPU cores this process may use (its affinity mask, which a cluster scheduler sets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_process(cfg) -> bool:
    """Whether Hydra runs the members in this process (its basic launcher), one after another."""
    return cfg.hydra.launcher._target_.endswith("BasicLauncher")


def with_seeds(argv: List[str], args, jobs: list) -> Optional[List[str]]:
    """sweep.seeds=N > 1: the command with seed=s,s+1,...,s+N-1 (s: the configured seed) in place of
    any seed override, so each configuration runs N times; None when N is 1."""
    counts = {cfg.sweep.seeds for cfg in jobs}
    if counts == {1}:
        return None
    n = max(counts)
    if len(counts) > 1:
        raise UsageError("sweep.seeds takes one value for a whole sweep")
    if not args.multirun:
        raise UsageError(f"sweep.seeds={n} runs each configuration {n} times, once per seed: add -m "
                         "(rlnotes train -m ...)")
    if not jobs[0].hydra.sweeper._target_.endswith("BasicSweeper"):
        raise UsageError("sweep.seeds repeats each configuration of a grid sweep; a search trial is one run of one "
                         "seed: drop sweep.seeds, or average seeds by sweeping them in a grid (seed=0,1,2)")
    seeds = [o for o in hydra.parse_overrides(args.overrides) if o.key_or_group == "seed"]
    if any(o.is_sweep_override() for o in seeds):
        raise UsageError(f"seed is swept and sweep.seeds={n} is set; give the seeds one way: seed=0,1,2 or "
                         "sweep.seeds=3")
    drop = {o.input_line for o in seeds}
    first = jobs[0].seed
    return [a for a in argv if a not in drop] + ["seed=" + ",".join(str(first + i) for i in range(n))]


def launcher_overrides(jobs: list, overrides: List[str]) -> List[str]:
    """Settings a sweeper or launcher needs from the run config: the Optuna sweeper's direction from
    sweep.direction, and with the joblib launcher hardware.threads so that the members running at
    once share the cores (when the user did not set it; said in one line)."""
    cfg = jobs[0]
    given = {o.key_or_group for o in hydra.parse_overrides(overrides)}
    extra = _optuna_direction(jobs, given) if cfg.hydra.sweeper._target_.endswith("OptunaSweeper") else []
    unset = all(job.hardware.threads in (None, "auto") for job in jobs)  # else each member may take every core
    if cfg.hydra.launcher._target_.endswith("JoblibLauncher") and unset:
        cores_here, n_jobs = cores(), cfg.hydra.launcher.n_jobs
        at_once = cores_here + 1 + n_jobs if n_jobs < 0 else n_jobs  # joblib's -1: every core
        batch = cfg.hydra.sweeper.n_jobs if "n_jobs" in cfg.hydra.sweeper else len(jobs)
        at_once = max(1, min(at_once, batch))
        threads = max(1, cores_here // at_once)
        print(f"rlnotes: {at_once} members at a time (hydra/launcher=joblib), {threads} thread{'s' * (threads > 1)} "
              f"each on {cores_here} cores (hardware.threads={threads}; set it to choose)", file=sys.stderr, flush=True)
        extra.append(f"hardware.threads={threads}")
    return extra


def _optuna_direction(jobs: list, given: set) -> List[str]:
    """hydra.sweeper.direction from the members' objective (sweep.objective, sweep.direction), which
    must go one way for all of them; a direction given on the command line must agree with it."""
    cfg = jobs[0]
    senses = {objective_metric(job.sweep, job.trainer.eval_every, algorithm(job.algo.name)) for job in jobs}
    if len({sense for _, sense in senses}) > 1:
        ways = ", ".join(f"{metric}: {sense}" for metric, sense in sorted(senses))
        raise UsageError(f"the members' objectives go different ways ({ways}); set sweep.objective (or "
                         "sweep.direction) so that one direction fits all")
    sense = senses.pop()[1]
    if "hydra.sweeper.direction" not in given:
        return [f"hydra.sweeper.direction={sense}"]
    if str(cfg.hydra.sweeper.direction).split(".")[-1] != sense:
        raise UsageError(f"hydra.sweeper.direction={cfg.hydra.sweeper.direction} disagrees with the "
                         f"objective's direction ({sense}); set sweep.direction instead (the sweeper "
                         "follows it)")
    return []
