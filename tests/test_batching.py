"""One micro-batching path: the gradient of a batch does not depend on how it is cut into
micro-batches, for every aggregation mode (rlnotes.notes.AGGREGATIONS)."""

import pytest
import torch

from rlnotes.engine.rollout import Rollout, left_pad
from rlnotes.notes import AGGREGATIONS, aggregate
from rlnotes.training.batching import (
    activation_bytes,
    batch_totals,
    micro_batch_weight,
    micro_batches,
    pass_tokens,
    token_budget,
)
from tests.conftest import record_forwards

LENGTHS = [3, 7, 1, 5, 2, 6]   # uneven completions; the widest is 7 tokens


def rollout(lengths) -> Rollout:
    """A rollout of completions of `lengths` real tokens (padded to the longest, as sampled)."""
    n, width = len(lengths), max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
    return Rollout(torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                   torch.zeros(n, width, dtype=torch.long), mask, torch.zeros(n, width), [""] * n,
                   torch.zeros(n, dtype=torch.bool))


def accumulated_gradient(mode: str, size, max_len) -> torch.Tensor:
    """d loss / d theta, the loss accumulated micro-batch by micro-batch as the algorithms do: each
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


# ---------------------------------------------------------------------------------------------
# The token budget (trainer.micro_batch_tokens / micro_batch_memory)

def test_the_token_budget_cuts_the_fewest_even_chunks():
    cost = torch.tensor([5, 9, 2, 7, 4, 8, 3])           # tokens each row adds to its pass
    tokens = lambda idx: int(cost[idx].sum())  # noqa: E731
    # One pass holds 38 tokens; two even ones [0-3] 23 and [4-6] 15; three [0-2] 16, [3-4] 11, [5-6] 11.
    assert [c.tolist() for c in micro_batches(7, None, 16, tokens)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [c.tolist() for c in micro_batches(7, None, 23, tokens)] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [c.tolist() for c in micro_batches(7, None, 38, tokens)] == [list(range(7))]


def test_a_batch_bounded_within_the_budget_is_one_pass_without_counting():
    def never(idx):
        raise AssertionError("counted")

    assert [c.tolist() for c in micro_batches(4, None, 40, never, most=40)] == [[0, 1, 2, 3]]
    assert [len(c) for c in micro_batches(4, None, 40, lambda idx: 15 * len(idx), most=41)] == [2, 2]


def test_a_row_over_the_budget_makes_every_pass_one_row():
    chunks = micro_batches(3, None, 4, lambda idx: 5 * len(idx))
    assert [c.tolist() for c in chunks] == [[0], [1], [2]]


def test_micro_batch_size_wins_over_the_budget_and_no_budget_is_one_pass():
    tokens = lambda idx: 100 * len(idx)  # noqa: E731
    assert [len(c) for c in micro_batches(6, 4, 50, tokens)] == [4, 2]
    assert [len(c) for c in micro_batches(6, None, None, tokens)] == [6]
    assert micro_batches(0, None, 50, tokens) == []


def test_pass_tokens_count_a_shared_prompt_once_and_the_padding():
    # Rows 0-2 share a prompt of 2 tokens (left-padded to 3), rows 3-4 another of 3; completions of 1-4 tokens.
    prompt_ids = torch.tensor([[0, 7, 8]] * 3 + [[5, 6, 9]] * 2)
    prompt_mask = torch.tensor([[0, 1, 1]] * 3 + [[1, 1, 1]] * 2)
    real = (torch.arange(4) < torch.tensor([1, 4, 2, 3, 1])[:, None]).float()
    shared = pass_tokens(prompt_ids, prompt_mask, real, share_prompts=True)
    assert shared(torch.arange(5)) == 2 * 3 + 5 * 4       # two prompts of width 3, five rows of width 4
    assert shared(torch.tensor([3, 4])) == 1 * 3 + 2 * 3  # trimmed to the longest of the chunk's completions
    assert pass_tokens(prompt_ids, prompt_mask, real, share_prompts=False)(torch.arange(5)) == 5 * (3 + 4)
    assert pass_tokens(prompt_ids, prompt_mask, real, True, trimmed=False)(torch.tensor([3, 4])) == 3 + 2 * 4


def test_the_budget_is_micro_batch_tokens_else_micro_batch_memory_over_the_activations_a_token():
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4))
    per_token = 3 * (12 * 32 + 3 * 64) * 4                 # layers x (12 hidden + 3 intermediate) float32 values
    assert activation_bytes(model) == per_token
    trainer = lambda tokens, memory: SimpleNamespace(micro_batch_tokens=tokens, micro_batch_memory=memory)  # noqa: E731
    assert token_budget(trainer(500, 1.0), model) == 500
    assert token_budget(trainer(None, 1.0), model) == 2**30 // per_token
    assert token_budget(trainer(None, None), model) is None
    # Without gradients a pass holds one layer's activations at a time: the model's 3 layers' budget.
    assert token_budget(trainer(500, 1.0), model, grad=False) == 3 * 500
    assert token_budget(trainer(None, None), model, grad=False) is None
    assert activation_bytes(model.to(torch.bfloat16)) == per_token // 2


def calculator_batch(groups=4, group=4, prefix=318, own=20, completion=40):
    """A batch shaped like the calculator recipe's: prompts of a 318-token system prompt and tools
    block and a question of their own, G episodes each."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 50, (prefix,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 50, (own,), generator=g).tolist() for _ in range(groups)]
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(group)], 0)
    real = (torch.arange(completion) < torch.randint(5, completion + 1, (groups * group,), generator=g)[:, None])
    real[0] = True
    return prompt_ids, prompt_mask, real.float()


def test_pass_tokens_count_a_prefix_the_prompts_share_once():
    prompt_ids, prompt_mask, real = calculator_batch()
    tokens = pass_tokens(prompt_ids, prompt_mask, real, share_prompts=True)
    assert tokens(torch.arange(16)) == 318 + 4 * 20 + 16 * 40   # the prefix once, each question, the episodes
    assert tokens(torch.arange(4)) == 4 * 338 // 4 + 4 * 40     # one prompt: nothing to share
    assert pass_tokens(prompt_ids, prompt_mask, real, True, prefix=False)(torch.arange(16)) == 4 * 338 + 16 * 40
    # an SFT batch: every row its own prompt, behind the same prefix
    own = pass_tokens(prompt_ids[::4], prompt_mask[::4], real[::4], share_prompts=True)
    assert own(torch.arange(4)) == 318 + 4 * 20 + 4 * int(real[::4].sum(-1).max())


def test_a_calculator_batch_under_one_gib_takes_two_passes_where_each_group_took_one():
    """SmolLM2's 1 GiB budget is 776 tokens: a pass of a group alone was 338 + 4 x 40 tokens, so the
    batch took 4 passes forwarding its 318-token prefix each time; with the prefix counted once, 8
    episodes (two questions) fit a pass: 318 + 2 x 20 + 8 x 40 = 678."""
    prompt_ids, prompt_mask, real = calculator_batch()
    tokens = pass_tokens(prompt_ids, prompt_mask, real, share_prompts=True)
    assert [c.tolist() for c in micro_batches(16, None, 776, tokens)] == [list(range(8)), list(range(8, 16))]


def test_pass_tokens_are_the_tokens_the_passes_forward(monkeypatch):
    """Counted against the tiny model's embedding calls: the prefix pass, the questions and the episodes,
    or one group's prompt and its episodes (each episode's last token is only a target: not forwarded)."""
    from omegaconf import OmegaConf

    from rlnotes.core.schema import ModelConfig
    from rlnotes.engine.policy.passes import sequence_logprobs
    from rlnotes.engine.policy.policy import Policy

    model = Policy.from_config(OmegaConf.structured(ModelConfig(name_or_path="tiny")), torch.device("cpu")).model
    prompt_ids, prompt_mask, real = calculator_batch(groups=3, prefix=150)
    ids, attn = torch.cat([prompt_ids, (real * 7).long()], 1), torch.cat([prompt_mask, real.long()], 1)
    tokens = pass_tokens(prompt_ids, prompt_mask, real, share_prompts=True, trimmed=False)
    seen = record_forwards(monkeypatch)
    for idx in (torch.arange(12), torch.arange(3, 9), torch.tensor([0, 5, 10]), torch.tensor([4, 5])):
        seen.clear()
        with torch.no_grad():
            sequence_logprobs(model, ids[idx], attn[idx], real.shape[1])
        assert tokens(idx) == sum(rows * length for rows, length in seen) + len(idx), idx
