"""Position-wise layers skip padding (rlnotes.engine.policy.padding): same outputs at real positions, same
gradients, and the skipped positions really are not computed."""

from __future__ import annotations

import pytest
import torch
from test_shared_prompt import group_batch, lora_smollm2_shaped, tiny_policy

from rlnotes.engine.policy import padding
from rlnotes.engine.policy.llama import LlamaLayers
from rlnotes.engine.policy.padding import forward_real, position_wise, skip_padding
from rlnotes.engine.policy.passes import position_ids, sequence_logprobs


@pytest.fixture(autouse=True)
def always(monkeypatch):
    """Skip padding however little it saves: these tests' models are small."""
    monkeypatch.setattr(padding, "MIN_SAVING", 0)


def rows_seen(module: torch.nn.Module, run) -> int:
    """The positions `module` computed while `run()` ran."""
    seen = []
    hook = module.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1].numel()))
    try:
        run()
    finally:
        hook.remove()
    return sum(seen)


@pytest.mark.parametrize("own", [True, False], ids=["own pass", "model's forward"])
def test_mlp_and_projections_compute_the_real_positions_only(monkeypatch, own):
    """Through rlnotes' own pass of the Llama family (rlnotes.engine.policy.llama) and through the
    model's forward with its position-wise layers swapped (what other architectures take)."""
    if not own:
        monkeypatch.setattr(LlamaLayers, "of", classmethod(lambda cls, model: None))
    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size)
    layer = model.base_model.model.model.layers[0]
    run = lambda: sequence_logprobs(model, ids, attn, mask.shape[1], share_prompts=False)  # noqa: E731
    # inside the MLP and under the LoRA q projection: what the packed layers hand on
    assert rows_seen(layer.mlp.gate_proj, run) == int(attn.sum()) < attn.numel()
    assert rows_seen(layer.self_attn.q_proj.base_layer, run) == int(attn.sum())
    assert rows_seen(layer.self_attn.q_proj.lora_A["default"], run) == int(attn.sum())
    names = {type(m).__name__ for m in position_wise(model)}
    assert names == {"LlamaMLP", "Linear"} and len(position_wise(model)) == 5 * model.config.num_hidden_layers


@pytest.mark.parametrize("build", ["tiny", "smollm2-shaped"])
def test_hidden_states_and_gradients_at_real_positions_are_the_whole_rectangles(build):
    model = tiny_policy() if build == "tiny" else lora_smollm2_shaped()
    ids, attn, _ = group_batch(model.config.vocab_size, prompt_lengths=(4, 9), group=2, prefix=3)
    real = attn.bool()
    weights = torch.randn(attn.shape + (model.config.hidden_size,), generator=torch.Generator().manual_seed(2))
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for skip in (True, False):
        call = forward_real if skip else lambda m, **kw: m(**kw)
        hidden = call(model, input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False,
                      output_hidden_states=True).hidden_states[-1]
        out[skip] = hidden[real], torch.autograd.grad((hidden[real] * weights[real]).sum(), params)
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(out[True][1], out[False][1]):
        assert b.norm() > 0 and float((a - b).norm() / b.norm()) < 1e-4


def test_gpt2_style_layers_skip_padding_too():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64)).eval()
    assert {type(m).__name__ for m in position_wise(model)} == {"GPT2MLP", "Conv1D"}
    ids, attn, _ = group_batch(64, prompt_lengths=(3, 7), group=2)
    kwargs = dict(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn))
    with torch.no_grad():
        got, expected = forward_real(model, **kwargs).logits, model(**kwargs).logits
        assert rows_seen(model.transformer.h[0].mlp.c_fc, lambda: forward_real(model, **kwargs)) == int(attn.sum())
    torch.testing.assert_close(got[attn.bool()], expected[attn.bool()], atol=1e-5, rtol=1e-5)


def test_the_layers_are_put_back_after_the_block_and_after_an_error():
    model = tiny_policy()
    modules = position_wise(model)
    mlp = model.base_model.model.model.layers[1].mlp
    own = mlp.forward = lambda x: type(mlp).forward(mlp, x)  # a forward set on the instance by someone else
    real = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(RuntimeError, match="inside"):
        with skip_padding(model, real):
            assert all("forward" in m.__dict__ for m in modules)
            raise RuntimeError("inside")
    assert mlp.__dict__["forward"] is own
    assert not any("forward" in m.__dict__ for m in modules if m is not mlp)
    with skip_padding(model, torch.ones(2, 3)):  # nothing to skip: nothing changes
        assert not any("forward" in m.__dict__ for m in modules if m is not mlp)


def test_an_input_of_another_size_goes_through_whole():
    model = tiny_policy()
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad(), skip_padding(model, torch.tensor([[0, 1, 1]])):
        torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x))
        assert rows_seen(mlp.down_proj, lambda: mlp(torch.randn(1, 3, model.config.hidden_size))) == 2


def test_padding_is_skipped_only_where_it_saves_enough_work(monkeypatch):
    monkeypatch.setattr(padding, "MIN_SAVING", 4_000_000)
    for model, packed in ((tiny_policy(), False), (lora_smollm2_shaped(), True)):
        ids, attn, _ = group_batch(model.config.vocab_size, prompt_lengths=(4, 30), group=2)
        seen = rows_seen(model.base_model.model.model.layers[0].mlp.up_proj,
                         lambda: forward_real(model, input_ids=ids, attention_mask=attn, use_cache=False))
        assert seen == (int(attn.sum()) if packed else attn.numel())
