"""The Llama family's forward pass (Llama, Qwen2, Mistral) written as plain tensor operations, for the
training and reference passes and the prompt pass before sampling.

The model's own forward spends most of a small model's pass in Python around its matmuls: masks built
for every attention implementation, output records, kwargs checks, a module call per linear map and
peft's per-call adapter bookkeeping. Here, over the real (not padding) positions of [B, T] rows
gathered into one [N, H] matrix x, layer by layer,

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q, p), RoPE(k, p)
    Q, K, V = q, k, v scattered into their [B, T] slots (0 at padding);  K, V = [K_cache; K], [V_cache; V]
    x = x + (softmax(Q K^T / sqrt(d) + M) V)[real] Wo
    x = x + (act(h' Wgate) * h' Wup) Wdown,  h' = RMSNorm(x)

and the last layer's output after the final RMSNorm, with W x = W0 x + s B A dropout(x) for a LoRA
layer whose adapter is on (W0 x with it off: the reference). M allows key column j for the query in
column i when j is a real column at or before i (the cache's columns first); a padding query keeps
its own column, so no softmax row is empty (its output is never read). The queries that share a key
and value head (grouped-query attention) are grouped by scaled_dot_product_attention, not repeated;
on a CPU under bf16 autocast it runs in float32 (attend).

The hidden states at real positions equal the model's own (`output_hidden_states`' last entry) up to
float32 rounding, and so do the gradients through them; positions of padding are 0. A module this
pass does not know how to compute as plain operations (another adapter type, a module with hooks) is
called as a module, so it computes what it computes in the model. Other architectures, sliding-window
attention, attention dropout while training and sharded (FSDP) weights go through the model's forward.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.policy.merged import LowRankLinear, MergedLinear, add_update
from rlnotes.engine.policy.packed import PackedLinear, frozen_linear

# The causal LMs whose decoder layers compute exactly the layer above; their attention, MLP and norm
# classes are checked too, so a subclass that changes one of them is not taken for the family.
FAMILIES = ("Llama", "Qwen2", "Mistral")

Linear = Callable[[torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps), in float32 and back to x's dtype before the weight, as the
    Llama family's RMSNorm."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    h = x.float()
    return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _lora(layer, pack_frozen: bool) -> Optional[Linear]:
    """x -> the peft LoRA linear layer's output, W0 x + sum over its active adapters of s B A dropout(x)
    (W0 x with its adapters off), or None where it computes something else (a variant such as DoRA,
    a LoRA bias, a merged adapter, a base layer that is not a plain linear map)."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(layer) is not LoraLinear or layer.merged or _hooked(layer):
        return None
    base = linear(layer.base_layer, pack_frozen)
    if layer.disable_adapters:
        return base
    terms = []
    for a in (a for a in layer.active_adapters if a in layer.lora_A):
        parts = (layer.lora_A[a], layer.lora_B[a], layer.lora_dropout[a])
        if (a in layer.lora_variant or layer.lora_bias[a] or any(map(_hooked, parts))
                or type(parts[2]) not in (torch.nn.Dropout, torch.nn.Identity)):
            return None
        p = parts[2].p if type(parts[2]) is torch.nn.Dropout and parts[2].training else 0.0
        terms.append((parts[0].weight, parts[1].weight, layer.scaling[a], p))

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = base(x)
        for a, b, scale, p in terms:
            y = add_update(y, x, a, b, scale, p)  # in the adapter's float32, also under bf16 autocast
        return y
    return forward


def linear(module: torch.nn.Module, pack_frozen: bool = True) -> Linear:
    """x -> module(x), without the module call around it where the module is a plain linear map
    (nn.Linear, a merged, low-rank or packed layer for sampling, a plain peft LoRA layer) and has no
    hooks; else the module itself. `pack_frozen`: a large frozen nn.Linear (a LoRA layer's base too)
    multiplies through oneDNN with packed copies of its weight kept between passes (frozen_linear)."""
    if _hooked(module):
        return module
    if type(module) in (torch.nn.Linear, MergedLinear):
        return (pack_frozen and frozen_linear(module)) or functools.partial(F.linear, weight=module.weight,
                                                                           bias=module.bias)
    if type(module) in (PackedLinear, LowRankLinear):
        return module.forward
    return _lora(module, pack_frozen) or module


def family(model) -> Optional[str]:
    """The family of FAMILIES whose classes make up `model` (a causal LM), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        return None
    for name in FAMILIES:
        def named(module, part):
            return type(module).__name__ == f"{name}{part}"

        if named(model, "ForCausalLM") and named(model.model.norm, "RMSNorm") and all(
                named(layer, "DecoderLayer") and named(layer.self_attn, "Attention") and named(layer.mlp, "MLP")
                and named(layer.input_layernorm, "RMSNorm") and named(layer.post_attention_layernorm, "RMSNorm")
                for layer in layers):
            return name
    return None


def computed_family(model) -> Optional[torch.nn.Module]:
    """The causal LM inside `model` (itself, or the base model of a peft model) when its layers are
    those of FAMILIES with full attention and whole weights, else None (sliding windows, FSDP shards)."""
    if is_sharded(model):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    found = family(inner)
    if found is None:
        return None
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in inner.model.layers]
    if found == "Mistral":  # its window is the config's, for every layer
        windows.append(getattr(inner.config, "sliding_window", None))
    return None if any(w is not None for w in windows) else inner


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x cos + rotate_half(x) sin, with rotate_half(x) sin = roll(x, d/2) (sign * sin) and
    sign = (-1 on the first half, +1 on the second)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def half_sign(head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """The sign that turns rotate_half into a roll: -1 on the first half of a head, +1 on the second."""
    half = head_dim // 2
    return torch.cat([-torch.ones(half), torch.ones(half)]).to(device=like.device, dtype=like.dtype)


def attention_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The keys each query may attend to, [B, 1, T, K] (True: attend), for the last `length` of the K
    columns of `mask` [B, K] (1 = a real column): a real column at or before the query's own, and the
    query's own column always (a padding query's only one)."""
    width = mask.shape[1]
    columns = torch.arange(width, device=mask.device)
    own = torch.arange(width - length, width, device=mask.device)[:, None]  # [T, 1]: each query's column
    allowed = (columns <= own) & mask.bool()[:, None]                       # [B, T, K]
    return (allowed | (columns == own))[:, None]


def cpu_autocast(x: torch.Tensor) -> bool:
    """Whether `x` is on a CPU under autocast, where the attention computes in float32 (attend)."""
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           gqa: bool) -> torch.Tensor:
    """softmax(q k^T scale + M) v by scaled_dot_product_attention; on a CPU in float32 outside
    autocast, whose bf16 would round q, k and v for no gain: the CPU's flash attention ran its
    backward pass 6x slower in bf16 than in float32 (3.0 against 0.48 ms a layer, SmolLM2's DPO
    step on an AMX Xeon), and the attention's products are a few percent of a pass's FLOPs."""
    if cpu_autocast(q):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed, scale=scale,
                                                  enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)


class LlamaLayers:
    """A model's modules as the functions of the pass above, as they are now (built per pass: sampling
    swaps layers in and out, and training flags decide dropout); `hidden` runs the pass."""

    def __init__(self, model, pack_frozen: bool = True):
        base, config = model.model, model.config
        make = functools.partial(linear, pack_frozen=pack_frozen)
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        attn = base.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scale = attn.scaling
        self.layers = [(layer.input_layernorm, *(make(getattr(layer.self_attn, f"{w}_proj")) for w in "qkvo"),
                        layer.post_attention_layernorm,
                        *(make(getattr(layer.mlp, f"{w}_proj")) for w in ("gate", "up", "down")), layer.mlp.act_fn)
                       for layer in base.layers]

    @classmethod
    def of(cls, model) -> Optional["LlamaLayers"]:
        """The LlamaLayers of `model` (a causal LM, or a peft model around one), or None where the pass
        above is not what its forward computes (computed_family; attention dropout while training)."""
        inner = computed_family(model)
        if inner is None:
            return None
        if any(layer.self_attn.training and layer.self_attn.attention_dropout for layer in inner.model.layers):
            return None
        return cls(inner)

    def hidden(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
               cache=None) -> torch.Tensor:
        """The last layer's hidden states after the final norm [B, T, H] for the tokens `input_ids`
        [B, T] at `positions` [B, T], `mask` [B, K] covering the cache's columns then these (0 at the
        hidden states of padding positions); keys and values go into `cache` (a DynamicCache whose
        layers all keep whole rows) when given."""
        rows, length = input_ids.shape
        d, group = self.head_dim, self.heads // self.kv_heads
        real = mask[:, -length:].reshape(-1).bool()
        index = None if bool(real.all()) else real.nonzero().squeeze(-1)

        def take(t: torch.Tensor) -> torch.Tensor:  # [B * T, ...] -> the real positions' [N, ...]
            return t if index is None else t.index_select(0, index)

        def place(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [B * T, ...], 0 at padding
            return t if index is None else t.new_zeros(rows * length, *t.shape[1:]).index_copy(0, index, t)

        x = self.embed(take(input_ids.reshape(-1)))                                   # [N, H]
        cos, sin = self.rotary(x[None], take(positions.reshape(-1))[None])            # [1, N, d]
        cos, sin = cos[0, :, None], (sin * half_sign(d, sin))[0, :, None]             # [N, 1, d]
        allowed = attention_mask(mask, length)
        layers = cache.layers if cache is not None else [None] * len(self.layers)
        for (norm1, wq, wk, wv, wo, norm2, gate, up, down, act), kv in zip(self.layers, layers):
            h = rms_norm(x, norm1)
            q, k, v = (w(h).view(len(h), -1, d) for w in (wq, wk, wv))               # [N, heads, d]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            q, k, v = (place(t).view(rows, length, -1, d).transpose(1, 2) for t in (q, k, v))  # [B, heads, T, d]
            if kv is not None:  # the values cached in float32 too where the attention computes in it
                k, v = kv.update(k, v.float() if cpu_autocast(v) else v)
            out = attend(q, k, v, allowed, self.scale, group > 1)
            x = x + wo(take(out.transpose(1, 2).reshape(rows * length, -1)))
            h = rms_norm(x, norm2)
            x = x + down(act(gate(h)) * up(h))
        return place(rms_norm(x, self.norm)).view(rows, length, -1)
