"""Log-probs of chosen tokens from hidden states through the LM head, a block of logits at a time,
so the full-vocabulary logits of a whole batch never exist at once.

    log pi(a | s) = log softmax(W h / T)[a],    H = -sum_a pi(a) log pi(a)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlnotes.engine.policy.packed import kept_packing, packed_frozen, packed_product

# A frozen head's logits exist LOGIT_CHUNK floats at a time (16 MiB in float32): a block of at most
# LOGIT_ROWS positions against as many vocabulary columns as fit, so each block stays in a server
# CPU's last-level cache while it is exponentiated and summed, and no block is large enough for
# glibc's malloc to map it afresh (32 MiB and up: page faults on every pass). Blocks of columns beat
# whole-vocabulary rows at SmolLM2's vocabulary (figures: docs/benchmarks.md).
LOGIT_CHUNK = 2**22
LOGIT_ROWS = 1024


class _FrozenHeadLogprobs(torch.autograd.Function):
    """log pi(token) (and the entropy) from hidden states through a frozen LM head, the vocabulary a
    block of columns at a time with a running maximum m (online softmax), per position:

        s = sum_j e_j,  e_j = exp(z_j - m)          log pi(a) = z_a - m - log s
        a = sum_j e_j (z_j - m)                     H = log s - a / s
        G = sum_j e_j W_j,  Gz = sum_j e_j (z_j - m) W_j
        d log pi(a) / dh = (W_a - G / s) / T        dH / dh = -(Gz - (a / s) G) / (s T)

    When a block raises m by delta < 0, the sums so far scale by exp(delta) (and a, Gz also take in
    delta s, delta G). The gradients are computed in the forward pass, while each block's logits
    exist, so only the [M, d] tensors wait for the backward pass, never the [M, V] logits or softmax.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, rows: int, entropy: bool):
        grads = ctx.needs_input_grad[0]
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        ent = torch.empty_like(logp) if entropy else None
        d_logp = torch.empty_like(hidden) if grads else None
        d_ent = torch.empty_like(hidden) if grads and entropy else None
        for start in range(0, hidden.shape[0], rows):
            block = slice(start, start + rows)
            out = _online_block(hidden[block], weight, bias, tokens[block], temperature, grads, entropy)
            logp[block] = out[0]
            if entropy:
                ent[block] = out[1]
            if grads:
                d_logp[block] = out[2]
                if entropy:
                    d_ent[block] = out[3]
        ctx.save_for_backward(d_logp, d_ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        d_logp, d_ent = ctx.saved_tensors
        if d_logp is None:
            return (None,) * 7
        grad = d_logp * g_logp[:, None].to(d_logp.dtype)
        if d_ent is not None and g_ent is not None:
            grad = grad + d_ent * g_ent[:, None].to(d_ent.dtype)
        return grad, None, None, None, None, None, None


def _online_block(h, weight, bias, tokens, temperature: float, grads: bool, entropy: bool):
    """(log pi(token), H, d log pi / dh, dH / dh) for the positions h [M, d] (the last three None
    when not asked for), the vocabulary LOGIT_CHUNK // M columns at a time: _FrozenHeadLogprobs."""
    n, vocab = h.shape[0], weight.shape[0]
    packs = packed_frozen(weight)  # fixed blocks of columns, each's packed copies kept between passes
    columns = max(1, LOGIT_CHUNK // (LOGIT_ROWS if packs else n))
    picked = h.new_zeros(n, dtype=torch.float32)  # z_token
    m = s = a = g = gz = None
    for start in range(0, vocab, columns):
        w = weight[start:start + columns]
        b = None if bias is None else bias[start:start + columns]
        block = (start, start + len(w)) if packs else None
        z = packed_product(h, kept_packing(weight, rows=block), b) if packs else F.linear(h, w, b).float()
        if temperature != 1.0:
            z.div_(temperature)
        local = tokens - start
        inside = (local >= 0) & (local < z.shape[1])
        picked = torch.where(inside, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1), picked)
        block_max = z.amax(1)
        top = block_max if m is None else torch.maximum(m, block_max)
        u = z.sub_(top[:, None])  # z_j - m, in place
        e = u.exp() if entropy else u.exp_()
        eu = e * u if entropy else None
        w = (weight, block) if packs else w  # c @ w through the kept pack of the block's transpose
        if m is None:
            s = e.sum(1)
            a = eu.sum(1) if entropy else None
            g = _scaled_plus(None, None, e, w) if grads else None
            gz = _scaled_plus(None, None, eu, w) if grads and entropy else None
        else:
            delta = m - top
            scale = delta.exp()
            if entropy:
                a = (a + delta * s) * scale + eu.sum(1)
            if grads and entropy:
                gz = _scaled_plus(gz.add_(g * delta[:, None]), scale, eu, w)
            if grads:
                g = _scaled_plus(g, scale, e, w)
            s = s * scale + e.sum(1)
        m = top
    log_s = s.log()
    logp = picked - m - log_s
    ent = log_s - a / s if entropy else None
    if not grads:
        return logp, ent, None, None
    d_logp = (weight[tokens].float() - g / s[:, None]) / temperature
    d_ent = -(gz - (a / s)[:, None] * g) / (s[:, None] * temperature) if entropy else None
    return logp, ent, d_logp, d_ent


def _scaled_plus(acc: Optional[torch.Tensor], scale: Optional[torch.Tensor], c: torch.Tensor,
                 w) -> torch.Tensor:
    """acc * scale + c @ w in float32 [M, d] (c @ w alone when acc is None), for c [M, k] (float32) and
    a block of head weights w [k, d], or (the head's weight, the block's rows) for a frozen float32
    one, whose block's transpose is packed for oneDNN and kept (kept_packing). In float32 when w is
    float32 outside autocast; else, as the logits (hardware.precision=bf16: w stored in bf16, or
    rounded by autocast), the products in bf16 summed by the matmul and rounded to bf16 once per
    block before they join the float32 sum."""
    if isinstance(w, tuple):
        product = packed_product(c, kept_packing(w[0], transposed=True, rows=w[1]))
        return product if acc is None else acc.mul_(scale[:, None]).add_(product)
    if w.dtype == torch.float32 and not torch.is_autocast_enabled(w.device.type):
        return c @ w if acc is None else acc.mul_(scale[:, None]).addmm_(c, w)
    product = (c.to(w.dtype) @ w).float()
    return product if acc is None else acc.mul_(scale[:, None]).add_(product)


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0,
                  entropy: bool = False,
                  real: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log softmax(head(h) / T)[token] [B, n], entropy of that softmax [B, n] or None) from hidden
    states h [B, n, d] and tokens [B, n], in float32, LOGIT_CHUNK logits at a time. `real` [B, n]
    (bool): the positions that need them; the others (padding) get 0 and no pass through the head.

    A frozen linear head (LoRA, and every no-grad pass) keeps no logits for the backward pass
    (_FrozenHeadLogprobs: blocks of positions and vocabulary columns); a trainable one (model.lora=null,
    or an adapter on the head) goes through autograd a chunk of whole-vocabulary rows at a time, keeping
    each chunk's log-softmax for its backward pass.
    """
    if real is not None and not bool(real.all()):
        logp, ent = head_logprobs(hidden[real], head, tokens[real], temperature, entropy)
        spread = lambda x: x.new_zeros(tokens.shape).masked_scatter(real, x)  # noqa: E731
        return spread(logp), (spread(ent) if entropy else None)
    shape, flat, flat_tokens = tokens.shape, hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    frozen = not torch.is_grad_enabled() or not any(p.requires_grad for p in head.parameters())
    if type(head) is torch.nn.Linear and frozen:
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):  # FSDP: gathered (it is the root unit's, normally whole after a forward)
            weight = weight.full_tensor()
            bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
        logp, ent = _FrozenHeadLogprobs.apply(flat, weight, bias, flat_tokens, temperature, LOGIT_ROWS, entropy)
    else:
        parts, chunk = [], max(1, LOGIT_CHUNK // head.weight.shape[0])
        for h, tok in zip(flat.split(chunk), flat_tokens.split(chunk)):
            log_pi = F.log_softmax(head(h).float() / temperature, dim=-1)
            parts.append((log_pi.gather(-1, tok[:, None]).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)
                          if entropy else None))
        logp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if entropy else None
    return logp.view(shape), (ent.view(shape) if entropy else None)


def linear_float32(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """head(hidden) in float32, also under bf16 autocast (hardware.precision=bf16): a value or reward
    head's output goes into a loss as it is, where bf16 would keep 8 bits of it."""
    with torch.autocast(hidden.device.type, enabled=False):
        return head(hidden.float())
