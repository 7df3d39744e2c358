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

    from rlnotes.config import register

    register()
    search = create_automatic_config_search_path(None, None, f"pkg://{CONFIG_MODULE}")
    if config_dir:
        search.prepend("command-line", f"file://{os.path.abspath(config_dir)}")
    return ConfigLoaderImpl(config_search_path=search)


def _members(overrides: List[str], multirun: bool) -> List[List[str]]:
    """The override lists of every job the command would run (one unless it is a sweep)."""
    if not multirun:
        return [overrides]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _explain(exc: BaseException, loader, overrides: List[str]) -> str:
    """One line for a composition error: what was wrong and what is accepted."""
    import re

    from omegaconf import OmegaConf

    from rlnotes.config import ConfigError

    if isinstance(exc, ConfigError):
        return str(exc)
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    full = f"{text}\n{cause}" if cause else text
    missing = re.search(r"Could not (?:find|load) '([^']+)/([^']+)'", full)  # load: an option in a list
    if missing:
        group, option = missing.groups()
        options = loader.get_group_options(group)
        return f"{group}={option} is not an option; choose one of: {', '.join(options)}"
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

    from rlnotes.config import ConfigError, resolve_auto, validate

    loader = _loader(config_dir)
    jobs = []
    for job in _members(overrides, multirun):
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
    from rlnotes import rundir
    from rlnotes.config import ConfigError

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
    from rlnotes import distributed
    from rlnotes.models import resolve_device

    distributed.init(resolve_device(jobs[0].hardware.device))
    extra = pin_dirs(jobs, distributed.agreed_now())
    if not distributed.is_main():
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                  "~hydra.callbacks.sweep_summary"]
    return extra


def _resume_hint(console, run_dir: Path) -> None:
    """How to go on from a run that stopped on an error, when it has a checkpoint to go on from."""
    from rich.markup import escape

    from rlnotes.checkpoint import checkpoints, resume_command

    if checkpoints(run_dir):
        console.print(f"[yellow]after a fix, resume with:[/]\n  {escape(resume_command(run_dir))}", highlight=False)


def _train(argv: List[str]) -> int:
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    informational = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    if not informational:
        jobs = check(args.overrides, args.multirun, args.config_dir)
        nproc = _processes(jobs)
        if "WORLD_SIZE" in os.environ:  # a process torchrun started (ours or the user's)
            from rlnotes.config import ConfigError

            try:
                argv = [*argv, *_rank_overrides(jobs)]
            except ConfigError as e:
                raise UsageError(str(e)) from None
        elif nproc > 1:
            return _launch(nproc, argv)
        else:
            argv = [*argv, *pin_dirs(jobs, datetime.now())]
        if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 owns the run dir
            argv = [*argv, *claim_run_dirs(jobs, args.multirun, datetime.now())]

    import hydra

    from rlnotes.config import register

    register()

    @hydra.main(version_base="1.3", config_path="pkg://rlnotes.conf", config_name="config")
    def train_job(cfg) -> Optional[float]:
        from hydra.core.hydra_config import HydraConfig
        from rich.console import Console
        from rich.markup import escape

        from rlnotes import distributed
        from rlnotes.checkpoint import resume_command
        from rlnotes.config import ConfigError, resolve_auto
        from rlnotes.rewards import RewardFailure
        from rlnotes.runners.common import SaveFailed, TrainingError, train

        # A message is one line, however narrow the screen; with several processes rank 0 speaks.
        console = Console(stderr=True, soft_wrap=True, quiet=not distributed.is_main())
        resolve_auto(cfg)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            metrics = train(cfg, run_dir, console)
        except (TrainingError, ConfigError, RewardFailure) as e:
            console.print(f"[red]rlnotes: error:[/] {escape(str(e))}")
            if not isinstance(e, (ConfigError, SaveFailed)):  # a setting is fixed anew; SaveFailed says how
                _resume_hint(console, run_dir)
            sys.exit(1)
        except Exception:  # a bug: Hydra shows the traceback after this line
            _resume_hint(console, run_dir)
            raise
        except KeyboardInterrupt:  # however it stopped (loading, a step, a save, a sweep member): how to go on
            console.print(f"[yellow]resume with:[/]\n  {escape(resume_command(run_dir))}", highlight=False)
            raise
        return metrics.get("reward/mean")

    sys.argv = ["rlnotes train", *argv]
    train_job()
    return 0


def _eval(argv: List[str]) -> int:
    """`rlnotes eval [overrides]`: evaluate the base model or eval.policy on the task's eval split."""
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    check(args.overrides, False, args.config_dir)

    from omegaconf import open_dict
    from rich.console import Console
    from rich.table import Table

    from rlnotes.config import ConfigError, resolve_auto, validate
    from rlnotes.evaluate import run, with_run_settings
    from rlnotes.rewards import RewardFailure

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
    from rlnotes.plot import plot
    from rlnotes.sweep import RunError, stdout_console

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

    from rlnotes.config import ConfigError
    from rlnotes.export import export

    try:
        export(args.policy, args.out, args.dtype, Console(stderr=True))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return 0


COMMANDS = {"train": _train, "eval": _eval, "plot": _plot, "export": _export}


def main(argv: Optional[List[str]] = None) -> int:
    _environment()
    from rlnotes.logger import quiet_libraries

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
        from rlnotes.config import Interrupted

        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops; rank 0 says so
            print(f"rlnotes: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum  # as a shell reports it: 130 for SIGINT, 143 for SIGTERM


if __name__ == "__main__":
    sys.exit(main())
