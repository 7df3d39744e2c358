"""Micro-batches: one path for every runner. A batch is cut into index chunks of at most
trainer.micro_batch_size rows; each chunk's loss, times its weight, is its share of the global
batch's loss (every rank's rows), so that accumulating the chunks' gradients (and summing them
over ranks) gives the gradient of one pass over the whole batch, whatever the chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from rlnotes.engine import distributed
from rlnotes.notes import aggregation_divisor


def micro_batches(n: int, size: int | None) -> List[torch.Tensor]:
    """Index chunks of at most `size` (null: all n at once); none when n is 0 (a rank left without rows)."""
    return list(torch.arange(n).split(size or n)) if n else []


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
