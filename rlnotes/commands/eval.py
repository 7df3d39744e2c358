"""`rlnotes eval [overrides]`: evaluate the base model, or a trained policy (eval.policy: a run's
final/ dir or a checkpoint), on the task's eval split; the metrics are printed as a table and
written with every completion to a dir of the evaluation's own (eval.out, or a new
outputs/eval/<time>).

A trained policy is evaluated as its run trained it: its model, data, rollout and reward settings
(RUN_SETTINGS) come from that run's config, unless the command line sets them. Two boundaries
keep a run someone else shared (or downloaded) from acting on this machine: the code its config
names (reward functions, tools, an environment, a tool-call parser: `run_code`) is imported only
with eval.trust_run_code=true, and nothing is ever written into its dir. An evaluation's dir is
claimed before anything loads (`claim_out`): it must be new or empty and outside every run, so an
evaluation never overwrites a run's files or another evaluation's, and an unwritable one fails
at once.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from omegaconf import OmegaConf, open_dict
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlnotes.agents.builtin import ENVIRONMENTS, TOOLS
from rlnotes.agents.environments import EnvironmentFailure
from rlnotes.agents.routing import environment_names
from rlnotes.agents.tools import FORMATS
from rlnotes.commands import hydra
from rlnotes.commands.check import check
from rlnotes.core.errors import INPUT_ERROR, ConfigError
from rlnotes.core.schema import saved_run_config
from rlnotes.data.datasets import load_checked
from rlnotes.data.fitting import evaluates, seen_in_training
from rlnotes.engine.hardware.devices import configure_backends, mixed_precision, resolve_device
from rlnotes.engine.hardware.threads import set_threads
from rlnotes.engine.model.loading import context_length, load_base
from rlnotes.engine.policy.policy import Policy
from rlnotes.rewards.builtin import REWARDS
from rlnotes.rewards.scoring import RewardFailure, Rewards, TrainerState
from rlnotes.run import config_file, files, rundir
from rlnotes.run.display import stdout_console
from rlnotes.training.evaluation import (
    Evaluation,
    checker_config,
    eval_data,
    eval_rows,
    evaluate,
)
from rlnotes.training.setup import set_precision

# What `rlnotes eval` takes from the run that trained eval.policy: its model (chat template and
# system prompt included), data (file, columns, template), rollout settings and reward functions,
# and the eval split and checker its trainer.eval_every used.
RUN_SETTINGS = ("model", "data", "rollout", "reward", "eval.data", "eval.reward")


HELP = """rlnotes eval: greedy accuracy (or pass@k) of a model or a trained policy on held-out prompts.

Usage: rlnotes eval [group=option ...] [key=value ...]

  rlnotes eval model=smollm2-135m data=arith          the base model on a task's eval split
  rlnotes eval eval.policy=RUN_DIR/final               a trained policy, with its run's model, data,
                                                       rollout (tools, environment) and reward settings
  eval.size=N  eval.greedy=false eval.samples_per_prompt=K  eval.data={digits: 2}  eval.reward=FN
  eval.trust_run_code=true                             import the code the policy's run names (its own
                                                       reward functions, tools, environment): trusted runs only

Writes config.yaml, eval.jsonl and samples.jsonl (one line per completion or episode) to eval.out, a
new or empty dir outside any run; by default a new outputs/eval/<time>. The keys are those of
`rlnotes train` (rlnotes train --help)."""


def main(argv: List[str]) -> int:
    """`rlnotes eval [overrides]`: evaluate the base model or eval.policy on the task's eval split."""
    if any(a in ("-h", "--help") for a in argv):
        print(HELP)
        return 0
    args = hydra.parse_args(argv)
    # Checked as the policy's run completes it: a run on data=file takes data.eval_path, its reward is set.
    cfg = check(args.overrides, False, args.config_dir, settle=lambda c: with_run_settings(c, args.overrides),
                config_name=args.config_name)[0]
    console = Console(stderr=True, soft_wrap=True)  # a message is one line, however narrow the screen
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        evaluation, out = run(cfg, console)
    except (ConfigError, RewardFailure, EnvironmentFailure) as e:
        console.print(f"[red]rlnotes: error:[/] {e}")
        return INPUT_ERROR if isinstance(e, ConfigError) else 1  # the user's input, as for a usage error
    show(cfg, evaluation)
    console.print(f"config.yaml, eval.jsonl and samples.jsonl written to {out}")
    return 0


def show(cfg, evaluation: Evaluation) -> None:
    """What was evaluated on which rows, then the metrics as a table, on stdout. The first is a line of
    its own (a table's title wraps at the table's width) and stdout is wide when piped
    (stdout_console): its paths stay whole in a log file or CI output, where grep finds them."""
    console = stdout_console()
    what, rows = cfg.eval.policy or cfg.model.name_or_path, cfg.data.eval_path or cfg.data.path or cfg.data.name
    console.print(f"{what} on {rows} ({len(evaluation.samples)} completions)", soft_wrap=True, highlight=False,
                  markup=False)
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in evaluation.metrics.items():
        table.add_row(key, f"{value:.4g}")
    console.print(table)


def with_run_settings(cfg, overrides: List[str]):
    """`cfg` with the RUN_SETTINGS of the run that trained eval.policy: for each that the command line
    does not choose itself (`data=...`, `eval.reward=...`), the run's values with the command line's
    dotted overrides (`data.digits=2`) on top. The code the run names is refused unless
    eval.trust_run_code (`check_trust`)."""
    if not cfg.eval.policy:
        return cfg
    trained = saved_run_config(cfg.eval.policy)
    if trained is None:
        return cfg
    parsed = hydra.parse_overrides(overrides)
    with open_dict(cfg):
        for group in RUN_SETTINGS:
            theirs = OmegaConf.select(trained, group, default=None)
            if theirs is None or any(o.key_or_group == group for o in parsed):
                continue
            merged = OmegaConf.merge(OmegaConf.select(cfg, group), theirs) if OmegaConf.is_config(theirs) else theirs
            for o in parsed:
                if o.key_or_group.startswith(group + "."):
                    OmegaConf.update(merged, o.key_or_group[len(group) + 1:], o.value(), merge=True)
            OmegaConf.update(cfg, group, merged, merge=False)
    check_trust(cfg, trained, [o.key_or_group for o in parsed])
    return cfg


def run_code(cfg) -> Dict[str, str]:
    """The settings of `cfg` (any config: a run's config.yaml too) that name code to import rather
    than a built-in: reward functions, tools, environments, a tool-call parser. {key: value}."""
    at = lambda key: OmegaConf.select(cfg, key, default=None)  # noqa: E731
    named = {f"reward.functions.{i}.fn": f.get("fn") for i, f in enumerate(at("reward.functions") or [])}
    named.update({"reward.target": at("reward.target"), "eval.reward": at("eval.reward"),
                  "rollout.tool_format": at("rollout.tool_format")})
    named.update({f"rollout.tools.{i}": tool for i, tool in enumerate(at("rollout.tools") or [])})
    env, names = at("rollout.env"), environment_names(at("rollout.env"))  # one environment, or a mapping
    named.update({f"rollout.env.{name}": env[name] for name in names} if names else {"rollout.env": env})
    builtin = {**REWARDS, **TOOLS, **ENVIRONMENTS, **dict.fromkeys(FORMATS)}
    return {key: str(value) for key, value in named.items() if value is not None and value not in builtin}


def check_trust(cfg, trained, given: List[str]) -> None:
    """Refuse, unless eval.trust_run_code, to import code that eval.policy's run config names and the
    command line does not (`given`: the keys and groups it sets): evaluating a run must not run code
    that whoever wrote its dir chose. Raises ConfigError naming that code."""
    if cfg.eval.trust_run_code:
        return
    named_here = lambda key: any(key == g or key.startswith(g + ".") for g in given)  # noqa: E731
    theirs = {key: value for key, value in run_code(cfg).items()
              if OmegaConf.select(trained, key, default=None) == value and not named_here(key)}
    if theirs:
        listed = ", ".join(f"{key}={value}" for key, value in theirs.items())
        raise ConfigError(f"eval.policy={cfg.eval.policy}: its run's config.yaml names code that this evaluation would "
                          f"import and run ({listed}); add eval.trust_run_code=true if you trust that run, or set "
                          "your own on the command line (eval.reward=..., reward=..., rollout.env=...)")


def run(cfg, console) -> Tuple[Evaluation, Path]:
    """Claim the output dir, load the policy, evaluate it on the task's eval split, write the results;
    when the eval rows are rows the policy trained on, a line that says so (`seen_note`) goes on the
    console and into eval.jsonl as its "note"."""
    out, made = claim_out(cfg.eval.out)
    try:
        evaluation = _evaluate(cfg, console, out)
        note = seen_note(cfg)
        if note is not None:
            console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
        files.write_text(out / "samples.jsonl", "".join(json.dumps(s, default=str) + "\n" for s in evaluation.samples))
        files.write_text(out / "eval.jsonl", json.dumps({"step": 0, **evaluation.metrics,
                                                          **({"note": note} if note else {})}) + "\n")
    except BaseException as e:
        _unclaim(out, made)
        if isinstance(e, OSError) and e.errno in (*files.FULL, errno.EACCES, errno.EROFS, errno.EPERM):
            raise ConfigError(f"eval.out={out}: {e.strerror} while writing the results; free space or choose another "
                              "dir (eval.out=DIR)") from None
        raise
    return evaluation, out


def seen_note(cfg) -> Optional[str]:
    """A line for eval rows that eval.policy's run trained on (rlnotes.data.fitting.seen_in_training: a
    run on a file or hub split that held none of its rows out, evaluated on rows held out of them
    now), with how to get held-out figures; None otherwise."""
    trained = saved_run_config(cfg.eval.policy) if cfg.eval.policy else None
    if trained is None or "data" not in trained:
        return None
    d = eval_data(cfg)
    if not seen_in_training(trained.data, evaluates(trained), d):
        return None
    source = d.path if d.source == "file" else d.name
    return (f"the policy's run trained on every row of {source} (it held none out), these eval rows included, so "
            "these scores are not held-out figures; evaluate on rows it never saw (data.eval_path=FILE), or hold "
            "rows out when training (data.eval_size=N, or data.eval_path=FILE)")


def _evaluate(cfg, console, out: Path) -> Evaluation:
    device = resolve_device(cfg.hardware.device)
    configure_backends(cfg.hardware, device)
    scorer = Rewards(checker_config(cfg), console)
    scorer.state = TrainerState(max_steps=cfg.trainer.steps)   # a reward may divide by max_steps
    # Rows to sample from, and the columns a checker needs: a mistake fails now, before the model loads.
    load_checked(eval_data(cfg), None, scorer.fns, generating="evaluation",
                 environments=environment_names(cfg.rollout.env))
    config_file.write(out / "config.yaml", cfg)
    policy = _policy(cfg, device)
    policy.model.requires_grad_(False)  # nothing trains: in bf16 every linear weight is stored in it
    threads = set_threads(cfg.hardware.threads, policy.model)
    precision, said = set_precision(cfg.hardware, device, policy)
    for line in (threads, said):
        if line:
            console.print(line, highlight=False)
    rows = eval_rows(cfg, policy.tokenizer, context_length(policy.model), console)
    start = time.perf_counter()
    with mixed_precision(precision, device):
        evaluation = evaluate(policy, cfg, rows, scorer)
    evaluation.metrics["time/eval_s"] = time.perf_counter() - start
    return evaluation


def claim_out(given: Optional[str]) -> Tuple[Path, bool]:
    """The evaluation's own dir, and whether this call made it: eval.out (a new or empty dir outside
    every run, saved policy and checkpoint), else a new outputs/eval/<time>. Claimed before anything
    loads by an empty eval.jsonl made there exclusively, so that an unwritable dir fails at once and
    a second evaluation into it (even one started at the same time) is refused. The default is made
    exclusively too, with -1, -2, ... added to a time another evaluation took."""
    if given is None:
        return _new_out(Path("outputs") / "eval" / time.strftime("%Y-%m-%d_%H-%M-%S")), True
    out = Path(given)
    _check_out(out)
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        os.close(os.open(out / "eval.jsonl", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
    except FileExistsError:
        raise ConfigError(f"eval.out={out} was taken by another evaluation meanwhile; choose another dir "
                          "(eval.out=DIR), or leave eval.out unset for a new one") from None
    except OSError as e:
        raise ConfigError(f"eval.out={out} cannot be written ({e.strerror}); choose a dir you can write "
                          "(eval.out=DIR)") from None
    return out, made


def _new_out(stamp: Path) -> Path:
    """A new dir named `stamp` (or stamp-1, stamp-2, ... when taken), made by this call, with the empty
    eval.jsonl that claims it; the working dir must not lie inside a run (the default is relative)."""
    problem = rundir.enclosing(stamp) or _in_run(stamp)
    if problem:
        raise ConfigError(f"eval.out: {problem}; an evaluation never writes into a run's dir: choose a dir outside "
                          "it (eval.out=DIR), or run rlnotes eval from another dir")
    out, n = stamp, 1
    while True:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.mkdir()
            break
        except FileExistsError:
            out, n = stamp.with_name(f"{stamp.name}-{n}"), n + 1
        except OSError as e:
            raise ConfigError(f"eval.out={out} cannot be written ({e.strerror}); choose a dir you can write "
                              "(eval.out=DIR)") from None
    (out / "eval.jsonl").touch()
    return out


def _check_out(out: Path) -> None:
    """Refuse an eval.out that is not a new or empty dir, or lies in a run, a policy or a checkpoint."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"eval.out={out} is a file; choose a new or empty dir (eval.out=DIR)")
    if out.is_dir() and any(out.iterdir()):
        kind = rundir.contents(out)
        what = {"run": "holds a run", "evaluation": "holds another evaluation", "checkpoint": "is a checkpoint",
                "policy": "is a saved policy"}.get(kind, "is not empty")
        raise ConfigError(f"eval.out={out} {what}; an evaluation writes only into a new or empty dir: choose another "
                          "(eval.out=DIR), or leave eval.out unset for a new outputs/eval/<time>")
    problem = rundir.enclosing(out) or _in_run(out)
    if problem:
        raise ConfigError(f"eval.out: {problem}; an evaluation never writes into a run's dir: choose a dir outside it "
                          "(eval.out=DIR)")
    if not rundir.writable(out):
        raise ConfigError(f"eval.out={out} is not writable by this user; choose a dir you can write (eval.out=DIR)")


def _in_run(out: Path) -> Optional[str]:
    """Why `out` may not be written: it lies inside a run's dir; None when it does not."""
    path = Path(os.path.abspath(out))
    run = next((p for p in path.parents if rundir.contents(p) == "run"), None)
    return f"{out} is inside the run dir {run}" if run is not None else None


def _unclaim(out: Path, made: bool) -> None:
    """Remove what this evaluation wrote into `out` (the dir too when it made it), after a failure."""
    for name in ("eval.jsonl", "samples.jsonl", "config.yaml"):
        (out / name).unlink(missing_ok=True)
    if made:
        shutil.rmtree(out, ignore_errors=True)


def _policy(cfg, device) -> Policy:
    """The policy eval.policy names (else the base model). A checkpoint that disappears while it
    loads (its run's trainer.keep_last pruned it) is one line naming a newer one to evaluate."""
    if not cfg.eval.policy:
        base, tokenizer = load_base(cfg.model)
        return Policy(base.to(device).eval(), tokenizer, reference=base)
    path = Path(cfg.eval.policy)
    if not path.is_dir():
        raise ConfigError(f"eval.policy={cfg.eval.policy!r} is not a directory; pass a run's final/ dir or a "
                          "checkpoint dir")
    try:
        return Policy.from_saved(cfg.model, path, device)
    except Exception:  # noqa: BLE001 - whatever the loader says, a vanished dir is the cause
        if path.is_dir() and all((path / name).exists() for name in _files_of(path)):
            raise
        raise ConfigError(f"eval.policy={path} was removed while it loaded (its run's trainer.keep_last prunes "
                          "older checkpoints as it saves new ones); evaluate a newer checkpoint, or its run's final/ "
                          "once it finishes") from None


def _files_of(path: Path) -> List[str]:
    """The files a checkpoint's manifest lists, or none for a dir without one."""
    try:
        return list(json.loads((path / "manifest.json").read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
