"""Micro-batches: one path for every algorithm. A batch is cut into index chunks of at most
trainer.micro_batch_size rows or, without it, of at most a token budget a pass
(trainer.micro_batch_tokens, or trainer.micro_batch_memory GiB of activations as tokens); each
chunk's loss, times its weight, is its share of the global batch's loss (every rank's rows), so
that accumulating the chunks' gradients (and summing them over ranks) gives the gradient of one
pass over the whole batch, whatever the chunk size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

from rlnotes.engine.hardware import distributed
from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.policy.passes import prefix_to_share, prompt_groups
from rlnotes.engine.rollout import Rollout
from rlnotes.notes import aggregation_divisor

if TYPE_CHECKING:
    from rlnotes.training.context import Model


def micro_batches(n: int, size: int | None, budget: Optional[int] = None,
                  tokens: Optional[Callable[[torch.Tensor], int]] = None,
                  most: Optional[int] = None) -> List[torch.Tensor]:
    """Index chunks of the n rows: of at most `size` rows when it is set; else, with a token `budget`
    and `tokens` (a chunk's indices -> the tokens its pass forwards), the fewest chunks of consecutive
    rows whose passes each hold at most `budget` tokens, their sizes within one row of each other
    (when one row alone is over the budget, every row gets a pass of its own); else all n at once.
    `most`: a bound on the whole batch's tokens (rows x width); within the budget, one chunk without
    counting. None when n is 0 (a rank left without rows). The budget gives every rank the same
    number of chunks, the most any rank needs (FSDP's passes go in lock step), so every rank must
    call this when any does."""
    if size or budget is None or tokens is None:
        return list(torch.arange(n).split(size or n)) if n else []
    rows, count = torch.arange(n), 1
    if most is None or most > budget:
        for count in range(1, n + 1):
            if all(tokens(chunk) <= budget for chunk in rows.tensor_split(count)):
                break
    count = max(distributed.gather(count))
    return list(rows.tensor_split(min(count, n))) if n else []


def pass_tokens(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, real: torch.Tensor, share_prompts: bool,
                trimmed: bool = True, prefix: bool = True) -> Callable[[torch.Tensor], int]:
    """The tokens a forward pass over rows `idx` of [left-padded prompt [N, P] | completion] forwards,
    padding included, as passes.completion_states makes it: with trainer.shared_prompt, the chunk's
    distinct prompts once each (the groups of passes.prompt_groups) and, where `prefix` (no FSDP)
    and a prefix they share is worth a pass of its own (passes.prefix_to_share), that prefix once
    and each prompt's remainder; else every row's prompt; plus each row's completion as wide as the
    chunk's longest (`trimmed`: Rollout.select cuts the width to it) or all of `real`'s [N, T] width."""
    width = prompt_ids.shape[1]

    @functools.cache
    def counted():  # the groups, prompt and completion lengths, found on the first count only
        groups = prompt_groups(prompt_ids, prompt_mask) if share_prompts and width else None
        return groups, prompt_mask.sum(-1).long(), real.sum(-1).long()

    def tokens(idx: torch.Tensor) -> int:
        groups, prompt_lengths, lengths = counted()
        completion = int(lengths[idx].max()) if trimmed else real.shape[1]
        if not share_prompts or not width:
            return len(idx) * (width + completion)
        firsts = idx if groups is None else idx[_first_of_each(groups[1][idx])]
        common = prefix_to_share(prompt_ids[firsts], prompt_mask[firsts]) if prefix else 0
        if common:
            prompts = common + len(firsts) * (int(prompt_lengths[firsts].max()) - common)
        else:
            prompts = (len(idx) if groups is None else len(firsts)) * width
        return prompts + len(idx) * completion

    return tokens


def _first_of_each(numbers: torch.Tensor) -> torch.Tensor:
    """The positions of the first occurrence of each distinct value of `numbers` (in order)."""
    seen, first = set(), []
    for i, n in enumerate(numbers.tolist()):
        if n not in seen:
            seen.add(n)
            first.append(i)
    return torch.tensor(first, dtype=torch.long)


def activation_bytes(model) -> int:
    """About the bytes a training pass keeps for its backward pass per token forwarded: layers x
    (12 hidden + 3 intermediate) values, from the model's config (measured with saved-tensor hooks:
    SmolLM2-135M keeps 1.28-1.54 MB a token, this says 1.38; the tiny test model 9.8-10.8 kB, this 9.2)."""
    config, size = model.config, next(model.parameters()).element_size()
    hidden = config.hidden_size
    return config.num_hidden_layers * (12 * hidden + 3 * getattr(config, "intermediate_size", 4 * hidden)) * size


def token_budget(trainer, model, grad: bool = True) -> Optional[int]:
    """The most tokens a pass may forward: micro_batch_tokens, else micro_batch_memory GiB of
    activations at `activation_bytes` a token, else None (no limit), of `trainer` (a Batching, or
    the trainer section). A pass without gradients (`grad` false) holds one layer's activations at a
    time, so it may forward as many times more tokens as the model has layers."""
    budget = trainer.micro_batch_tokens
    if budget is None and trainer.micro_batch_memory is not None:
        budget = max(1, int(trainer.micro_batch_memory * 2**30 / activation_bytes(model)))
    return budget if budget is None or grad else budget * model.config.num_hidden_layers


def rollout_micro_batches(model: Model, rollout: Rollout, rows: Optional[torch.Tensor] = None,
                          grad: bool = True) -> List[torch.Tensor]:
    """`micro_batches` of the rollout's rows for the passes of `model`'s policy, cut as its batching
    says (micro_batch_size, else the token budget of a pass with or without gradients); of `rows`
    (indices into the rollout) when given, the chunks indexing `rows`."""
    trainer, policy = model.batching, model.policy
    n = len(rollout) if rows is None else len(rows)
    budget = None if trainer.micro_batch_size else token_budget(trainer, policy.model, grad)
    if budget is None:  # no token counts needed
        return micro_batches(n, trainer.micro_batch_size)
    tokens = pass_tokens(rollout.prompt_ids, rollout.prompt_mask, rollout.real, policy.share_prompts,
                         prefix=not is_sharded(policy.model))
    return micro_batches(n, None, budget, tokens if rows is None else lambda part: tokens(rows[part]),
                         most=n * (rollout.prompt_ids.shape[1] + rollout.real.shape[1]))


@dataclass(frozen=True)
class Totals:
    """A batch's real tokens and rows summed over every rank, and its longest completion over
    every rank: what the aggregations divide by, so that each rank's loss is its share of the
    global batch's loss."""
    tokens: float
    rows: float
    longest: int


def batch_totals(mask: torch.Tensor) -> Totals:
    """The Totals of the batch whose part on this rank has completion mask `mask` [N, T] (one exchange)."""
    longest = int(mask.sum(-1).max()) if mask.shape[0] else 0
    parts = distributed.gather((float(mask.sum()), mask.shape[0], longest))
    return Totals(float(sum(p[0] for p in parts)), float(sum(p[1] for p in parts)), max(max(p[2] for p in parts), 1))


def row_totals(n: int) -> Totals:
    """The Totals of a batch of n rows on this rank whose loss is a mean over rows (pairs, sequences)."""
    return Totals(0.0, distributed.sum_over_ranks([n])[0], 1)


def micro_batch_weight(aggregation: str, chunk_mask: torch.Tensor, totals: Totals,
                       max_len: Optional[int] = None) -> float:
    """Z_chunk / Z_batch (notes.aggregation_divisor): the factor that turns a micro-batch's
    aggregated loss into its share of the global batch's loss, so that accumulating over
    micro-batches (and summing over ranks) gives one pass's gradient. `max_len` is the loss's L
    of seq-mean-token-sum-norm; without it the chunk's own width is its L and the batch's longest
    completion the batch's, so a chunk trimmed to its longest row weighs the same."""
    chunk = aggregation_divisor(aggregation, float(chunk_mask.sum()), chunk_mask.shape[0],
                                max_len or chunk_mask.shape[1])
    batch = aggregation_divisor(aggregation, totals.tokens, totals.rows, max_len or totals.longest)
    return chunk / max(batch, 1.0)
