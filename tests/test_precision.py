"""hardware.precision=bf16 (rlnotes.engine.model.precision, rlnotes.engine.hardware.devices): the frozen
linear weights stored in bf16, LoRA and the optimizer in float32, the same numbers autocast computes,
log-probs near float32's, a sampler that keeps a small adapter update, a run that learns; refused on
a CPU without bf16 units, chosen by auto."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from rich.console import Console
from test_merged import trained_policy
from test_shared_prompt import lora_smollm2_shaped

from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import ModelConfig
from rlnotes.engine.hardware import devices
from rlnotes.engine.hardware.devices import check_precision, choose_precision, mixed_precision
from rlnotes.engine.model.precision import frozen_linears_to_bf16
from rlnotes.engine.policy import head, llama, packed
from rlnotes.engine.policy.critic import logprobs_and_values, value_head
from rlnotes.engine.policy.llama import attend, attention_bias, attention_mask
from rlnotes.engine.policy.merged import LowRankLinear, lora_slots, merged_adapters
from rlnotes.engine.policy.packed import PackedLinear, packed_linears
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.prompts import encode_prompts
from rlnotes.engine.sampling.generate import generate
from rlnotes.engine.sampling.settings import SamplingSettings

CPU = torch.device("cpu")
BF16 = mixed_precision("bf16", CPU)
PROMPTS = ["Write the letter A:", "hello there", "abc def ghi", "x"]


def sampled(policy, precision="fp32", seed=0):
    """Four completions of each prompt, sampled in `precision`."""
    ids = encode_prompts(policy.tokenizer, PROMPTS, chat_template=False)
    with mixed_precision(precision, CPU), policy.sampling() as model:
        return generate(model, policy.tokenizer, ids, 4, SamplingSettings(16), torch.Generator().manual_seed(seed))


@torch.no_grad()
def logprobs(policy, rollout, precision):
    with mixed_precision(precision, CPU):
        n = rollout.completion_ids.shape[1]
        return policy.logprobs(rollout.input_ids, rollout.attention_mask, n) * rollout.completion_mask


def test_frozen_linears_go_to_bf16_while_lora_embeddings_and_norms_stay_float32():
    policy = trained_policy()
    policy.store_frozen_in_bf16()
    dtypes = {name: p.dtype for name, p in policy.model.named_parameters()}
    lora = {n for n in dtypes if "lora_" in n}
    linear = {n for n in dtypes if n.endswith(("proj.base_layer.weight", "lm_head.weight"))}
    assert lora and linear and all(dtypes[n] == torch.float32 for n in lora)
    assert all(p.requires_grad for n, p in policy.model.named_parameters() if n in lora)
    assert all(dtypes[n] == torch.bfloat16 for n in linear)
    assert {dtypes[n] for n in dtypes if "norm" in n or "embed_tokens" in n} == {torch.float32}
    assert frozen_linears_to_bf16(policy.model) == 0  # twice is once


def test_without_lora_the_trained_weights_stay_float32_and_the_reference_copy_goes_to_bf16():
    cfg = OmegaConf.structured(ModelConfig(name_or_path="tiny"))
    cfg.lora = None
    policy = Policy.from_config(cfg, CPU)
    policy.store_frozen_in_bf16()
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    with policy.reference() as ref:
        assert ref.get_output_embeddings().weight.dtype == torch.bfloat16


def test_stored_bf16_weights_give_the_numbers_autocast_gives_float32_weights():
    """Autocast rounds a float32 weight to bf16 for every matmul; storing it rounded once changes no
    number: policy and reference log-probs equal to the bit."""
    policy = trained_policy()
    rollout = sampled(policy)
    autocast = logprobs(policy, rollout, "bf16")
    with policy.reference():
        autocast_ref = logprobs(policy, rollout, "bf16")
    policy.store_frozen_in_bf16()
    assert torch.equal(logprobs(policy, rollout, "bf16"), autocast)
    with policy.reference():
        assert torch.equal(logprobs(policy, rollout, "bf16"), autocast_ref)


def test_attention_of_the_own_pass_runs_in_float32_under_bf16_autocast_with_its_gradients():
    """The own pass's attention under CPU autocast is float32's scaled_dot_product_attention of the
    same inputs (bf16's would round q, k and v first), and its gradients reach the inputs as float32's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    allowed = attention_mask(torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]), 5)
    kv = [t[:, :2].detach().requires_grad_() for t in (k, v)]  # 2 key and value heads for 6 query heads
    with BF16:
        ours = attend(q, *kv, attention_bias(allowed), 0.3, True)
        rounded = F.scaled_dot_product_attention(q, *kv, attn_mask=allowed, scale=0.3, enable_gqa=True)
    exact = F.scaled_dot_product_attention(q, *kv, attn_mask=allowed, scale=0.3, enable_gqa=True)
    assert ours.dtype == torch.float32 and torch.equal(ours, exact)
    assert rounded.dtype == torch.bfloat16 and not torch.equal(rounded.float(), exact)
    grads = torch.autograd.grad(ours.square().sum(), [q, *kv])
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(exact.square().sum(), [q, *kv])))


def test_bf16_log_probs_are_within_a_stated_tolerance_of_float32():
    """bf16 keeps 8 significant bits: each matmul's inputs are rounded by up to 2^-9 (0.2%) of their
    size, so a log-prob moves by about that share of the logits (up to ~10 here), ~0.02 for a token
    and less on average; measured on this model: at most 0.028, 0.0066 on average over ~380 tokens.
    The bounds leave 3x for other CPUs' accumulation order (AMX, AVX-512, emulation); the lower bound
    shows bf16 really ran."""
    policy = trained_policy()
    rollout = sampled(policy)
    exact = logprobs(policy, rollout, "fp32")
    policy.store_frozen_in_bf16()
    diff = (logprobs(policy, rollout, "bf16") - exact)[rollout.completion_mask.bool()].abs()
    assert diff.max() < 0.1 and 1e-4 < diff.mean() < 0.02, (diff.max(), diff.mean())


def test_a_tied_embedding_looks_up_float32_and_the_log_probs_stay_near_float32():
    """SmolLM2's head is its embedding: stored in bf16 with the head, its lookups come back float32
    (the residual stream stays float32). Same tolerance and reason as above; SmolLM2-shaped logits
    are smaller, so the bounds are looser than needed."""
    torch.manual_seed(0)
    model = lora_smollm2_shaped(2).eval()
    tokens = torch.randint(0, 49152, (3, 20))
    mask = torch.ones_like(tokens)
    with torch.no_grad():
        exact = sequence_logprobs(model, tokens, mask, 10)
        frozen_linears_to_bf16(model)
        embed = model.get_input_embeddings()
        assert embed.weight is model.get_output_embeddings().weight and embed.weight.dtype == torch.bfloat16
        looked_up = embed(tokens)
        assert looked_up.dtype == torch.float32 and torch.equal(looked_up, embed.weight[tokens].float())
        with BF16:
            diff = (sequence_logprobs(model, tokens, mask, 10) - exact).abs()
    assert diff.max() < 0.1 and 1e-4 < diff.mean() < 0.02, (diff.max(), diff.mean())


def test_sampling_keeps_an_update_that_a_merged_bf16_weight_would_lose():
    """Early in training s B A is far below half of W's bf16 rounding step, so W + s B A rounded to
    bf16 is W itself at most entries (all but those near 0); the sampling layer adds the update to
    the output instead, in float32, computing exactly what the own training pass computes under
    autocast (llama.linear), and the float64 sum to within its bf16 rounding."""
    policy = trained_policy(["q_proj"])
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.mul_(1e-4)
    policy.store_frozen_in_bf16()
    parent, name, layer = lora_slots(policy.model)[0]
    delta = layer.get_delta_weight("default").detach()
    weight = layer.base_layer.weight
    kept = ((weight.float() + delta).to(torch.bfloat16) != weight).float().mean()
    assert kept < 0.1, kept  # merged in bf16, the update would be gone from 90% of the weights (measured 95%)
    x = torch.randn(6, layer.in_features)
    with torch.no_grad(), BF16:
        own_pass = llama.linear(layer)(x)
        base = layer.base_layer(x)
        with merged_adapters([(parent, name, layer)]):
            swapped = getattr(parent, name)
            assert isinstance(swapped, LowRankLinear)
            ours = swapped(x)
    # the base product of x rounded to bf16 (as autocast rounds it), the update of x itself, in float64
    exact = x.to(torch.bfloat16).double() @ weight.double().t() + x.double() @ delta.double().t()
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, own_pass) and not torch.equal(ours, base)
    assert ((ours.double() - exact).abs() <= exact.abs() * 2**-7).all()  # two bf16 roundings: the base's, the sum's


def test_bf16_sampling_goes_through_low_rank_and_packed_bf16_layers_and_puts_them_back(monkeypatch):
    monkeypatch.setattr(packed, "MIN_WEIGHTS", 2**17)  # a bound above the key and value maps' 110,592 weights
    model = lora_smollm2_shaped(2)
    frozen_linears_to_bf16(model)
    before = dict(model.named_modules())
    with merged_adapters(lora_slots(model)), packed_linears(model):
        kinds = {name: type(m).__name__ for name, m in model.named_modules()
                 if isinstance(m, (PackedLinear, LowRankLinear, torch.nn.Linear))}
        x = torch.randn(5, 576)
        with torch.no_grad(), BF16:
            out = model.base_model.model.model.layers[0].self_attn.q_proj(x)
    assert kinds["base_model.model.model.layers.0.self_attn.q_proj"] == "LowRankLinear"
    assert kinds["base_model.model.model.layers.0.self_attn.k_proj"] == "LowRankLinear"
    packs = packed.available_bf16()  # oneDNN multiplies bf16 natively here
    assert kinds["base_model.model.model.layers.0.self_attn.q_proj.base"] == ("PackedLinear" if packs else "Linear")
    assert kinds["base_model.model.model.layers.0.self_attn.k_proj.base"] == "Linear"  # below MIN_WEIGHTS
    assert kinds["base_model.model.lm_head"] == ("PackedLinear" if packs else "Linear")
    assert out.dtype == torch.bfloat16
    assert dict(model.named_modules()) == before


def test_bf16_sampler_log_probs_stay_near_the_training_pass():
    """The sampler's log-prob of each token (logp_old when algo.epochs > 1, PPO) and the training
    pass's differ by the rounding of two orders of bf16 operations: measured at most 0.03 (one step
    of a logit's rounding near 5) and 0.005 on average, against 2e-6 in float32 (a Zen 5 EPYC); at
    most 0.057, 0.008 on average on an AMX Xeon."""
    policy = trained_policy()
    policy.store_frozen_in_bf16()
    rollout = sampled(policy, "bf16")
    diff = (rollout.logprobs - logprobs(policy, rollout, "bf16"))[rollout.completion_mask.bool()].abs()
    assert diff.max() < 0.1 and diff.mean() < 0.02, (diff.max(), diff.mean())


@pytest.mark.parametrize("chunk", [head.LOGIT_CHUNK, 2**10], ids=["one-block", "blocks-of-columns"])
def test_bf16_lora_gradients_point_where_float32_ones_do(chunk, monkeypatch):
    """One update's direction agrees: the LoRA gradient of the summed log-probs in bf16 against
    float32, cosine above 0.99 and norms within 5% (measured 0.9999 and 0.2%); also where the head
    goes through the vocabulary a few columns at a time, as it does for SmolLM2's."""
    monkeypatch.setattr(head, "LOGIT_CHUNK", chunk)
    policy = trained_policy()
    rollout = sampled(policy)
    n = rollout.completion_ids.shape[1]

    def gradient(p, precision):
        p.model.zero_grad()
        with mixed_precision(precision, CPU):
            (p.logprobs(rollout.input_ids, rollout.attention_mask, n) * rollout.completion_mask).sum().backward()
        return torch.cat([q.grad.reshape(-1) for q in p.trainable_parameters()])

    low = copy.deepcopy(policy)
    low.store_frozen_in_bf16()
    exact, ours = gradient(policy, "fp32"), gradient(low, "bf16")
    assert {q.grad.dtype for q in low.trainable_parameters()} == {torch.float32}
    cosine = torch.nn.functional.cosine_similarity(exact, ours, dim=0)
    assert cosine > 0.99 and abs(ours.norm() / exact.norm() - 1) < 0.05, (cosine, ours.norm() / exact.norm())


def test_values_are_float32_under_bf16_autocast():
    policy = trained_policy()
    rollout = sampled(policy)
    policy.store_frozen_in_bf16()
    head = value_head(policy.model.config.hidden_size, CPU)
    torch.nn.init.normal_(head.weight)
    with BF16:
        logp, values, _ = logprobs_and_values(policy, head, rollout.input_ids, rollout.attention_mask,
                                              rollout.completion_ids.shape[1])
    assert logp.dtype == values.dtype == torch.float32


def test_rewards_of_a_reward_model_head_are_float32_under_bf16_autocast():
    from rlnotes.engine.sequences import encode
    from rlnotes.rewards.model import make_head, sequence_rewards

    policy = trained_policy()
    policy.store_frozen_in_bf16()
    seqs = encode(policy.tokenizer, PROMPTS, ["yes", "no", "A", "B"], CPU, chat_template=False)
    with BF16, torch.no_grad():
        assert sequence_rewards(policy.model, make_head(policy.model), seqs).dtype == torch.float32


def test_bf16_on_a_cpu_without_bf16_units_is_refused_and_auto_keeps_fp32(monkeypatch):
    monkeypatch.setattr(devices, "bf16_units", lambda device: None)
    with pytest.raises(ConfigError, match=r"hardware.precision=bf16: .* has no bf16 matmul instructions \(amx_bf16 or "
                                          r"avx512_bf16\).*use hardware.precision=fp32, or auto"):
        check_precision("bf16", CPU)
    assert choose_precision("auto", CPU, 10**9) == ("fp32", choose_precision("auto", CPU, 10**9)[1])
    assert "has no bf16 units" in choose_precision("auto", CPU, 10**9)[1]
    assert choose_precision("fp32", CPU, 10**9) == ("fp32", "")
    monkeypatch.setattr(devices, "bf16_units", lambda device: "avx512_bf16")
    assert choose_precision("bf16", CPU, 100) == ("bf16", "bf16 (avx512_bf16)")
    assert choose_precision("auto", CPU, 135_000_000) == (
        "bf16", "bf16 (avx512_bf16): hardware.precision=auto, 135.00M parameters")
    assert choose_precision("auto", CPU, 110_000) == (
        "fp32", "fp32: hardware.precision=auto, 0.11M parameters, fewer than 20M")


def test_the_cpus_own_bf16_units_are_found():
    features = torch.cpu.get_capabilities()
    expected = next((f for f in devices.CPU_BF16_FEATURES if features.get(f)), None)
    assert devices.bf16_units(CPU) == expected


def test_a_run_refuses_bf16_without_units_before_the_model_loads(tmp_path, monkeypatch):
    """In the config's check (rlnotes check, and every command before it starts) and, for a config
    built otherwise, in the run's setup before the model loads."""
    from rlnotes.commands.check import UsageError, check
    from rlnotes.commands.train import train
    from tests.conftest import compose

    cfg = compose("hardware.precision=bf16", "trainer.steps=1", "logging.progress=false")
    monkeypatch.setattr(devices, "bf16_units", lambda device: None)
    with pytest.raises(UsageError, match="has no bf16 matmul instructions"):
        check(["hardware.precision=bf16"], multirun=False, config_dir=None)
    check(["hardware.precision=auto"], multirun=False, config_dir=None)
    monkeypatch.setattr(Policy, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="has no bf16 matmul instructions"):
        train(cfg, tmp_path, Console(quiet=True))
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.long
def test_grpo_learns_the_letter_in_bf16(tmp_path, bf16_cpu):
    """The float32 learning test's task and margins (tests/algos/test_grpo.py), in bf16; the start
    line says the precision."""
    from rlnotes.commands.train import train
    from tests.conftest import compose

    console = Console(record=True, width=200)
    train(compose("logging.progress=false", "hardware.precision=bf16", "trainer.steps=50"), tmp_path, console)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1 and last > first + 0.4, (first, last)
    assert rows[-1]["kl/ref"] > rows[0]["kl/ref"]
    assert f"bf16 ({devices.bf16_units(CPU)})" in console.export_text()
