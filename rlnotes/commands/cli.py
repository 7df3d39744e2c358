"""The `rlnotes` command: `rlnotes train [overrides]`, with Hydra composing `conf/`.

Every override is checked before anything heavy is imported or loaded: each member of a
multirun sweep is composed against the typed schema and validated, and a mistake is reported
as one line naming the key and what it accepts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import datetime
from pathlib import Path
from typing import List, Optional

USAGE = """usage: rlnotes COMMAND [OVERRIDES...]

commands:
  train    fine-tune a model: rlnotes train algo=grpo model=tiny trainer.steps=40
           (Hydra flags work: -m for sweeps, --cfg job, --help for the config groups)
  eval     evaluate the base model or a trained policy on the task's eval split:
           rlnotes eval model=smollm2-135m data=arith   |   rlnotes eval eval.policy=RUN_DIR/final
  plot     figures of runs overlaid, and a table of their final metrics (pip extra: plot):
           rlnotes plot RUN_DIR [RUN_DIR...] | SWEEP_DIR [--out DIR] [--sort METRIC] [--smooth 0.9]
  export   merge a LoRA adapter into its base and save a Hugging Face model dir:
           rlnotes export RUN_DIR/final OUT_DIR [--dtype bfloat16]
"""

CONFIG_MODULE = "rlnotes.conf"
# Said when a sweeper or launcher is not an option: the Hydra plugins rlnotes documents.
SWEEP_EXTRA = (" (hydra/sweeper=optuna and hydra/launcher=joblib, submitit_local, submitit_slurm come with "
               "pip install 'rlnotes[sweep]')")


def _environment() -> None:
    """Settings that must be in place before torch is imported; a user's own values win."""
    # Spinning OpenMP threads make a shared CPU crawl; passive waiting costs nothing when idle.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # A hub id with no network behind it fails within seconds instead of hanging.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


class UsageError(Exception):
    pass


def _loader(config_dir: Optional[str]):
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_automatic_config_search_path

    from rlnotes.commands.validate import register

    register()
    search = create_automatic_config_search_path(None, None, f"pkg://{CONFIG_MODULE}")
    if config_dir:
        search.prepend("command-line", f"file://{os.path.abspath(config_dir)}")
    return ConfigLoaderImpl(config_search_path=search)


def _members(overrides: List[str], multirun: bool, loader=None) -> List[List[str]]:
    """The override lists of every job the command would run (one unless it is a sweep). A search
    (hydra/sweeper=optuna, an interval(...) to sample from, or a search space in a YAML file's
    hydra.sweeper.params, read through `loader`) does not know its members ahead: it gets
    representatives instead, each value of a choice or range and both ends of an interval, one
    parameter at a time, so a typo or a value out of range still fails before any run."""
    if not multirun:
        return [overrides]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    parsed = OverridesParser.create().parse_overrides(overrides)
    space = _yaml_search_space(loader, parsed) if loader is not None else []
    if space:
        parsed = OverridesParser.create().parse_overrides(space) + parsed
    search = space or any(isinstance(o.value(), IntervalSweep) for o in parsed) or any(
        o.key_or_group == "hydra/sweeper" and o.value() != "basic" for o in parsed)
    if not search:
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    options = [[f"{o.get_key_element()}={v}" for v in _representatives(o)] if o.is_sweep_override() else [o.input_line]
               for o in parsed]
    first = [values[0] for values in options]
    return [first] + [first[:i] + [value] + first[i + 1:] for i, values in enumerate(options) for value in values[1:]]


def _yaml_search_space(loader, parsed) -> List[str]:
    """hydra.sweeper.params of the configured search (an experiment file's search space) as
    overrides, less the keys the command line sets itself; empty when there is none."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        cfg = loader.load_configuration("config", fixed, _run_mode())
    except (HydraException, OmegaConfBaseException, ValueError):
        return []  # the command's own check reports it
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    given = {o.key_or_group for o in parsed}
    return [f"{key}={value}" for key, value in params.items() if key not in given]


def _representatives(override) -> List[str]:
    """Values that stand for a search parameter: a choice's or range's values, an interval's ends."""
    from hydra.core.override_parser.types import IntervalSweep

    value = override.value()
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    return list(override.sweep_string_iterator())


def _explain(exc: BaseException, loader, overrides: List[str]) -> str:
    """One line for a composition error: what was wrong and what is accepted."""
    import re

    from omegaconf import OmegaConf

    from rlnotes.core.errors import ConfigError

    if isinstance(exc, ConfigError):
        return str(exc)
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    full = f"{text}\n{cause}" if cause else text
    missing = re.search(r"Could not (?:find|load) '([^']+)/([^']+)'", full)  # load: an option in a list
    if missing:
        group, option = missing.groups()
        options = loader.get_group_options(group)
        extra = SWEEP_EXTRA if group in ("hydra/sweeper", "hydra/launcher") else ""
        return f"{group}={option} is not an option; choose one of: {', '.join(options)}{extra}"
    key = re.search(r"full_key: (\S+)", full)
    key = key.group(1) if key else None
    if "not in struct" in full or "not in '" in full or re.search(r"Key '[^']+' is not in", full):
        bad = key or re.search(r"Could not override '([^']+)'", full)
        bad = bad if isinstance(bad, str) else (bad.group(1) if bad else "?")
        parent, _, leaf = bad.rpartition(".")
        base = loader.load_configuration("config", [o for o in overrides if not o.lstrip("+~").startswith(bad)],
                                         _run_mode())
        node = OmegaConf.select(base, parent) if parent else base
        keys = [k for k in node.keys() if k != "hydra"] if node is not None and hasattr(node, "keys") else []
        where = f"under {parent}" if parent else "at the top level"
        return f"{bad} is not a setting; valid keys {where}: {', '.join(map(str, keys))}"
    if "could not be converted" in full or "Invalid value" in full or "ValidationError" in type(cause or exc).__name__:
        what = re.search(r"(Value '.*?' (?:of type '\w+' )?could not be converted to \w+|Invalid value '.*?'.*)", full)
        return f"{key or 'a value'}: {what.group(1) if what else text.splitlines()[0]}"
    if "Ambiguous value" in full:
        return f"{text.strip().splitlines()[0]}; to sweep over the values add -m (rlnotes train -m ...)"
    if "Missing mandatory value" in full or "missing value" in full.lower():
        return f"{key} is required; set it on the command line ({key}=...)"
    return text.strip().splitlines()[0] + (f" (key: {key})" if key else "")


def _run_mode():
    from hydra.types import RunMode

    return RunMode.RUN


def check(overrides: List[str], multirun: bool, config_dir: Optional[str]) -> list:
    """Compose and validate every job of the command; raise UsageError with one line if one fails.
    Returns the composed configs (with their hydra node), one per job."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rlnotes.commands.validate import resolve_auto, validate
    from rlnotes.core.errors import ConfigError

    loader = _loader(config_dir)
    jobs = []
    try:
        members = _members(overrides, multirun, loader)
    except HydraException as e:  # an override that does not parse
        raise UsageError(f"{str(e).strip().splitlines()[0]} (quote a value with spaces or special characters: "
                         "'key=\"...\"')") from None
    for job in members:
        try:
            cfg = loader.load_configuration("config", job, _run_mode())
            resolve_auto(cfg)
            validate(cfg)
        except (HydraException, OmegaConfBaseException, ConfigError, ValueError) as e:  # ValueError: logging=null
            raise UsageError(_explain(e, loader, job)) from None
        jobs.append(cfg)
    return jobs


def torchrun_command(nproc: int, argv: List[str]) -> List[str]:
    """What `rlnotes train hardware.nproc=N ...` becomes: torchrun (from this Python) with N processes
    on this machine, each running the same `rlnotes train ...`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "rlnotes", "train", *argv]


def _processes(jobs: list) -> int:
    """hardware.nproc of the command's jobs: one number for a whole sweep, whose jobs share the processes."""
    counts = {cfg.hardware.nproc or 1 for cfg in jobs}
    if len(counts) > 1:
        raise UsageError(f"hardware.nproc takes {len(counts)} values in this sweep; the processes are started once "
                         "for all of its jobs, so give it one value")
    return counts.pop()


def _launch(nproc: int, argv: List[str]) -> int:
    """Hand this command over to torchrun (the process becomes torchrun: signals reach it directly)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # cores shared out
    print(f"rlnotes: starting {nproc} processes: torchrun --standalone --nproc_per_node={nproc} -m rlnotes train "
          + " ".join(argv), file=sys.stderr, flush=True)
    command = torchrun_command(nproc, argv)
    os.execv(command[0], command)
    return 1  # not reached


def stamp_dirs(pattern: str, now) -> str:
    """A Hydra dir pattern with each ${now:FORMAT} replaced by `now` in that format."""
    import re

    return re.sub(r"\$\{now:([^}]*)\}", lambda m: now.strftime(m.group(1)), pattern)


# The algo= option a job chose, as conf/config.yaml's run and sweep dir patterns name it.
ALGO_CHOICE = "${hydra.runtime.choices.algo}"


def _quoted(value: str) -> str:
    """A value as one Hydra override string (spaces, = and : included)."""
    return "'" + value.replace("'", "\\'") + "'"


def sweep_dir(jobs: list) -> str:
    """The sweep dir pattern of a multirun's jobs, naming the algo= option they chose once for all
    of them (`dapo+grpo` when the sweep varies it): each job would otherwise resolve the pattern to
    its own choice, and the sweep would scatter over several dirs."""
    from omegaconf import OmegaConf

    pattern = OmegaConf.to_container(jobs[0].hydra, resolve=False)["sweep"]["dir"]
    return pattern.replace(ALGO_CHOICE, "+".join(dict.fromkeys(job.hydra.runtime.choices.algo for job in jobs)))


def pin_dirs(jobs: list, now) -> List[str]:
    """Overrides that fix hydra.run.dir and hydra.sweep.dir at `now` (each ${now:...} read once),
    and the same pins in the composed `jobs`: the run dir check, Hydra and every rank of a
    torchrun then name one dir. Empty when the dirs do not read the clock."""
    from omegaconf import OmegaConf, read_write

    dirs = OmegaConf.to_container(jobs[0].hydra, resolve=False)
    patterns = {"run": dirs["run"]["dir"], "sweep": sweep_dir(jobs)}
    pinned = {key: stamp_dirs(pattern, now) for key, pattern in patterns.items()}
    for cfg in jobs:
        with read_write(cfg.hydra):
            cfg.hydra.run.dir, cfg.hydra.sweep.dir = pinned["run"], pinned["sweep"]
    return [f"hydra.{key}.dir={_quoted(pinned[key])}" for key in pinned if pinned[key] != dirs[key]["dir"]]


def run_dirs(jobs: list, multirun: bool) -> List[Optional[Path]]:
    """The dir each job will write, as Hydra resolves it (RUN_DIR, or SWEEP_DIR/SUBDIR of job number
    i); None for a dir pattern that reads what only Hydra's launcher sets (the job's own checks
    then stand alone)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf, open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    setup_globals()  # the resolvers Hydra registers for its own start (hydra:, now:)
    previous, out = HydraConfig.instance().cfg, []
    try:
        for num, cfg in enumerate(jobs):
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.job.num = num
            HydraConfig.instance().set_config(cfg)
            keys = ("hydra.sweep.dir", "hydra.sweep.subdir") if multirun else ("hydra.run.dir",)
            try:
                out.append(Path(*[str(OmegaConf.select(cfg, key, throw_on_missing=True)) for key in keys]))
            except OmegaConfBaseException:
                out.append(None)
    finally:
        HydraConfig.instance().cfg = previous
    return out


def claim_run_dirs(jobs: list, multirun: bool, now) -> List[str]:
    """Refuse, before Hydra writes its .hydra/ files into a run dir, a command that would
    overwrite a run there or that another process is running in (rundir.check_run_dir,
    rundir.own); a single run takes its dir's lock now and keeps it, a sweep's members each
    take theirs when they start. Returns overrides: a command that resumes runs in their dirs
    records itself in .hydra/resumed_<time>/, leaving the .hydra/ files of the command that
    started them (even if the resume is refused later)."""
    from rlnotes.core.errors import ConfigError
    from rlnotes.run import rundir

    held = []
    try:
        for cfg, run_dir in zip(jobs, run_dirs(jobs, multirun)):
            if run_dir is None:
                held.append(False)
                continue
            rundir.check_run_dir(run_dir, cfg.trainer.resume, cfg.trainer.steps)
            if multirun:
                rundir.check_owner(run_dir)
            else:
                rundir.own(run_dir)
            held.append(bool(rundir.run_files(run_dir)))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return [f"hydra.output_subdir='.hydra/resumed_{now:%Y-%m-%d_%H-%M-%S}'"] if all(held) else []


def _rank_overrides(jobs: list) -> List[str]:
    """Overrides for a process torchrun started. Hydra names run and sweep dirs by the clock, which
    can read another second on each rank: every rank takes rank 0's time, so all write to one dir;
    ranks other than 0 leave Hydra's own files (.hydra/, the job log, the sweep summary) to it.
    Joins the process group first (once per process; it serves every job of a sweep)."""
    from rlnotes.engine import distributed
    from rlnotes.engine.models import resolve_device

    distributed.init(resolve_device(jobs[0].hardware.device))
    extra = pin_dirs(jobs, distributed.agreed_now())
    if not distributed.is_main():
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                  "~hydra.callbacks.sweep_summary"]
    return extra


def _resume_hint(console, run_dir: Path) -> None:
    """How to go on from a run that stopped on an error, when it has a checkpoint to go on from."""
    from rich.markup import escape

    from rlnotes.run.checkpoint import checkpoints
    from rlnotes.run.signals import resume_command

    if checkpoints(run_dir):
        console.print(f"[yellow]after a fix, resume with:[/]\n  {escape(resume_command(run_dir))}", highlight=False)


def _cores() -> int:
    """CPU cores this process may use (its affinity mask, which a cluster scheduler sets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _in_process(cfg) -> bool:
    """Whether Hydra runs the members in this process (its basic launcher), one after another."""
    return cfg.hydra.launcher._target_.endswith("BasicLauncher")


def _with_seeds(argv: List[str], args, jobs: list) -> Optional[List[str]]:
    """sweep.seeds=N > 1: the command with seed=s,s+1,...,s+N-1 (s: the configured seed) in place of
    any seed override, so each configuration runs N times; None when N is 1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

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
    seeds = [o for o in OverridesParser.create().parse_overrides(args.overrides) if o.key_or_group == "seed"]
    if any(o.is_sweep_override() for o in seeds):
        raise UsageError(f"seed is swept and sweep.seeds={n} is set; give the seeds one way: seed=0,1,2 or "
                         "sweep.seeds=3")
    drop = {o.input_line for o in seeds}
    first = jobs[0].seed
    return [a for a in argv if a not in drop] + ["seed=" + ",".join(str(first + i) for i in range(n))]


def _launcher_overrides(jobs: list, overrides: List[str]) -> List[str]:
    """Settings a sweeper or launcher needs from the run config: the Optuna sweeper's direction from
    sweep.direction, and with the joblib launcher hardware.threads so that the members running at
    once share the cores (when the user did not set it; said in one line)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from rlnotes.run.sweep import objective_metric
    from rlnotes.runners import algorithm

    cfg, extra = jobs[0], []
    given = {o.key_or_group: o for o in OverridesParser.create().parse_overrides(overrides)}
    if cfg.hydra.sweeper._target_.endswith("OptunaSweeper"):
        senses = {objective_metric(job, algorithm(job.algo.name)) for job in jobs}
        if len({sense for _, sense in senses}) > 1:
            ways = ", ".join(f"{metric}: {sense}" for metric, sense in sorted(senses))
            raise UsageError(f"the members' objectives go different ways ({ways}); set sweep.objective (or "
                             "sweep.direction) so that one direction fits all")
        sense = senses.pop()[1]
        if "hydra.sweeper.direction" in given:
            if str(cfg.hydra.sweeper.direction).split(".")[-1] != sense:
                raise UsageError(f"hydra.sweeper.direction={cfg.hydra.sweeper.direction} disagrees with the "
                                 f"objective's direction ({sense}); set sweep.direction instead (the sweeper "
                                 "follows it)")
        else:
            extra.append(f"hydra.sweeper.direction={sense}")
    if cfg.hydra.launcher._target_.endswith("JoblibLauncher") and all(job.hardware.threads is None for job in jobs):
        cores, n_jobs = _cores(), cfg.hydra.launcher.n_jobs
        at_once = cores + 1 + n_jobs if n_jobs < 0 else n_jobs  # joblib's -1: every core
        batch = cfg.hydra.sweeper.n_jobs if "n_jobs" in cfg.hydra.sweeper else len(jobs)
        at_once = max(1, min(at_once, batch))
        threads = max(1, cores // at_once)
        print(f"rlnotes: {at_once} members at a time (hydra/launcher=joblib), {threads} thread{'s' * (threads > 1)} "
              f"each on {cores} cores (hardware.threads={threads}; set it to choose)", file=sys.stderr, flush=True)
        extra.append(f"hardware.threads={threads}")
    return extra


def _train(argv: List[str]) -> int:
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    informational = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    if not informational:
        jobs = check(args.overrides, args.multirun, args.config_dir)
        seeded = _with_seeds(argv, args, jobs)
        if seeded is not None:
            argv, args = seeded, get_args_parser().parse_args(seeded)
            jobs = check(args.overrides, args.multirun, args.config_dir)
        argv = [*argv, *_launcher_overrides(jobs, args.overrides)]
        nproc = _processes(jobs)
        if "WORLD_SIZE" in os.environ:  # a process torchrun started (ours or the user's)
            from rlnotes.core.errors import ConfigError

            try:
                argv = [*argv, *_rank_overrides(jobs)]
            except ConfigError as e:
                raise UsageError(str(e)) from None
        elif nproc > 1 and _in_process(jobs[0]):  # other launchers start torchrun in each member
            return _launch(nproc, argv)
        else:
            argv = [*argv, *pin_dirs(jobs, datetime.now())]
        if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 owns the run dir
            argv = [*argv, *claim_run_dirs(jobs, args.multirun, datetime.now())]

    import hydra

    from rlnotes.commands.validate import register
    from rlnotes.run.sweep import SweepSummary

    register()
    SweepSummary.failed = []
    sys.argv = ["rlnotes train", *argv]
    hydra.main(version_base="1.3", config_path="pkg://rlnotes.conf", config_name="config")(train_job)()
    return 1 if SweepSummary.failed else 0  # every member ran; the summary names those that failed


def train_job(cfg) -> Optional[float]:
    """One run: the task function Hydra calls, once or for each member of a sweep. At module level,
    so launchers that run members in other processes (joblib, submitit) pickle it by reference.
    Returns the run's objective (sweep.objective) to the sweeper. In a sweep a member that fails
    returns None and leaves its error in RUN_DIR/result.json, so the sweep goes on and its summary
    shows the failure. None because Hydra's optuna sweeper (1.3) records a value it cannot convert
    to float as a failed trial and goes on, whereas NaN crashes it (it tells Optuna the failed
    trial's value, which Optuna refuses) and so does an exception (unless
    hydra.sweeper.max_failure_rate allows it; Hydra's basic sweeper has no such setting)."""
    import logging

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from rich.console import Console
    from rich.markup import escape

    from rlnotes.commands.validate import resolve_auto
    from rlnotes.core.errors import ConfigError
    from rlnotes.engine import distributed
    from rlnotes.rewards.scoring import RewardFailure
    from rlnotes.run.signals import resume_command
    from rlnotes.run.sweep import (
        METRICS_FILE,
        objective_metric,
        objective_value,
        read_metrics,
        write_result,
    )
    from rlnotes.training.loop import SaveFailed, TrainingError, train

    # A message is one line, however narrow the screen; with several processes rank 0 speaks.
    console = Console(stderr=True, soft_wrap=True, quiet=not distributed.is_main())
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    member = HydraConfig.get().mode == RunMode.MULTIRUN
    algo = resolve_auto(cfg)
    objective = objective_metric(cfg, algo)
    try:
        if member and (cfg.hardware.nproc or 1) > 1 and "WORLD_SIZE" not in os.environ:
            _member_torchrun(cfg.hardware.nproc, run_dir)
        else:
            train(cfg, algo, run_dir, console)
    except (TrainingError, ConfigError, RewardFailure) as e:
        console.print(f"[red]rlnotes: error:[/] {escape(str(e))}")
        if not isinstance(e, (ConfigError, SaveFailed)):  # a setting is fixed anew; SaveFailed says how
            _resume_hint(console, run_dir)
        if not member:
            sys.exit(1)
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
        metrics = run_dir / METRICS_FILE
        value = objective_value(read_metrics(metrics) if metrics.exists() else [], objective[0], cfg.sweep.last_steps)
        if value is not None:
            if distributed.is_main():
                write_result(run_dir, "completed", objective, value)
            return value
        error = f"sweep.objective={objective[0]} was not logged by this run; choose a metric of its metrics.jsonl"
    if distributed.is_main():
        write_result(run_dir, "failed", objective, None, error)
    return None


def _member_torchrun(nproc: int, run_dir: Path) -> None:
    """hardware.nproc=N in a sweep member that a launcher runs in its own process (joblib, submitit):
    the member starts torchrun with N processes for a single run of its overrides in its run dir."""
    import subprocess

    from hydra.core.hydra_config import HydraConfig

    from rlnotes.training.loop import TrainingError

    quoted = "'" + str(run_dir).replace("'", "\\'") + "'"
    command = torchrun_command(nproc, [*HydraConfig.get().overrides.task, f"hydra.run.dir={quoted}"])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, _cores() // nproc))))
    code = subprocess.run(command, env=env).returncode
    if code:
        raise TrainingError(f"torchrun with {nproc} processes exited with status {code}; see the logs in {run_dir}")


def _eval(argv: List[str]) -> int:
    """`rlnotes eval [overrides]`: evaluate the base model or eval.policy on the task's eval split."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    check(args.overrides, False, args.config_dir)

    from omegaconf import open_dict
    from rich.console import Console
    from rich.table import Table

    from rlnotes.commands.validate import resolve_auto, validate
    from rlnotes.core.errors import ConfigError
    from rlnotes.rewards.scoring import RewardFailure
    from rlnotes.training.evaluation import run, with_run_settings

    console = Console(stderr=True, soft_wrap=True)  # a message is one line, however narrow the screen
    cfg = _loader(args.config_dir).load_configuration("config", args.overrides, _run_mode())
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        cfg = with_run_settings(cfg, args.overrides)
        resolve_auto(cfg)
        validate(cfg)
        evaluation, out = run(cfg, console)
    except (ConfigError, RewardFailure) as e:
        console.print(f"[red]rlnotes: error:[/] {e}")
        return 1
    table = Table(title=f"{cfg.eval.policy or cfg.model.name_or_path} on {cfg.data.path or cfg.data.name} "
                        f"({len(evaluation.samples)} completions)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in evaluation.metrics.items():
        table.add_row(key, f"{value:.4g}")
    Console().print(table)
    console.print(f"eval.jsonl and samples.jsonl written to {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one UsageError line, like every other rlnotes error."""

    def error(self, message: str):
        raise UsageError(f"{message}; usage: {' '.join(self.format_usage().split()[1:])}")


def _plot(argv: List[str]) -> int:
    parser = _Parser(prog="rlnotes plot", description="PNG figures of runs overlaid (reward, eval accuracy, KL, "
                     "loss, length; DPO margin and accuracy) and a table of their final metrics.")
    parser.add_argument("paths", nargs="+", metavar="DIR", help="run dirs (with metrics.jsonl) or multirun sweep dirs")
    parser.add_argument("--out", help="where the PNGs go (default: the one run or sweep dir given, the sweep dir the "
                        "runs share, or a plot-... dir beside the first one)")
    parser.add_argument("--sort", metavar="METRIC", help="sort the table by this metric's final value, best first "
                        "(default: reward/mean or the first key metric logged)")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="W",
                        help="exponential smoothing weight in [0, 1) for dense curves (default 0: none)")
    args = parser.parse_args(argv)
    if not 0 <= args.smooth < 1:
        raise UsageError(f"--smooth {args.smooth} must be in [0, 1)")
    from rlnotes.commands.plot import plot
    from rlnotes.run.sweep import RunError, stdout_console

    console = stdout_console()
    try:
        result = plot(args.paths, args.out, args.sort, args.smooth, console)
    except RunError as e:
        raise UsageError(str(e)) from None
    console.print(f"figures: {', '.join(str(f) for f in result.figures + result.written)}")
    return 0


def _export(argv: List[str]) -> int:
    parser = _Parser(prog="rlnotes export", description="Merge a trained LoRA adapter into its base model (or "
                     "copy a fully fine-tuned one) and save a standard Hugging Face model dir.")
    parser.add_argument("policy", metavar="POLICY_DIR", help="RUN_DIR/final, RUN_DIR/interrupted or a checkpoint dir")
    parser.add_argument("out", metavar="OUT_DIR", help="new (or empty) dir for the model, tokenizer and config")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (default float32)")
    args = parser.parse_args(argv)
    from rich.console import Console

    from rlnotes.commands.export import export
    from rlnotes.core.errors import ConfigError

    try:
        export(args.policy, args.out, args.dtype, Console(stderr=True))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return 0


COMMANDS = {"train": _train, "eval": _eval, "plot": _plot, "export": _export}


def main(argv: Optional[List[str]] = None) -> int:
    _environment()
    from rlnotes.run.logger import quiet_libraries

    quiet_libraries()  # deprecation notices and advice from the libraries below us mean nothing to a user
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rlnotes: error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except UsageError as e:
        print(f"rlnotes: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from rlnotes.core.errors import Interrupted

        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops; rank 0 says so
            print(f"rlnotes: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum  # as a shell reports it: 130 for SIGINT, 143 for SIGTERM


if __name__ == "__main__":
    sys.exit(main())
