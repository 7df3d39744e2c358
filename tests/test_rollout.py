"""The rollout engine: groups laid out prompt by prompt, reproducible, stopping at EOS, and
recording the same log-probs that a training forward pass computes."""

import pytest
import torch
from omegaconf import OmegaConf

from rlnotes.core.schema import TinyModelConfig
from rlnotes.engine.model.loading import tiny_model, tiny_tokenizer
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.prompts import encode_prompts
from rlnotes.engine.sampling.generate import draw_tokens, generate, stop_ids, top_p_filter
from rlnotes.engine.sampling.settings import SamplingSettings
from tests.conftest import record_forwards

PROMPTS = ["Write the letter a:", "What is 2+3?", "Hi"]


def setup(seed=0):
    tok = tiny_tokenizer()
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    return model, tok, encode_prompts(tok, PROMPTS, chat_template=False)


def sample(model, tok, prompts, seed=0, group_size=4, **kw):
    settings = SamplingSettings(**(dict(max_new_tokens=12, temperature=1.0, top_p=1.0) | kw))
    return generate(model, tok, prompts, group_size, settings, torch.Generator().manual_seed(seed))


def test_same_seed_same_samples_other_seed_other_samples():
    model, tok, prompts = setup()
    a, b, c = sample(model, tok, prompts), sample(model, tok, prompts), sample(model, tok, prompts, seed=1)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_groups_are_laid_out_prompt_by_prompt():
    model, tok, prompts = setup()
    r = sample(model, tok, prompts)
    assert len(r) == 12
    for i, p in enumerate(prompts):
        for j in range(4):
            row = r.prompt_ids[4 * i + j][r.prompt_mask[4 * i + j].bool()]
            assert row.tolist() == p


def test_sampled_logprobs_match_a_training_forward_pass():
    model, tok, prompts = setup()
    r = sample(model, tok, prompts, temperature=0.7)
    recomputed = sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1], 0.7)
    torch.testing.assert_close(recomputed * r.completion_mask, r.logprobs, atol=1e-5, rtol=0)


def test_completions_stop_at_eos_and_truncation_is_flagged():
    model, tok, prompts = setup()
    with torch.no_grad():  # an EOS logit of 0 among random ones: rows finish at different times
        model.lm_head.weight[tok.eos_token_id] = 0
    r = sample(model, tok, prompts, max_new_tokens=40)
    lengths = r.completion_mask.sum(-1).long()
    for row, n, trunc in zip(r.completion_ids, lengths, r.truncated):
        tokens = row.tolist()
        if trunc:
            assert n == r.completion_ids.shape[1] == 40 or tok.eos_token_id not in tokens[:n]
        else:
            assert tokens[n - 1] == tok.eos_token_id and tok.eos_token_id not in tokens[:n - 1]
        assert all(t == tok.pad_token_id for t in tokens[n:])
    eos_rows = (~r.truncated).sum()
    assert 0 < eos_rows < len(r), "the test needs some rows that stop early and some that do not"


@pytest.mark.parametrize("eos,expected", [(2, [2]), ([2, 7], [2, 7]), ([7, 2], [2, 7]), ([7], [2, 7]), (None, [2])])
def test_stop_ids_are_the_tokenizers_eos_and_the_generation_configs(eos, expected):
    model, tok, _ = setup()
    model.generation_config.eos_token_id = eos
    assert stop_ids(model, tok) == expected


def test_completions_and_turns_end_at_every_eos_id_of_the_generation_config():
    """A model whose generation config lists a second EOS id beside the tokenizer's (as chat models
    list <|im_end|> and <|endoftext|>): completions and an episode's turns end at either, not
    truncated, as transformers' generate and TRL end them."""
    from rlnotes.engine.sampling.episodes import generate_episodes
    from rlnotes.engine.sampling.settings import EpisodeLimits

    model, tok, prompts = setup()
    other = tok.convert_tokens_to_ids("!")
    with torch.no_grad():  # "!" about four times as likely as a common character; EOS a logit of 0
        model.lm_head.weight[other] = 4.0 * model.lm_head.weight[75]
        model.lm_head.weight[tok.eos_token_id] = 0.0
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    r = sample(model, tok, prompts, max_new_tokens=32)
    episodes = generate_episodes(model, tok, prompts, 4, lambda rows, turns, last: [None] * len(rows),
                                 SamplingSettings(32), EpisodeLimits(1), torch.Generator().manual_seed(0))
    for rollout in (r, episodes):
        lengths = rollout.completion_mask.sum(-1).long()
        last = rollout.completion_ids.gather(1, (lengths - 1)[:, None]).squeeze(-1)
        assert (last == other).any(), "the test needs completions that end at the second id"
        assert not rollout.truncated[last == other].any()
        for row, n in zip(rollout.completion_ids.tolist(), lengths.tolist()):
            assert other not in row[:n - 1]  # nothing goes on past it


def test_forced_eos_gives_one_token_completions():
    model, tok, prompts = setup()
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id] = 0
    bias = torch.full((len(tok),), -50.0)
    bias[tok.eos_token_id] = 50.0
    model.lm_head.bias = torch.nn.Parameter(bias)
    r = sample(model, tok, prompts)
    assert r.completion_ids.shape[1] == 1
    assert (r.completion_ids[:, 0] == tok.eos_token_id).all() and not r.truncated.any()
    assert r.texts == [""] * 12


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.8))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.81)).sum() == 3
    assert torch.isfinite(top_p_filter(logits, 1.0)).all()


def test_sampled_tokens_follow_the_probabilities():
    # One uniform number per row through the cumulative distribution, the generator's stream:
    # frequencies match the (unnormalised) probabilities, zero-probability tokens never come up.
    probs = torch.tensor([[0.2, 0.0, 1.2, 0.6]]).expand(40_000, 4)
    settings = SamplingSettings(1)
    tokens, logps = draw_tokens(probs.log(), settings, None, 0, torch.Generator().manual_seed(3))
    freq = torch.bincount(tokens, minlength=4) / 40_000
    assert freq[1] == 0 and torch.allclose(freq, probs[0] / 2.0, atol=0.01), freq
    torch.testing.assert_close(logps, (probs[0] / 2.0).log()[tokens])
    again, _ = draw_tokens(probs.log(), settings, None, 0, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, again)


def test_prompts_that_share_a_prefix_prefill_it_once_and_sample_the_same(monkeypatch):
    """A system prompt every prompt starts with is forwarded once (passes.prompt_pass): the samples,
    their log-probs and the rows' prompts are those of the plain prefill."""
    import rlnotes.engine.policy.passes

    model, tok, _ = setup()
    prompts = encode_prompts(tok, [f"You are a careful assistant; answer in one word. {p}" for p in PROMPTS],
                             chat_template=False)
    runs = {}
    fed = record_forwards(monkeypatch)
    for saving in (float("inf"), 1):
        monkeypatch.setattr(rlnotes.engine.policy.passes, "MIN_PREFIX_SAVING", saving)
        fed.clear()
        runs[saving] = sample(model, tok, prompts, temperature=0.7)
        assert fed[0][0] == (3 if saving > 1 else 1)  # the prefill: every prompt whole, or the prefix once
    plain, shared = runs[float("inf")], runs[1]
    assert torch.equal(plain.completion_ids, shared.completion_ids) and plain.texts == shared.texts
    assert torch.equal(plain.prompt_ids, shared.prompt_ids) and torch.equal(plain.prompt_mask, shared.prompt_mask)
    torch.testing.assert_close(shared.logprobs, plain.logprobs, atol=1e-5, rtol=0)


def test_growing_cache_layer_holds_what_a_dynamic_layer_holds_and_decodes_in_place():
    """GrowingLayer against transformers' DynamicLayer through what sampling does: a prompt pass, rows
    repeated for a group, one position per step, finished rows dropped, and a pass past its room."""
    from transformers.cache_utils import DynamicLayer

    from rlnotes.engine.policy.kvcache import GrowingLayer

    g = torch.Generator().manual_seed(0)
    states = lambda rows, n: (torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g))  # noqa: E731
    grown, plain = GrowingLayer(room=3), DynamicLayer()

    def both(op, *args):
        out = [getattr(layer, op)(*args) for layer in (grown, plain)]
        torch.testing.assert_close(grown.keys, plain.keys, rtol=0, atol=0)
        torch.testing.assert_close(grown.values, plain.values, rtol=0, atol=0)
        return out[0]

    both("update", *states(2, 5))
    both("batch_repeat_interleave", 3)
    buffer = grown.buffers[0].data_ptr()
    for _ in range(3):  # decoding: each position written into the buffers, nothing copied
        keys, _ = both("update", *states(6, 1))
        assert grown.buffers[0].data_ptr() == buffer and keys.data_ptr() == buffer
    both("batch_select_indices", torch.tensor([0, 2, 5]))
    both("update", *states(3, 4))  # past the room: the buffers grow
    assert grown.get_seq_length() == plain.get_seq_length() == 12


def test_rows_that_finish_early_keep_the_log_probs_of_a_training_pass(monkeypatch):
    """Sampling with rows leaving the batch as they end, and a cache that outgrows its room: every
    sampled token's log-prob is the one a whole-row forward pass gives."""
    import rlnotes.engine.policy.kvcache

    model, tok, prompts = setup()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 0
    original = rlnotes.engine.policy.kvcache.GrowingLayer.__init__
    monkeypatch.setattr(rlnotes.engine.policy.kvcache.GrowingLayer, "__init__", lambda self, room: original(self, 2))
    r = sample(model, tok, prompts, max_new_tokens=30, temperature=0.7)
    lengths = r.completion_mask.sum(-1)
    assert lengths.min() < lengths.max(), "the test needs rows that end at different steps"
    recomputed = sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1], 0.7)
    torch.testing.assert_close(recomputed * r.completion_mask, r.logprobs, atol=1e-5, rtol=0)
