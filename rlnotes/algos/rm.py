"""Reward model training on preference pairs (Ouyang et al. 2022, InstructGPT, Sec. 3.5).

For each batch of pairs (x, y_w, y_l), micro-batch by micro-batch:
  1. r(x, y) for y_w and y_l in one forward pass: a scalar head on the final hidden state of the
     last token (EOS) of [x | y], on the base model with LoRA;
  2. minimise the mean over pairs of the Bradley-Terry loss -log sigma(r(x, y_w) - r(x, y_l))
     (Eq. 1), head and adapter together, one optimizer step per batch;
  3. report how often r(y_w) > r(y_l), on the batch and, every trainer.eval_every steps, on held-out pairs.
Rewards are defined up to a constant (only differences enter the loss); InstructGPT normalises
them afterwards so that the demonstrations score 0 on average; this module does not.
With several processes each rank takes 1/N of the pairs; every mean is over the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from rlnotes.core.algorithm import Algorithm, Shape
from rlnotes.core.schema import AlgoConfig
from rlnotes.engine.hardware import distributed
from rlnotes.engine.sequences import Sequences
from rlnotes.notes import bradley_terry_loss
from rlnotes.rewards.model import HEAD, make_head, sequence_rewards
from rlnotes.training.batching import micro_batches, row_totals
from rlnotes.training.context import Context, Model
from rlnotes.training.offline import encode_pairs, pair_micro_batches
from rlnotes.training.optimizer import optimizer_step
from rlnotes.training.sampling import next_rows


@dataclass
class RMConfig(AlgoConfig):
    name: str = "rm"


def reward_head(model: Model, step: int) -> torch.nn.Module:
    """The scalar head, made when first needed (the first evaluation or step, the run's `step`);
    trained and saved with the adapter."""
    if HEAD not in model.heads:
        model.add_head(HEAD, make_head(model.policy.model).to(model.device), step)
    return model.heads[HEAD]


def pair_rewards(model: Model, step: int, rows,
                 seqs: Optional[Sequences] = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(r chosen [n], r rejected [n], tokens) of the pairs `rows` (encoded as `seqs`, if given)."""
    seqs = encode_pairs(model, rows) if seqs is None else seqs
    r = sequence_rewards(model.policy.model, reward_head(model, step), seqs)
    return r[:len(rows)], r[len(rows):], seqs.tokens()


@torch.no_grad()
def evaluate(ctx: Context) -> Dict[str, float]:
    """Held-out pairwise accuracy and mean margin on the first eval.size pairs (all: null)."""
    cfg, model = ctx.cfg, ctx.model
    model.policy.eval()
    rows = ctx.data.eval_rows[:cfg.eval.size]
    margins = []
    for idx in micro_batches(len(rows), cfg.trainer.micro_batch_size or cfg.trainer.batch_size):
        chosen, rejected, _ = pair_rewards(model, ctx.run.step, [rows[i] for i in idx])
        margins.append(chosen - rejected)
    margin = torch.cat(margins)
    return {"eval/rm_accuracy": float((margin > 0).float().mean()), "eval/rm_margin": float(margin.mean())}


def train_step(ctx: Context) -> Dict[str, float]:
    model, run = ctx.model, ctx.run
    metrics: Dict[str, float] = {}

    rows = next_rows(ctx.data.sampler)
    totals = row_totals(len(rows))  # the global batch's pairs
    model.policy.train()
    sums = {"loss": 0.0, "rm/accuracy": 0.0, "rm/margin": 0.0, "rm/chosen_reward": 0.0}
    tokens = 0.0
    with run.timed("policy"):
        for idx, seqs in pair_micro_batches(model, rows):
            share = len(idx) / totals.rows  # the chunk's share of the global batch
            # 1. Rewards of chosen and rejected completions in one pass.
            chosen, rejected, chunk_tokens = pair_rewards(model, run.step, [rows[i] for i in idx], seqs)
            # 2. Bradley-Terry loss, this micro-batch's share of the batch mean.
            loss = bradley_terry_loss(chosen, rejected).mean()
            (loss * share).backward()
            # 3. Ranking metrics of the batch before the update.
            margin = (chosen - rejected).detach()
            for key, value in (("loss", loss.detach()), ("rm/accuracy", (margin > 0).float().mean()),
                               ("rm/margin", margin.mean()), ("rm/chosen_reward", chosen.detach().mean())):
                sums[key] += float(value) * share
            tokens += chunk_tokens
    metrics.update(distributed.sum_shares(sums), **{"perf/tokens": tokens})  # tokens: summed by the train loop
    metrics.update(optimizer_step(model, run, ctx.out.console))
    return metrics


def shape(cfg) -> Shape:
    b = cfg.trainer.batch_size
    return Shape("pairs", 2 * b, b, "pairs of a step (trainer.batch_size)")


ALGORITHM = Algorithm(name="rm", schema=RMConfig, train_step=train_step, samples=False, default_task="arith_pairs",
                      columns=("prompt", "chosen", "rejected"), shape=shape, evaluate=evaluate,
                      objective="eval/rm_accuracy", train_objective="rm/accuracy")
