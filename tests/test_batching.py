"""One micro-batching path: the gradient of a batch does not depend on how it is cut into
micro-batches, for every aggregation mode (rlnotes.notes.AGGREGATIONS)."""

import pytest
import torch

from rlnotes.engine.rollout import Rollout
from rlnotes.notes import AGGREGATIONS, aggregate
from rlnotes.training.batching import batch_totals, micro_batch_weight, micro_batches

LENGTHS = [3, 7, 1, 5, 2, 6]   # uneven completions; the widest is 7 tokens


def rollout(lengths) -> Rollout:
    """A rollout of completions of `lengths` real tokens (padded to the longest, as sampled)."""
    n, width = len(lengths), max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
    return Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                   torch.zeros(n, width, dtype=torch.long), mask, torch.zeros(n, width), [""] * n,
                   torch.zeros(n, dtype=torch.bool))


def accumulated_gradient(mode: str, size, max_len) -> torch.Tensor:
    """d loss / d theta, the loss accumulated micro-batch by micro-batch as the runners do: each
    chunk trimmed to its longest completion (Rollout.select), its aggregate times its weight."""
    batch = rollout(LENGTHS)
    theta = torch.linspace(-1.0, 2.0, batch.completion_mask.numel()).view_as(batch.completion_mask)
    theta.requires_grad_(True)
    totals = batch_totals(batch.completion_mask)
    for idx in micro_batches(len(batch), size):
        chunk = batch.select(idx)
        width = chunk.completion_ids.shape[1]
        per_token = theta[idx, :width] ** 2 * torch.arange(1.0, width + 1.0)  # a loss whose gradient has every entry
        loss = aggregate(per_token, chunk.completion_mask, mode, max_len)
        (loss * micro_batch_weight(mode, chunk.completion_mask, totals, max_len)).backward()
    return theta.grad


@pytest.mark.parametrize("max_len", [None, 10])
@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_the_gradient_is_the_same_at_every_micro_batch_size(mode, max_len):
    full = accumulated_gradient(mode, None, max_len)
    assert full.abs().sum() > 0
    for size in (1, 2):
        torch.testing.assert_close(accumulated_gradient(mode, size, max_len), full, rtol=1e-5, atol=1e-8,
                                   msg=lambda m: f"{mode}, micro-batches of {size}: {m}")


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_the_whole_batch_in_one_micro_batch_is_the_aggregate_itself(mode):
    batch = rollout(LENGTHS)
    mask = batch.completion_mask
    assert micro_batch_weight(mode, mask, batch_totals(mask)) == 1.0
    assert micro_batch_weight(mode, mask, batch_totals(mask), max_len=10) == 1.0


def test_the_batch_length_of_seq_mean_token_sum_norm_is_its_longest_completion():
    batch = rollout(LENGTHS)
    chunk = batch.select(torch.tensor([2, 4]))    # 1 and 2 tokens: trimmed to width 2
    assert batch_totals(batch.completion_mask).longest == 7
    # sum / (2 rows * 2) of the chunk, as a share of sum / (6 rows * 7) of the batch
    assert micro_batch_weight("seq-mean-token-sum-norm", chunk.completion_mask,
                              batch_totals(batch.completion_mask)) == pytest.approx(4 / 42)
