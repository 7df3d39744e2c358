"""`rlnotes eval [overrides]`: evaluate the base model, or a trained policy (eval.policy: a run's
final/ dir or a checkpoint), on the task's eval split; the metrics are printed as a table and
written with every completion to the policy's eval/ dir (or eval.out).

A trained policy is evaluated as its run trained it: its model, data, rollout and reward settings
(RUN_SETTINGS) come from that run's config, unless the command line sets them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Tuple

from omegaconf import OmegaConf, open_dict
from rich.console import Console
from rich.table import Table

from rlnotes.agents.environments import EnvironmentFailure
from rlnotes.commands import hydra
from rlnotes.commands.check import check
from rlnotes.core.errors import INPUT_ERROR, ConfigError
from rlnotes.core.schema import saved_run_config
from rlnotes.data.datasets import load_checked
from rlnotes.data.fitting import max_positions
from rlnotes.engine.models import (
    configure_backends,
    load_base,
    mixed_precision,
    resolve_device,
)
from rlnotes.engine.policy import Policy
from rlnotes.engine.threads import set_threads
from rlnotes.rewards.scoring import RewardFailure, Rewards, TrainerState
from rlnotes.run import config_file
from rlnotes.training.evaluation import (
    Evaluation,
    checker_config,
    eval_data,
    eval_rows,
    evaluate,
    write,
)

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

Writes eval.jsonl and samples.jsonl (one line per completion or episode) to eval.out: by default
RUN_DIR/eval/<policy name> for a policy, outputs/eval/<time> for a base model. The keys are those
of `rlnotes train` (rlnotes train --help)."""


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
    table = Table(title=f"{cfg.eval.policy or cfg.model.name_or_path} on "
                        f"{cfg.data.eval_path or cfg.data.path or cfg.data.name} "
                        f"({len(evaluation.samples)} completions)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in evaluation.metrics.items():
        table.add_row(key, f"{value:.4g}")
    Console().print(table)
    console.print(f"eval.jsonl and samples.jsonl written to {out}")
    return 0


def with_run_settings(cfg, overrides: List[str]):
    """`cfg` with the RUN_SETTINGS of the run that trained eval.policy: for each that the command line
    does not choose itself (`data=...`, `eval.reward=...`), the run's values with the command line's
    dotted overrides (`data.digits=2`) on top."""
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
    return cfg


def run(cfg, console) -> Tuple[Evaluation, Path]:
    """Load the policy, evaluate it on the task's eval split, write the results."""
    device = resolve_device(cfg.hardware.device)
    configure_backends(cfg.hardware, device)
    scorer = Rewards(checker_config(cfg), console)
    scorer.state = TrainerState(max_steps=cfg.trainer.steps)   # a reward may divide by max_steps
    # Rows to sample from, and the columns a checker needs: a mistake fails now, before the model loads.
    load_checked(eval_data(cfg), None, scorer.fns, generating="evaluation")
    policy, out = _policy(cfg, device)
    threads = set_threads(cfg.hardware.threads, policy.model)
    if threads:
        console.print(threads, highlight=False)
    rows = eval_rows(cfg, policy.tokenizer, max_positions(policy.model), console)
    start = time.perf_counter()
    with mixed_precision(cfg.hardware.precision, device):
        evaluation = evaluate(policy, cfg, rows, scorer)
    evaluation.metrics["time/eval_s"] = time.perf_counter() - start
    if (out / "eval.jsonl").exists():
        (out / "eval.jsonl").unlink()
    write(evaluation, out, 0, samples_name="samples.jsonl")
    config_file.write(out / "config.yaml", cfg)
    return evaluation, out


def _policy(cfg, device) -> Tuple[Policy, Path]:
    """The policy eval.policy names (else the base model) and the dir its results go to."""
    if not cfg.eval.policy:
        base, tokenizer = load_base(cfg.model)
        out = Path(cfg.eval.out) if cfg.eval.out else Path("outputs") / "eval" / time.strftime("%Y-%m-%d_%H-%M-%S")
        return Policy(base.to(device).eval(), tokenizer, reference=base), out
    path = Path(cfg.eval.policy)
    if not path.is_dir():
        raise ConfigError(f"eval.policy={cfg.eval.policy!r} is not a directory; pass a run's final/ dir or a "
                          "checkpoint dir")
    out = Path(cfg.eval.out) if cfg.eval.out else path.parent / "eval" / path.name
    return Policy.from_saved(cfg.model, path, device), out
