"""Fixed (prompt, completion) rows of a run's data as model inputs, for the algorithms that learn
from a dataset instead of sampling (DPO, SFT, reward models): rlnotes.engine.sequences.encode with
the run's prompt settings, and the likelihood of their completions.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlnotes.data.settings import system_prompt
from rlnotes.engine import distributed
from rlnotes.engine.sequences import Sequences, encode
from rlnotes.notes import aggregate
from rlnotes.training.batching import batch_totals, micro_batch_weight, micro_batches


def encode_rows(ctx, rows, key: Optional[str]) -> Sequences:
    """`encode` of the rows' prompts and their `key` column, with the run's prompt settings
    (key None: the first half of `rows` gives its `chosen` column, the second half `rejected`)."""
    completions = [r[key] for r in rows] if key else \
        [r["chosen"] for r in rows[:len(rows) // 2]] + [r["rejected"] for r in rows[len(rows) // 2:]]
    return encode(ctx.policy.tokenizer, [r["prompt"] for r in rows], completions, ctx.device,
                  ctx.cfg.model.chat_template, system_prompt(ctx.cfg))


def nll(ctx, seqs: Sequences, aggregation: str) -> torch.Tensor:
    """The negative log-likelihood of the completions of `seqs` under the policy, aggregated over
    their tokens (rlnotes.notes.AGGREGATIONS; token-mean: every token weighs the same): a scalar."""
    logp = ctx.policy.logprobs(seqs.input_ids, seqs.attention_mask, seqs.n_completion)
    return aggregate(-logp, seqs.completion_mask, aggregation)


def nll_backward(ctx, seqs: Sequences, aggregation: str) -> float:
    """The gradient of the batch's aggregated NLL (`nll`), micro-batch by micro-batch (trainer.micro_batch_size):
    each micro-batch's loss weighted by its share of the global batch's. Returns the batch's loss (all ranks')."""
    totals = batch_totals(seqs.completion_mask)  # the global batch's tokens and rows
    ctx.policy.train()
    loss_sum = 0.0
    with ctx.timed("policy"):
        for idx in micro_batches(seqs.input_ids.shape[0], ctx.cfg.trainer.micro_batch_size):
            chunk = seqs.select(idx)
            loss = nll(ctx, chunk, aggregation)
            weight = micro_batch_weight(aggregation, chunk.completion_mask, totals)
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
    return distributed.sum_over_ranks([loss_sum])[0]  # the ranks' shares of the batch's loss


def encode_pairs(ctx, rows) -> Sequences:
    """Preference pairs as one batch: chosen completions in the first half, rejected in the second."""
    return encode_rows(ctx, rows + rows, None)


