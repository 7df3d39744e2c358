"""`rlnotes train [overrides]`: check every job of the command, settle how it starts (one process,
torchrun, a sweep's launcher) and where it writes, then hand it to Hydra, which calls `train_job`
once or for each member of a sweep."""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from rich.console import Console
from rich.markup import escape

from rlnotes.agents.environments import EnvironmentFailure
from rlnotes.algos.registry import algorithm
from rlnotes.commands import hydra
from rlnotes.commands.check import check_args
from rlnotes.commands.launch import (
    in_process,
    launch,
    launcher_overrides,
    member_torchrun,
    processes,
    rank_overrides,
    with_seeds,
)
from rlnotes.commands.rundirs import claim_run_dirs, pin_dirs, release_sweep_dir
from rlnotes.commands.sweep import SweepSummary
from rlnotes.commands.usage import UsageError
from rlnotes.commands.validate import register, resolve_auto
from rlnotes.core.errors import INPUT_ERROR, ConfigError, SaveFailed, TrainingError
from rlnotes.engine.hardware import distributed
from rlnotes.rewards.scoring import RewardFailure
from rlnotes.run import rundir
from rlnotes.run.checkpoint import checkpoints
from rlnotes.run.logger import RunConsole
from rlnotes.run.records import (
    METRICS_FILE,
    objective_metric,
    objective_value,
    read_metrics,
    write_result,
)
from rlnotes.run.signals import resume_command
from rlnotes.training import loop


def train(cfg, run_dir: Path, console: Console) -> Dict[str, float]:
    """Train the policy of `cfg` (composed, resolved and validated) with its algorithm; the last
    step's metrics."""
    return loop.train(cfg, algorithm(cfg.algo.name), run_dir, console)


def main(argv: List[str], checked: Optional[list] = None) -> int:
    """`rlnotes train [overrides]`: 0 when every job ran, 1 when a member of a sweep failed.
    `checked`: the command's jobs when they are checked already (rlnotes.commands.front)."""
    args = hydra.parse_args(argv)
    informational = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    jobs = []
    if not informational:
        prepared = _prepared(argv, args, checked)
        if prepared is None:
            return 1  # not reached: this process became torchrun
        argv, jobs = prepared
    register()
    SweepSummary.failed = []
    try:
        hydra.run(train_job, argv, jobs[0] if jobs else None)
    finally:
        if args.multirun and jobs:
            release_sweep_dir(jobs)  # held for the whole multirun (claim_run_dirs)
    return 1 if SweepSummary.failed else 0  # every member ran; the summary names those that failed


def _prepared(argv: List[str], args, checked: Optional[list]) -> Optional[Tuple[List[str], list]]:
    """The command line Hydra runs, once every job is checked: its seeds, the settings its sweeper
    and launcher need, the dirs pinned and claimed; and the jobs. Hands over to torchrun
    (hardware.nproc > 1)."""
    jobs = checked if checked is not None else check_args(args)
    seeded = with_seeds(argv, args, jobs)
    if seeded is not None:
        argv, args = seeded, hydra.parse_args(seeded)
        jobs = check_args(args)
    argv = [*argv, *launcher_overrides(jobs, args.overrides)]
    nproc = processes(jobs)
    if "WORLD_SIZE" in os.environ:  # a process torchrun started (ours or the user's)
        try:
            argv = [*argv, *rank_overrides(jobs)]
        except ConfigError as e:
            raise UsageError(str(e)) from None
    elif nproc > 1 and in_process(jobs[0]):  # other launchers start torchrun in each member
        launch(nproc, argv)
        return None
    else:
        argv = [*argv, *pin_dirs(jobs, datetime.now())]
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 owns the run dir
        argv = [*argv, *claim_run_dirs(jobs, args.multirun, datetime.now())]
    return argv, jobs


def train_job(cfg) -> Optional[float]:
    """One run: the task function Hydra calls, once or for each member of a sweep. At module level,
    so launchers that run members in other processes (joblib, submitit) pickle it by reference.
    Returns the run's objective (sweep.objective) to the sweeper. In a sweep a member that fails
    returns None and leaves its error in RUN_DIR/result.json, so the sweep goes on and its summary
    shows the failure. None because Hydra's optuna sweeper (1.3) records a value it cannot convert
    to float as a failed trial and goes on, whereas NaN crashes it (it tells Optuna the failed
    trial's value, which Optuna refuses) and so does an exception (unless
    hydra.sweeper.max_failure_rate allows it; Hydra's basic sweeper has no such setting)."""
    # A message is one line, however narrow the screen; with several processes rank 0 speaks.
    console = RunConsole(stderr=True, soft_wrap=True, quiet=not distributed.is_main())  # also RUN_DIR/train.log
    run_dir, member = hydra.job_dir(), hydra.in_sweep()
    resolve_auto(cfg)
    algo = algorithm(cfg.algo.name)
    objective = objective_metric(cfg.sweep, cfg.trainer.eval_every, algo)
    if member and rundir.finished_member(run_dir, cfg.trainer.resume, cfg.trainer.steps):
        console.print(f"{escape(str(run_dir))}: finished at step {cfg.trainer.steps} already; left as it is",
                      highlight=False)
        return _objective(run_dir, objective, cfg.sweep.last_steps)[0]  # a re-run sweep's summary has its row
    try:
        if member and (cfg.hardware.nproc or 1) > 1 and "WORLD_SIZE" not in os.environ:
            member_torchrun(cfg.hardware.nproc, run_dir)
        else:
            loop.train(cfg, algo, run_dir, console)
    except (TrainingError, ConfigError, RewardFailure, EnvironmentFailure) as e:
        console.print(f"[red]rlnotes: error:[/] {escape(str(e))}")
        if not isinstance(e, (ConfigError, SaveFailed)):  # a setting is fixed anew; SaveFailed says how
            _resume_hint(console, run_dir)
        if not member:  # a setting, the data or the hardware: the user's input, as for a usage error
            if distributed.world_size() == 1:  # a run that never started leaves no empty dir (a sweep's
                rundir.discard_unstarted(run_dir)  # member keeps its result.json: the summary's row)
            sys.exit(INPUT_ERROR if isinstance(e, ConfigError) else 1)
        error = str(e)
    except KeyboardInterrupt:  # however it stopped (loading, a step, a save, a sweep member): how to go on
        console.print(f"[yellow]resume with:[/]\n  {escape(resume_command(run_dir))}", highlight=False)
        raise
    except Exception as e:  # a bug or a crash in one member must not take the others down
        _resume_hint(console, run_dir)  # a bug: the traceback follows (Hydra's, or the log's in a sweep)
        if not member:
            raise
        logging.getLogger("rlnotes").exception("this member failed; the sweep goes on")
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    else:
        value, error = _objective(run_dir, objective, cfg.sweep.last_steps)
        if value is not None:
            return value
    if distributed.is_main():
        write_result(run_dir, "failed", objective, None, error)
    return None


def _objective(run_dir: Path, objective: Tuple[str, str], last_steps: int) -> Tuple[Optional[float], str]:
    """The objective value of a run that finished, recorded in its result.json; else None and why."""
    metrics = run_dir / METRICS_FILE
    value = objective_value(read_metrics(metrics) if metrics.exists() else [], objective[0], last_steps)
    if value is None:
        return None, f"sweep.objective={objective[0]} was not logged by this run; choose a metric of its metrics.jsonl"
    if distributed.is_main():
        write_result(run_dir, "completed", objective, value)
    return value, ""


def _resume_hint(console, run_dir: Path) -> None:
    """How to go on from a run that stopped on an error, when it has a checkpoint to go on from."""
    if checkpoints(run_dir):
        console.print(f"[yellow]after a fix, resume with:[/]\n  {escape(resume_command(run_dir))}", highlight=False)
