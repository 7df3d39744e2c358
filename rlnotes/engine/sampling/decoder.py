"""A decoding step of Llama-family models (Llama, Qwen2, Mistral) written as plain tensor operations.

Sampling forwards one token per row at a time, where a small model's matmuls take microseconds and
the model's own forward spends most of a step in Python around them: its masks, rotary cache,
output records, kwargs checks and module calls. For one new token per row at position p, layer by
layer,

    h = RMSNorm(x);  q, k, v = h Wq, h Wk, h Wv;  q, k = RoPE(q, p), RoPE(k, p)
    K, V = [K; k], [V; v]                          (written into the KV cache in place)
    x = x + softmax(q K^T / sqrt(d) + M) V Wo      (M: 0 at the row's real columns, -inf at padding)
    x = x + (act(h' Wgate) * h' Wup) Wdown,  h' = RMSNorm(x)

then logits = Head(RMSNorm(x)). The query heads that share a key/value head (grouped-query
attention) are rows of one matmul against it, so keys and values are never repeated. Each layer's
weights are used as they sit while sampling (merged LoRA, oneDNN-packed, or peft's own layer), and
the model's rotary module gives cos and sin (so every RoPE scaling it knows applies). The logits
equal the model's up to float32 rounding; `rollout.fast_decode=false` goes through the model's
forward instead (scripts/bench.py times generation either way; figures in docs/benchmarks.md).

Other architectures, sliding-window attention (whose cache keeps only the window) and sharded (FSDP)
weights (gathered by the model's own forward) decode through the model's forward.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.policy.merged import LowRankLinear, MergedLinear
from rlnotes.engine.policy.packed import PackedLinear

# The causal LMs whose decoder layers compute exactly the step above; their attention, MLP and norm
# classes are checked too, so a subclass that changes one of them is not taken for the family.
FAMILIES = ("Llama", "Qwen2", "Mistral")

# (tokens [N], attention mask [N, K] over the cache's columns and the new one, positions [N], cache)
# -> logits of the next token [N, V]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


def model_step(model) -> Step:
    """A decoding step through the model's own forward."""
    def step(tokens, attention_mask, positions, cache):
        return model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=positions[:, None],
                     cache=cache, use_cache=True).logits[:, -1]
    return step


def decoding_step(model, own: bool = True) -> Step:
    """The step to decode `model` with: rlnotes' own (Decoder) where `own` is on and the model is
    one it computes exactly, else the model's forward."""
    decoder = Decoder.of(model) if own else None
    return model_step(model) if decoder is None else decoder


def _linear(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> module(x) without the module call around it where the module is a plain linear map."""
    if type(module) in (torch.nn.Linear, MergedLinear):
        return functools.partial(F.linear, weight=module.weight, bias=module.bias)
    if type(module) in (PackedLinear, LowRankLinear):
        return module.forward
    return module


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps), in float32 and back to x's dtype before the weight, as the
    Llama family's RMSNorm."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    h = x.float()
    return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)


def _family(model) -> Optional[str]:
    """The family of FAMILIES whose classes make up `model` (a causal LM), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        return None
    for family in FAMILIES:
        def named(module, part):
            return type(module).__name__ == f"{family}{part}"

        if named(model, "ForCausalLM") and named(model.model.norm, "RMSNorm") and all(
                named(layer, "DecoderLayer") and named(layer.self_attn, "Attention") and named(layer.mlp, "MLP")
                and named(layer.input_layernorm, "RMSNorm") and named(layer.post_attention_layernorm, "RMSNorm")
                for layer in layers):
            return family
    return None


class Decoder:
    """The decoding step above for one model, as its modules are now (built per sampling call)."""

    def __init__(self, model):
        base = model.model
        config = model.config
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        self.head = _linear(model.get_output_embeddings())
        attn = base.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.scale = attn.scaling
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, d/2) * (sin with its first half negated)
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(base.embed_tokens.weight.device)
        rope = self.rotary.rope_type
        self.tabled = isinstance(rope, str) and "dynamic" not in rope and rope != "longrope"
        self.table: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.layers = [(layer.input_layernorm, *(_linear(getattr(layer.self_attn, f"{w}_proj")) for w in "qkvo"),
                        layer.post_attention_layernorm,
                        *(_linear(getattr(layer.mlp, f"{w}_proj")) for w in ("gate", "up", "down")), layer.mlp.act_fn)
                       for layer in base.layers]

    def _rotation(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign * sin at each row's position [N, 1, d], from a table of the rotary module's
        values at positions 0, 1, ... (made again, twice as long, when a position passes its end);
        a RoPE whose frequencies depend on the positions of the call (dynamic, longrope) is asked
        at each step, as the model's forward does."""
        if not self.tabled:
            cos, sin = self.rotary(x[:, None], positions[:, None])
            return cos, sin * self.sign.to(sin.dtype)
        if self.table is None or int(positions.max()) >= len(self.table[0]) or self.table[0].dtype != x.dtype:
            length = 2 * int(positions.max()) + 2
            cos, sin = self.rotary(x[:1], torch.arange(length, device=x.device)[None])
            self.table = (cos[0], sin[0] * self.sign.to(sin.dtype))
        return tuple(t[positions][:, None] for t in self.table)

    @classmethod
    def of(cls, model) -> Optional["Decoder"]:
        """The Decoder of `model` (a causal LM, or a peft model around one), or None where the step
        above is not what the model computes or its weights are sharded."""
        if is_sharded(model):
            return None
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        family = _family(inner)
        if family is None:
            return None
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in inner.model.layers]
        if family == "Mistral":  # its window is the config's, for every layer
            windows.append(getattr(inner.config, "sliding_window", None))
        if any(w is not None for w in windows):
            return None
        return cls(inner)

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache) -> torch.Tensor:
        n, d, group = len(tokens), self.head_dim, self.heads // self.kv_heads
        x = self.embed(tokens)                                            # [N, H]
        cos, sin = self._rotation(x, positions)                           # [N, 1, d]: one for every head
        bias = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_(attention_mask == 0, float("-inf"))[:, None, None]  # [N, 1, 1, K]
        for (norm1, wq, wk, wv, wo, norm2, gate, up, down, act), layer in zip(self.layers, cache.layers):
            h = rms_norm(x, norm1)
            q, k, v = (w(h).view(n, -1, d) for w in (wq, wk, wv))       # [N, heads, d]
            q = torch.addcmul(q * cos, q.roll(d // 2, -1), sin)
            k = torch.addcmul(k * cos, k.roll(d // 2, -1), sin)
            keys, values = layer.update(k[:, :, None], v[:, :, None])   # [N, kv heads, K, d]
            q = q.view(n, self.kv_heads, group, d)                       # a key/value head's queries as rows
            scores = torch.add(bias, q @ keys.transpose(-1, -2), alpha=self.scale)
            out = scores.softmax(-1, dtype=torch.float32).to(values.dtype) @ values  # [N, kv heads, group, d]
            x = x + wo(out.view(n, -1))
            h = rms_norm(x, norm2)
            x = x + down(act(gate(h)) * up(h))
        return self.head(rms_norm(x, self.norm))
