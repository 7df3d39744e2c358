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

import contextlib
from typing import Callable, Optional

import torch

from rlnotes.engine.policy.llama import LlamaLayers, cpu_autocast, half_sign, linear, rms_norm, rotate

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


class Decoder(LlamaLayers):
    """The decoding step above for one model, as its modules are now (built per sampling call)."""

    def __init__(self, model):
        super().__init__(model, pack_frozen=False)  # sampling's layers are packed or not as rollout.pack_weights says
        self.head = linear(model.get_output_embeddings(), pack_frozen=False)
        self.sign = half_sign(self.head_dim, self.embed.weight)
        rope = self.rotary.rope_type
        self.tabled = isinstance(rope, str) and "dynamic" not in rope and rope != "longrope"
        self.table: Optional[tuple[torch.Tensor, torch.Tensor]] = None

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

    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache) -> torch.Tensor:
        n, d, group = len(tokens), self.head_dim, self.heads // self.kv_heads
        x = self.embed(tokens)                                            # [N, H]
        exact = cpu_autocast(x)  # the attention in float32, as the training pass's (llama.attend)
        cos, sin = self._rotation(x, positions)                           # [N, 1, d]: one for every head
        bias = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill_(attention_mask == 0, float("-inf"))[:, None, None]  # [N, 1, 1, K]
        for (norm1, wq, wk, wv, wo, norm2, gate, up, down, act), layer in zip(self.layers, cache.layers):
            h = rms_norm(x, norm1)
            q, k, v = (w(h).view(n, -1, d) for w in (wq, wk, wv))       # [N, heads, d]
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            keys, values = layer.update(k[:, :, None], (v.float() if exact else v)[:, :, None])  # [N, kv heads, K, d]
            q = q.view(n, self.kv_heads, group, d)                       # a key/value head's queries as rows
            with torch.autocast("cpu", enabled=False) if exact else contextlib.nullcontext():
                scores = torch.add(bias, q @ keys.transpose(-1, -2), alpha=self.scale)
                out = scores.softmax(-1, dtype=torch.float32).to(values.dtype) @ values  # [N, kv heads, group, d]
            x = x + wo(out.view(n, -1))
            h = rms_norm(x, norm2)
            x = x + down(act(gate(h)) * up(h))
        return self.head(rms_norm(x, self.norm))
