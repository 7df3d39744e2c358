"""Sampling through merged LoRA weights: the same completions and log-probs as through the adapter,
the base weights untouched, and layers that cannot merge left alone."""

import pytest
import torch
from omegaconf import OmegaConf

from rlnotes.core.schema import ModelConfig
from rlnotes.engine.policy.merged import MergedLinear, lora_slots, merged_weight
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.prompts import encode_prompts
from rlnotes.engine.sampling.generate import generate
from rlnotes.engine.sampling.settings import SamplingSettings

PROMPTS = ["Write the letter a:", "What is 2+3?", "Hi"]


def trained_policy(targets=("all-linear",), seed=0):
    """A tiny policy whose adapter has moved away from zero (lora_B random), as after training."""
    torch.manual_seed(seed)
    cfg = OmegaConf.structured(ModelConfig(name_or_path="tiny"))
    cfg.lora.target_modules = list(targets)
    policy = Policy.from_config(cfg, torch.device("cpu"))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    policy.eval()
    return policy


def sample(policy, merge, seed=0, pack=True, **kw):
    ids = encode_prompts(policy.tokenizer, PROMPTS, chat_template=False)
    with policy.sampling(merge, pack) as model:
        return generate(model, policy.tokenizer, ids, 4, SamplingSettings(12, **kw),
                        torch.Generator().manual_seed(seed))


def test_merged_weight_is_w_plus_scaled_b_a():
    policy = trained_policy(["q_proj"])
    layer = lora_slots(policy.model)[0][2]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + (layer.lora_alpha["default"] / layer.r["default"]) * (b @ a)
    torch.testing.assert_close(merged_weight(layer), expected, atol=1e-6, rtol=1e-6)
    x = torch.randn(5, layer.in_features)
    torch.testing.assert_close(MergedLinear(merged_weight(layer), layer.base_layer.bias)(x), layer(x),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("greedy", [False, True])
def test_merged_sampling_gives_the_adapters_completions_and_log_probs(greedy):
    policy = trained_policy()
    through, merged = sample(policy, False, greedy=greedy), sample(policy, True, greedy=greedy)
    assert torch.equal(through.completion_ids, merged.completion_ids) and through.texts == merged.texts
    torch.testing.assert_close(merged.logprobs, through.logprobs, atol=1e-5, rtol=0)
    # and they are the log-probs a training pass (through the adapter) computes for those tokens
    recomputed = sequence_logprobs(policy.model, merged.input_ids, merged.attention_mask,
                                   merged.completion_ids.shape[1])
    torch.testing.assert_close(recomputed * merged.completion_mask, merged.logprobs, atol=1e-5, rtol=0)


def test_the_adapter_changes_the_samples_so_the_comparison_means_something():
    policy = trained_policy()
    with policy.reference() as ref:
        ids = encode_prompts(policy.tokenizer, PROMPTS, chat_template=False)
        base = generate(ref, policy.tokenizer, ids, 4, SamplingSettings(12, greedy=True),
                        torch.Generator().manual_seed(0))
    assert not torch.equal(base.completion_ids, sample(policy, True, greedy=True).completion_ids)


def test_layers_are_swapped_only_inside_the_block_and_base_weights_stay_bitwise():
    policy = trained_policy()
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    layers = [layer for _, _, layer in lora_slots(policy.model)]
    with policy.sampling() as model:
        assert not lora_slots(model) and sum(isinstance(m, MergedLinear) for m in model.modules()) == len(layers)
    assert [layer for _, _, layer in lora_slots(policy.model)] == layers
    assert all(torch.equal(before[n], p) for n, p in policy.model.named_parameters())
    with policy.sampling(merge=False) as model:  # rollout.merge_adapter=false: through the adapter
        assert [layer for _, _, layer in lora_slots(model)] == layers


def test_an_error_while_sampling_puts_the_adapter_back():
    policy = trained_policy()
    with pytest.raises(RuntimeError, match="reward"):
        with policy.sampling():
            raise RuntimeError("reward function failed")
    assert len(lora_slots(policy.model)) > 0 and not any(isinstance(m, MergedLinear) for m in policy.model.modules())


def test_low_precision_weights_and_a_disabled_adapter_are_not_merged():
    policy = trained_policy(["q_proj"])
    policy.model.to(torch.bfloat16)  # s B A would be lost to bfloat16's rounding of W
    with policy.sampling():
        assert not any(isinstance(m, MergedLinear) for m in policy.model.modules())
    policy = trained_policy(["q_proj"])
    with policy.reference(), policy.sampling():  # the base model samples: nothing to merge
        assert not any(isinstance(m, MergedLinear) for m in policy.model.modules())


def test_full_finetuning_has_nothing_to_merge():
    cfg = OmegaConf.structured(ModelConfig(name_or_path="tiny"))
    cfg.lora = None
    policy = Policy.from_config(cfg, torch.device("cpu"))
    with policy.sampling() as model:
        assert model is policy.model and not any(isinstance(m, MergedLinear) for m in model.modules())
