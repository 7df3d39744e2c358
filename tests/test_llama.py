"""rlnotes' own forward pass of the Llama family (rlnotes.engine.policy.llama): the hidden states and
gradients of the model's own forward for every family it takes (grouped-query attention, biases,
RoPE scalings, left and right padding, a KV cache before the tokens, LoRA on and off, every weight
training, bf16), dropout where training asks for it, modules it does not know called as modules,
and the model's forward for everything else."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_decoder import ROPES, family_model
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from rlnotes.engine.model.precision import frozen_linears_to_bf16
from rlnotes.engine.policy import packed, padding, passes
from rlnotes.engine.policy.llama import LlamaLayers, attention_mask
from rlnotes.engine.policy.passes import position_ids

ADAPTED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def adapted(model, dropout: float = 0.0, **options):
    """`model` with a LoRA adapter whose B is not 0 (so the adapter changes the output)."""
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=ADAPTED,
                                             **options))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=g)
    return model


def batch(vocab: int, rows: int = 4, length: int = 11):
    """Token ids with left padding (prompts of different lengths) and right padding (a completion
    that ended early), and the positions that follow the mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, :4], mask[2, :2], mask[0, -3:] = 0, 0, 0
    return ids, mask, position_ids(mask)


def theirs(model, ids, mask, positions, cache=None):
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                 output_hidden_states=True).hidden_states[-1]


def ours(model, ids, mask, positions, cache=None):
    return LlamaLayers.of(model).hidden(ids, mask, positions, cache)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def assert_same_pass(model, ids, mask, positions, atol=2e-5):
    """Hidden states at real positions and the gradients of a weighted sum of them: ours and theirs."""
    real = mask[:, -ids.shape[1]:].bool()
    weights = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    out = {}
    for name, run in (("theirs", theirs), ("ours", ours)):
        hidden = run(model, ids, mask, positions)[real]
        out[name] = hidden, torch.autograd.grad((hidden * weights[real]).sum(), trainable(model), allow_unused=True)
    torch.testing.assert_close(out["ours"][0], out["theirs"][0], atol=atol, rtol=1e-4)
    used = [(a, b) for a, b in zip(out["ours"][1], out["theirs"][1]) if b is not None]  # not the LM head
    assert len(used) >= len(out["theirs"][1]) - 1
    for mine, expected in used:
        assert expected.norm() > 0
        torch.testing.assert_close(mine, expected, atol=1e-4 * float(expected.abs().max()), rtol=1e-4)


@pytest.fixture(params=[False, True], ids=["plain weights", "frozen weights packed"])
def pack(request, monkeypatch):
    """The frozen weights through oneDNN with kept packed copies (packed.frozen_linear), however small."""
    if request.param:
        if not packed.available():
            pytest.skip("this torch has no working oneDNN linear")
        monkeypatch.setattr(packed, "MIN_WEIGHTS", 0)
    return request.param


@pytest.fixture(params=[False, True], ids=["padding computed", "real positions gathered"])
def gather(request, monkeypatch):
    """The own pass gathers the real positions however little that saves (padding.MIN_SAVING 0);
    else these small models compute their few padding positions like real ones (llama.Slots)."""
    if request.param:
        monkeypatch.setattr(padding, "MIN_SAVING", 0)
    return request.param


@pytest.mark.parametrize("family, rope", [("llama", None), ("qwen2", None), ("mistral", None), ("llama", "linear"),
                                          ("llama", "dynamic")])
def test_hidden_states_and_lora_gradients_are_the_models(family, rope, pack, gather):
    model = adapted(family_model(family, **ROPES.get(rope, {}))).train()
    kept = len(packed._KEPT)
    ids, mask, positions = batch(model.config.vocab_size)
    assert LlamaLayers.of(model).gathers(int((mask == 0).sum())) == gather
    assert_same_pass(model, ids, mask, positions)
    assert (len(packed._KEPT) > kept) == pack  # W and W^T of the frozen weights, kept


def test_every_weight_training_gets_the_models_gradients():
    model = family_model("llama").train()
    assert_same_pass(model, *batch(model.config.vocab_size))


def test_the_reference_is_the_base_with_the_adapter_off(gather):
    model = adapted(family_model("qwen2"))
    ids, mask, positions = batch(model.config.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        on = ours(model, ids, mask, positions)
        with model.disable_adapter():
            off, expected = ours(model, ids, mask, positions), theirs(model, ids, mask, positions)
    torch.testing.assert_close(off[real], expected[real], atol=2e-5, rtol=1e-4)
    assert (on[real] - off[real]).abs().max() > 0.1  # the adapter counts when on
    assert off[~real].abs().max() == 0  # padding positions are 0


def test_tokens_after_a_cache_attend_to_it_as_in_the_model(pack, gather):
    """A prompt pass into a cache, then the rest against it (passes.completion_states' two passes),
    gradients flowing through the cache into the prompt pass."""
    model = adapted(family_model("mistral")).train()
    ids, mask, positions = batch(model.config.vocab_size)
    width = 6
    weights = torch.randn(len(ids), ids.shape[1] - width, model.config.hidden_size)
    real = mask[:, width:].bool()
    out = {}
    for name, run in (("theirs", theirs), ("ours", ours)):
        cache = DynamicCache(config=model.config)
        run(model, ids[:, :width], mask[:, :width], positions[:, :width], cache)
        hidden = run(model, ids[:, width:], mask, positions[:, width:], cache)[real]
        out[name] = hidden, torch.autograd.grad((hidden * weights[real]).sum(), trainable(model))
    torch.testing.assert_close(out["ours"][0], out["theirs"][0], atol=2e-5, rtol=1e-4)
    for mine, expected in zip(out["ours"][1], out["theirs"][1]):
        torch.testing.assert_close(mine, expected, atol=1e-4 * float(expected.abs().max()), rtol=1e-4)


def test_bf16_weights_under_autocast_give_the_models_states():
    """Under bf16 autocast the own pass computes the adapter's update and the attention in float32,
    where the model's forward rounds them to bf16: its states are nearer the model's float32 ones than
    the model's own bf16 forward is, on average (measured 0.0122 against 0.0131; at most 0.119
    against 0.121)."""
    model = adapted(family_model("llama"))
    ids, mask, positions = batch(model.config.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        exact = theirs(model, ids, mask, positions)[real]
        frozen_linears_to_bf16(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mine, expected = ours(model, ids, mask, positions), theirs(model, ids, mask, positions)
    assert mine.dtype == expected.dtype
    ours_off, model_off = (mine[real].float() - exact).abs(), (expected[real].float() - exact).abs()
    assert ours_off.mean() < model_off.mean() and ours_off.max() < 1.25 * model_off.max(), (ours_off, model_off)


def test_the_mask_lets_each_query_see_the_real_columns_up_to_its_own():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    allowed = attention_mask(mask, 2)[:, 0]  # the last two columns are the queries
    assert allowed.tolist() == [[[False, True, True, False], [False, True, True, True]],
                                [[True, True, True, False], [True, True, True, True]]]  # a padding query: itself


def test_lora_dropout_drops_while_training_only():
    model = adapted(family_model("llama"), dropout=0.5)
    ids, mask, positions = batch(model.config.vocab_size)
    real = mask.bool()
    with torch.no_grad():
        evaluated = ours(model.eval(), ids, mask, positions)[real]
        torch.testing.assert_close(evaluated, theirs(model, ids, mask, positions)[real], atol=2e-5, rtol=1e-4)
        torch.manual_seed(0)
        first = ours(model.train(), ids, mask, positions)[real]
        second = ours(model, ids, mask, positions)[real]
    assert (first - evaluated).abs().max() > 1e-3 and (first - second).abs().max() > 1e-3


def test_attention_dropout_while_training_goes_through_the_model():
    model = family_model("llama", attention_dropout=0.1)
    assert LlamaLayers.of(model.eval()) is not None and LlamaLayers.of(model.train()) is None


@pytest.mark.parametrize("case", ["dora", "hook"])
def test_modules_it_does_not_compute_are_called_as_modules(case, gather):
    """A LoRA variant (DoRA) and a module with a forward hook: their module's own call, so the pass
    is still the model's (and the hook sees it)."""
    model = adapted(family_model("llama"), use_dora=case == "dora").train()
    seen = []
    if case == "hook":
        layer = model.base_model.model.model.layers[1].self_attn.k_proj.lora_A["default"]
        layer.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1].numel()))
    ids, mask, positions = batch(model.config.vocab_size)
    assert_same_pass(model, ids, mask, positions)
    if case == "hook":  # the model's forward sees the rectangle, ours the real positions where it gathers them
        assert seen == [mask.numel(), int(mask.sum()) if gather else mask.numel()]


def test_other_models_go_through_their_own_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).eval()
    assert LlamaLayers.of(gpt2) is None
    ids, mask, positions = batch(50)
    hidden = passes.states(gpt2, ids, mask, positions)
    torch.testing.assert_close(hidden[mask.bool()], theirs(gpt2, ids, mask, positions)[mask.bool()])


def test_prompt_logits_are_the_models():
    model = adapted(family_model("qwen2"))
    ids, mask, positions = batch(model.config.vocab_size)
    mask[0, -3:] = 1  # prompts are left-padded only
    with torch.no_grad():
        logits = passes.states(model, ids, mask, positions, logits=True)
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
