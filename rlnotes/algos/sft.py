"""Supervised fine-tuning on demonstrations (the first stage of InstructGPT, Ouyang et al. 2022).

For each batch of (prompt x, completion y) rows, micro-batch by micro-batch:
  1. log pi(y_t | x, y_<t) of every completion token (its EOS included), in one forward pass;
  2. minimise the negative log-likelihood -log pi(y_t | ...), averaged by algo.aggregation
     (token-mean: every completion token of the batch weighs the same); the prompt is context
     only and gets no loss. A row with a `messages` conversation is trained on its assistant turns
     alone, the other turns context (TRL's assistant_only_loss=True; rlnotes.agents.rendering);
  3. one optimizer step per batch; every trainer.eval_every steps, the same loss on held-out rows.
With several processes each rank takes 1/N of the rows; the token count that token-mean divides
by (or the number of rows, for seq-mean-token-mean) is the global batch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch

from rlnotes.core.algorithm import Algorithm, Shape
from rlnotes.core.schema import AlgoConfig
from rlnotes.notes import AGGREGATIONS
from rlnotes.training.context import Context
from rlnotes.training.offline import encode_demonstrations, nll, nll_backward
from rlnotes.training.optimizer import optimizer_step
from rlnotes.training.sampling import next_rows


# What a row demonstrates: its conversation when it has one, else its completion.
DEMONSTRATIONS = ("messages", "completion")


@dataclass
class SFTConfig(AlgoConfig):
    name: str = "sft"
    # How per-token NLLs become the loss: token-mean (every completion token weighs the same)
    # or seq-mean-token-mean (every completion weighs the same); see rlnotes.notes.AGGREGATIONS.
    aggregation: str = "token-mean"


@torch.no_grad()
def evaluate(ctx: Context) -> Dict[str, float]:
    """Held-out loss on the first eval.size rows (all: null) (one batch, exact for either aggregation)."""
    cfg, model = ctx.cfg, ctx.model
    model.policy.eval()
    seqs = encode_demonstrations(model, ctx.data.eval_rows[:cfg.eval.size], DEMONSTRATIONS)
    loss = float(nll(model.policy, seqs, cfg.algo.aggregation))
    return {"eval/sft_loss": loss, "eval/sft_ppl": math.exp(min(loss, 50.0))}


def train_step(ctx: Context) -> Dict[str, float]:
    algo, model, run = ctx.cfg.algo, ctx.model, ctx.run
    metrics: Dict[str, float] = {}

    seqs = encode_demonstrations(model, next_rows(ctx.data.sampler), DEMONSTRATIONS)
    # 1-2. Completion-token NLL, micro-batch by micro-batch, each its share of the batch's loss.
    loss_sum = nll_backward(model, run, seqs, algo.aggregation)
    # 3. One optimizer step per batch.
    metrics.update(optimizer_step(model, run, ctx.out.console))
    metrics.update({"loss": loss_sum, "sft/ppl": math.exp(min(loss_sum, 50.0)), "perf/tokens": seqs.tokens()})
    return metrics


def shape(cfg) -> Shape:
    b = cfg.trainer.batch_size
    return Shape("rows", b, b, "rows of a step (trainer.batch_size)")


ALGORITHM = Algorithm(name="sft", schema=SFTConfig, train_step=train_step, samples=False, default_task="arith_sft",
                      columns=("prompt", "completion"), shape=shape, evaluate=evaluate, objective="eval/sft_loss",
                      train_objective="loss", choices={"algo.aggregation": AGGREGATIONS})
