"""Evaluation of a policy on a task's held-out prompts: accuracy, mean reward, completion length.

Used two ways: `rlnotes eval` (the base model, a run's final/ or a checkpoint) and every
`trainer.eval_every` steps during training. Greedy by default, one completion per prompt; with
`eval.greedy=false` it samples n completions per prompt and reports the unbiased pass@k of
Chen et al. (2021),

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ],   c = correct completions out of n,

for k = 1 and k = n. A completion counts as correct when the checker gives it at least 1.0
(the built-in checkers give 1.0 or 0.0). Evaluation never touches the training RNG: greedy needs
none and sampling uses its own generator seeded from (seed, step).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import torch
from omegaconf import OmegaConf, open_dict

from rlnotes.agents.multi_turn import Conversations, MultiTurn
from rlnotes.agents.routing import environment_names
from rlnotes.data.datasets import load_checked
from rlnotes.data.fitting import fit_and_split
from rlnotes.data.settings import prompt_format
from rlnotes.data.tasks import TASK_REWARDS
from rlnotes.engine.hardware import distributed, fsdp
from rlnotes.engine.prompts import PromptFormat
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.generate import generate
from rlnotes.engine.sampling.settings import SamplingSettings
from rlnotes.run import files

if TYPE_CHECKING:
    from rlnotes.training.context import Data, Run


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k completions drawn without replacement from n, of which
    c are correct, is correct: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_data(cfg):
    """The data config of the eval split: `data` with `eval.data` merged over it."""
    return OmegaConf.merge(cfg.data, cfg.eval.data) if cfg.eval.data else cfg.data


def eval_rows(cfg, tokenizer, limit: Optional[int], console=None) -> List[dict]:
    """The eval split: the training data's, or that of `data` + `eval.data` when eval.data is set."""
    names = environment_names(cfg.rollout.env)  # each row's environment, where rows choose one
    if not cfg.eval.data:
        data = load_checked(cfg.data, None, generating="evaluation", environments=names)
        return fit_and_split(data, cfg, tokenizer, limit, console, evaluating=True, training=False)[1]
    other = cfg.copy()
    with open_dict(other):
        other.data = eval_data(cfg)
    rows = fit_and_split(load_checked(other.data, None, generating="evaluation", environments=names), other,
                         tokenizer, limit, evaluating=True, training=False)[1]
    if console is not None:
        console.print(f"eval: {len(rows)} rows of data + eval.data {OmegaConf.to_container(cfg.eval.data)}")
    return rows


def checker_config(cfg):
    """The reward config that scores evaluation: `eval.reward`, else the task's own checker, else
    the training reward."""
    name = cfg.eval.reward or TASK_REWARDS.get(eval_data(cfg).name)
    if name is None or (cfg.eval.reward is None and cfg.reward.name == "env"):  # reward=env: the environment's
        return cfg.reward
    return OmegaConf.create({"name": "eval", "functions": [{"fn": name, "weight": 1.0, "args": {}}],
                             "target": None, "fallback": 0.0, "path": None,
                             "timeout_s": cfg.reward.timeout_s})


@dataclass
class Evaluation:
    metrics: Dict[str, float]   # eval/accuracy, eval/reward, eval/len_mean, eval/truncated_frac, pass@k
    samples: List[dict]         # one per completion: prompt, completion, reward, correct and the row's columns


@torch.no_grad()
def evaluate(policy, cfg, rows: List[dict], scorer, step: int = 0) -> Evaluation:
    """Generate for `rows` (the first eval.size of them) with `policy` and score with `scorer`
    (a rlnotes.rewards.scoring.Rewards)."""
    e = cfg.eval
    rows = rows[:e.size] if e.size else rows
    n = 1 if e.greedy else e.samples_per_prompt
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    # Modulo torch's seed range (2^64; a negative seed is taken modulo 2^64 by torch too): any valid seed.
    seed = (cfg.seed * 1_000_003 + step) % 2 ** 64
    generator = torch.Generator(next(policy.model.parameters()).device).manual_seed(seed)
    was_training = policy.model.training
    policy.eval()
    samples: List[dict] = []
    lengths, truncated = [], []
    multi_turn = MultiTurn.of(cfg.rollout)
    sampling, fmt = SamplingSettings.of(cfg.rollout, greedy=e.greedy, max_new_tokens=max_new), prompt_format(cfg)
    with policy.sampling(cfg.rollout.merge_adapter, cfg.rollout.pack_weights) as model:
        per_batch = max(1, e.batch_size // n)  # prompts: a batch's memory grows with its completions, n each
        for start in range(0, len(rows), per_batch):
            batch = rows[start:start + per_batch]
            rollout, rewards, episodes = _sample_and_score(model, policy.tokenizer, multi_turn, batch, n, sampling,
                                                           fmt, generator, scorer)
            lengths += rollout.completion_mask.sum(-1).tolist()
            truncated += rollout.truncated.tolist()
            prompts, calls = (episodes.prompts(), episodes.tool_calls()) if episodes else (None, None)
            for i, (text, reward) in enumerate(zip(rollout.texts, rewards.tolist())):
                samples.append(_sample(batch[i // n], text, reward, prompts[i] if prompts else None,
                                       calls[i] if calls else None))
    if was_training:
        policy.train()
    correct = [s["correct"] for s in samples]
    metrics = {"eval/accuracy": sum(correct) / len(correct),
               "eval/reward": sum(s["reward"] for s in samples) / len(samples),
               "eval/len_mean": sum(lengths) / len(lengths),
               "eval/truncated_frac": sum(truncated) / len(truncated)}
    if n > 1:
        per_prompt = [sum(correct[i:i + n]) for i in range(0, len(correct), n)]
        for k in sorted({1, n}):
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in per_prompt) / len(per_prompt)
    if multi_turn is not None and multi_turn.tools:
        metrics["eval/tools/calls"] = sum(s["tool_calls"] for s in samples) / len(samples)
    for name in multi_turn.names if multi_turn is not None else ():  # rows choose among several environments
        mine = [s for s in samples if s["environment"] == name]
        if mine:
            metrics[f"eval/env/{name}/reward"] = sum(s["reward"] for s in mine) / len(mine)
            metrics[f"eval/env/{name}/accuracy"] = sum(s["correct"] for s in mine) / len(mine)
    return Evaluation(metrics, samples)


def _sample(row: dict, completion: str, reward: float, prompt=None, tool_calls: Optional[int] = None) -> dict:
    """One sample of an evaluation: its prompt (the row's, or `prompt`: an episode's as the model saw
    it), completion, reward and correctness (and an episode's tool calls), then the row's other
    columns; a column named like one of the sample's own fields (an SFT row's reference
    `completion`) is kept as row.<name>, so it never stands for the sampled completion or its score."""
    sample = {"prompt": row["prompt"] if prompt is None else prompt, "completion": completion, "reward": reward,
              "correct": reward >= 1.0}
    if tool_calls is not None:
        sample["tool_calls"] = tool_calls
    for column, value in row.items():
        if column != "prompt":
            sample[f"row.{column}" if column in sample else column] = value
    return sample


def _sample_and_score(model, tokenizer, multi_turn: Optional[MultiTurn], batch: List[dict], n: int,
                      sampling: SamplingSettings, fmt: PromptFormat, generator,
                      scorer) -> tuple[Rollout, torch.Tensor, Optional[Conversations]]:
    """n completions (multi-turn: whole episodes, scored as in training) for each row of `batch`, their
    rewards, and (multi-turn) the episodes' conversations (else None)."""
    if multi_turn is not None:
        conversations, rollout = multi_turn.run_episodes(model, tokenizer, batch, n, sampling, fmt, generator)
        return rollout, conversations.score(scorer, batch, rollout)[0], conversations
    ids = fmt.encode(tokenizer, [r["prompt"] for r in batch])
    rollout = generate(model, tokenizer, ids, n, sampling, generator)
    return rollout, scorer.score_groups(batch, rollout.texts, rollout.token_lists(), n)[0], None


def write(evaluation: Evaluation, out_dir: Path, step: int, samples_name: Optional[str] = None) -> None:
    """Write the samples to out_dir/<samples_name> (default eval/step_<step>.jsonl: one file per
    evaluation of a training run), then append the metrics to out_dir/eval.jsonl (so a run's dir
    never holds eval.jsonl without eval/). Written aside and renamed, or appended, never through a
    link (rlnotes.run.files)."""
    samples = out_dir / (samples_name or f"eval/step_{step:06d}.jsonl")
    samples.parent.mkdir(parents=True, exist_ok=True)
    # A column JSON cannot hold (a date) is written as its text.
    files.write_text(samples, "".join(json.dumps(s, default=str) + "\n" for s in evaluation.samples))
    with files.append(out_dir / "eval.jsonl") as f:
        f.write(json.dumps({"step": step, **evaluation.metrics}) + "\n")


def eval_metrics(cfg, policy, data: Data, run: Run, run_dir: Path) -> Dict[str, float]:
    """A training run's evaluation of the current policy on data.eval_rows, scored by data.scorer
    (trainer.eval_every); its samples go to run_dir/eval/step_N.jsonl."""
    # Every rank evaluates the same rows (same numbers, same passes, nothing to wait for); rank 0 writes.
    data.scorer.at_step(run.step, run.steps, data.sampler.epochs_drawn())
    with fsdp.gathered(policy.model):
        evaluation = evaluate(policy, cfg, data.eval_rows, data.scorer, run.step)
    if distributed.is_main():
        write(evaluation, run_dir, run.step)
    return evaluation.metrics
