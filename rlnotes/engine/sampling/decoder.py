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
the model's rotary module gives cos and sin (so every RoPE scaling it knows applies).

A small model's step is hundreds of tiny operations, each costing its call more than its arithmetic,
so the step makes fewer of them: small plain weights side by side (Wq; Wk; Wv and Wgate; Wup, each
below packed.MIN_WEIGHTS entries) multiply as one matrix, q and k rotate as one tensor, and the
bias M is the log of the 0/1 mask (llama.attention_bias). The logits equal the model's up to float32
rounding; `rollout.fast_decode=false` goes through the model's
forward instead (scripts/bench.py times generation either way; figures in docs/benchmarks.md).

Other architectures, sliding-window attention (whose cache keeps only the window) and sharded (FSDP)
weights (gathered by the model's own forward) decode through the model's forward.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from rlnotes.engine.policy import packed
from rlnotes.engine.policy.llama import (Linear, LlamaLayers, attention_bias, cpu_autocast, half_sign, hooked, linear,
                                         rms_norm, rotate)
from rlnotes.engine.policy.merged import MergedLinear

# (tokens [N], attention mask [N, K] over the cache's columns and the new one, positions [N], cache)
# -> logits of the next token [N, V]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]
Projections = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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


def side_by_side(modules: Sequence[torch.nn.Module]) -> Optional[Linear]:
    """x -> the outputs of `modules` concatenated, as one product with their weights stacked, where each
    is a plain linear map (nn.Linear or MergedLinear, no hooks) with a small weight (below MIN_WEIGHTS
    entries: one product's call costs more than its arithmetic there) and all have biases or none;
    else None. The stacked weights are a copy, made once per sampling call."""
    if any(type(m) not in (torch.nn.Linear, MergedLinear) or hooked(m) or m.weight.numel() >= packed.MIN_WEIGHTS
           for m in modules) or len({m.bias is None for m in modules}) > 1:
        return None
    bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
    return functools.partial(F.linear, weight=torch.cat([m.weight for m in modules]), bias=bias)


class Decoder(LlamaLayers):
    """The decoding step above for one model, as its modules are now (built per sampling call)."""

    def __init__(self, model):
        super().__init__(model, pack_frozen=False)  # sampling's layers are packed or not as rollout.pack_weights says
        self.blocks = [(norm1, self._qkv(layer.self_attn, wq, wk, wv), wo, norm2,
                        self._mlp(layer.mlp, gate, up, act), down)
                       for (norm1, wq, wk, wv, wo, norm2, gate, up, down, act), layer
                       in zip(self.layers, model.model.layers)]
        self.head = linear(model.get_output_embeddings(), pack_frozen=False)
        self.sign = half_sign(self.head_dim, self.embed.weight)
        rope = self.rotary.rope_type
        self.tabled = isinstance(rope, str) and "dynamic" not in rope and rope != "longrope"
        self.table: Optional[torch.Tensor] = None  # cos and sign * sin at positions 0, 1, ...: [length, 2, d]

    def _qkv(self, attention: torch.nn.Module, wq: Linear, wk: Linear, wv: Linear) -> Projections:
        """h [N, H] -> (q and k side by side [N, heads + kv heads, d], v [N, kv heads, d])."""
        d, width = self.head_dim, (self.heads + self.kv_heads) * self.head_dim
        joined = side_by_side([attention.q_proj, attention.k_proj, attention.v_proj])
        if joined is None:
            return lambda h: (torch.cat([wq(h), wk(h)], dim=-1).view(len(h), -1, d), wv(h).view(len(h), -1, d))

        def qkv(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = joined(h)
            return y[:, :width].view(len(h), -1, d), y[:, width:].view(len(h), -1, d)
        return qkv

    @staticmethod
    def _mlp(mlp: torch.nn.Module, gate: Linear, up: Linear, act: Linear) -> Linear:
        """h' [N, H] -> act(h' Wgate) * h' Wup [N, I]."""
        joined = side_by_side([mlp.gate_proj, mlp.up_proj])
        if joined is None:
            return lambda h: act(gate(h)) * up(h)
        width = mlp.gate_proj.weight.shape[0]

        def inner(h: torch.Tensor) -> torch.Tensor:
            y = joined(h)
            return act(y[:, :width]) * y[:, width:]
        return inner

    def _rotation(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign * sin at each row's position [N, 1, d], from a table of the rotary module's
        values at positions 0, 1, ... (made again, twice as long, when a position passes its end);
        a RoPE whose frequencies depend on the positions of the call (dynamic, longrope) is asked
        at each step, as the model's forward does."""
        if not self.tabled:
            cos, sin = self.rotary(x[:, None], positions[:, None])
            return cos, sin * self.sign.to(sin.dtype)
        if self.table is None or int(positions.max()) >= len(self.table) or self.table.dtype != x.dtype:
            length = 2 * int(positions.max()) + 2
            cos, sin = self.rotary(x[:1], torch.arange(length, device=x.device)[None])
            self.table = torch.stack([cos[0], sin[0] * self.sign.to(sin.dtype)], dim=1)  # [length, 2, d]
        both = self.table[positions]                                      # [N, 2, d]
        return both[:, :1], both[:, 1:]

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache) -> torch.Tensor:
        n, d, heads, group = len(tokens), self.head_dim, self.heads, self.heads // self.kv_heads
        x = self.embed(tokens)                                            # [N, H]
        exact = cpu_autocast(x)  # the attention in float32, as the training pass's (llama.attend)
        cos, sin = self._rotation(x, positions)                           # [N, 1, d]: one for every head
        bias = attention_bias(attention_mask).to(x.dtype)[:, None, None]  # [N, 1, 1, K]: 0 or -inf
        for (norm1, qkv, wo, norm2, mlp, down), layer in zip(self.blocks, cache.layers):
            qk, v = qkv(rms_norm(x, norm1))                               # [N, heads + kv heads, d], [N, kv heads, d]
            qk = rotate(qk, cos, sin)
            # [N, kv heads, K, d] each: the cache's keys and values with this position's
            keys, values = layer.update(qk[:, heads:, None], (v.float() if exact else v)[:, :, None])
            q = qk[:, :heads].view(n, self.kv_heads, group, d)            # a key/value head's queries as rows
            with torch.autocast("cpu", enabled=False) if exact else contextlib.nullcontext():
                scores = torch.add(bias, q @ keys.transpose(-1, -2), alpha=self.scale)
                out = scores.softmax(-1, dtype=torch.float32).to(values.dtype) @ values  # [N, kv heads, group, d]
            x = x + wo(out.view(n, -1))
            x = x + down(mlp(rms_norm(x, norm2)))
        return self.head(rms_norm(x, self.norm))
