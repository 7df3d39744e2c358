"""Sampling through linear layers packed for oneDNN (rlnotes.engine.policy.packed): the plain layers' outputs,
the same completions, only the layers it pays for, and everything back in place after."""

import pytest
import torch
from test_merged import sample, trained_policy
from test_shared_prompt import lora_smollm2_shaped

from rlnotes.engine.policy import packed
from rlnotes.engine.policy.merged import MergedLinear, lora_slots, merged_adapters
from rlnotes.engine.policy.packed import PackedLinear, packed_linears

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no working oneDNN linear")
RULE = packed.float32_packs  # the rule itself: conftest stands in for it in every test


def test_a_packed_linear_computes_the_plain_one():
    torch.manual_seed(0)
    layer = torch.nn.Linear(500, 300)
    fast = PackedLinear(layer.weight, layer.bias)
    for x in (torch.randn(7, 500), torch.randn(3, 5, 500)):
        with torch.no_grad():
            torch.testing.assert_close(fast(x), layer(x), atol=1e-5, rtol=1e-5)
    x = torch.randn(4, 500, requires_grad=True)  # with gradients: through the plain weight
    fast(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, -1))


@pytest.mark.skipif(not packed.available_bf16(), reason="oneDNN has no native bf16 matmul on this CPU")
def test_a_packed_bf16_linear_computes_the_plain_one_under_autocast():
    """A bf16 weight (hardware.precision=bf16): float32 inputs rounded to bf16 as autocast rounds them;
    outputs equal up to bf16's rounding of the result (2^-8 relative)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(500, 300).to(torch.bfloat16)
    fast = PackedLinear(layer.weight, layer.bias)
    for x in (torch.randn(7, 500), torch.randn(3, 5, 500).bfloat16()):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out, plain = fast(x), layer(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, plain, atol=1e-2, rtol=2**-8)


@pytest.mark.parametrize("greedy", [False, True])
def test_packed_sampling_gives_the_same_completions_and_log_probs(monkeypatch, greedy):
    monkeypatch.setattr(packed, "MIN_WEIGHTS", 0)  # every layer of the tiny model
    policy = trained_policy()
    seen = []
    with policy.sampling() as model:
        seen = [type(m) for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(seen) == 7 * policy.model.config.num_hidden_layers + 1  # q k v o gate up down, and the head
    plain, fast = sample(policy, True, greedy=greedy, pack=False), sample(policy, True, greedy=greedy)
    assert torch.equal(plain.completion_ids, fast.completion_ids) and plain.texts == fast.texts
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=0)


def test_only_large_layers_are_packed_and_all_come_back(monkeypatch):
    monkeypatch.setattr(packed, "MIN_WEIGHTS", 2**17)  # a bound above the key and value maps' 110,592 weights
    model = lora_smollm2_shaped()
    before = dict(model.named_modules())
    with merged_adapters(lora_slots(model)), packed_linears(model):
        kinds = {name.split(".")[-1]: type(m).__name__ for name, m in model.named_modules()
                 if isinstance(m, (PackedLinear, MergedLinear, torch.nn.Linear))}
    # 576 x 192 key and value maps are below the bound; the rest (and the 49152-token head) are packed
    assert kinds == {"q_proj": "PackedLinear", "o_proj": "PackedLinear", "k_proj": "MergedLinear",
                     "v_proj": "MergedLinear", "gate_proj": "PackedLinear", "up_proj": "PackedLinear",
                     "down_proj": "PackedLinear", "lm_head": "PackedLinear"}
    assert dict(model.named_modules()) == before
    model.to(torch.bfloat16)  # bf16 weights are packed where oneDNN multiplies bf16 natively
    with pytest.raises(RuntimeError, match="inside"), packed_linears(model):
        assert any(isinstance(m, PackedLinear) for m in model.modules()) == packed.available_bf16()
        raise RuntimeError("inside")
    assert dict(model.named_modules()) == before


def test_without_onednn_nothing_is_swapped(monkeypatch):
    monkeypatch.setattr(packed, "available", lambda: False)
    monkeypatch.setattr(packed, "MIN_WEIGHTS", 0)
    policy = trained_policy()
    with policy.sampling() as model:
        assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_a_frozen_linear_gives_the_layers_outputs_and_input_gradients_with_kept_packs():
    torch.manual_seed(0)
    layer = torch.nn.Linear(500, 300).requires_grad_(False)
    fast = packed.frozen_linear(layer)
    x = torch.randn(7, 500, requires_grad=True)
    y = fast(x)
    torch.testing.assert_close(y, layer(x), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    expected, = torch.autograd.grad(layer(x), x, g)
    mine, = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
    kept = [packed.kept_packing(layer.weight), packed.kept_packing(layer.weight, True)]
    assert [packed.kept_packing(layer.weight), packed.kept_packing(layer.weight, True)] == kept  # kept, not made again
    with torch.no_grad():
        layer.weight.mul_(2)  # changed in place: packed again, and the outputs follow
        torch.testing.assert_close(fast(x), layer(x), atol=1e-5, rtol=1e-5)
    assert packed.kept_packing(layer.weight) is not kept[0]
    # a weight that trains, a small one, or bf16 autocast: the plain layer's own product
    assert packed.frozen_linear(torch.nn.Linear(500, 300)) is None
    assert packed.frozen_linear(torch.nn.Linear(8, 8).requires_grad_(False)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast(x).dtype == torch.bfloat16


def test_a_kept_pack_goes_with_its_weight():
    layer = torch.nn.Linear(500, 300).requires_grad_(False)
    packed.kept_packing(layer.weight)
    key = (id(layer.weight), False, None)
    assert key in packed._KEPT
    del layer
    assert key not in packed._KEPT


def test_float32_weights_stay_with_mkl_on_an_intel_cpu_and_bf16_ones_are_packed(monkeypatch):
    """packed.float32_packs is false on Intel's CPUs (MKL as fast as oneDNN there): no float32
    weight is packed, for sampling or kept for the passes; bf16 weights still are."""
    monkeypatch.setattr(packed, "MIN_WEIGHTS", 0)
    layer = torch.nn.Linear(64, 32).requires_grad_(False)
    assert packed.packed_frozen(layer.weight) and packed.frozen_linear(layer) is not None  # the rule off (conftest)
    monkeypatch.setattr(packed, "float32_packs", lambda: False)
    assert not packed.packed_frozen(layer.weight) and packed.frozen_linear(layer) is None
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16).to(torch.bfloat16))
    with packed_linears(model):
        kinds = [type(m).__name__ for m in model]
    assert kinds == ["Linear", "PackedLinear" if packed.available_bf16() else "Linear"]


def test_the_rule_reads_the_cpus_vendor():
    """By the name torch's CPU capabilities give (this Xeon: "Intel Xeon"); an unnamed CPU keeps the
    packs, as before the rule."""
    assert not RULE("Intel Xeon") and not RULE("Intel Core i7-12700")
    assert RULE("AMD EPYC 9B45") and RULE("")
