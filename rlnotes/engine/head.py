"""Log-probs of chosen tokens from hidden states through the LM head, a chunk of positions at a time,
so the full-vocabulary logits of a whole batch never exist at once.

    log pi(a | s) = log softmax(W h / T)[a],    H = -sum_a pi(a) log pi(a)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# Logits of at most this many floats exist at once in head_logprobs (32 MiB in float32): 170 positions
# of a 49k vocabulary, every position of a small one. glibc's malloc serves a block of 32 MiB or more
# with a fresh mmap every time, whose pages the kernel then zeroes on first touch; smaller blocks come
# back from its heap once a few steps have run. With 64 MiB chunks SmolLM2's GRPO training pass (bench
# shape, 2 cores) took 250-570 thousand page faults and 2-4 s of system time every pass; with 32 MiB,
# from the fourth step on, 0-40 thousand faults and about 1 s a step. The head over 900 positions ran as
# fast as with 341 positions a chunk, and 1.3x faster than with 85.
LOGIT_CHUNK = 2**23


class _FrozenHeadLogprobs(torch.autograd.Function):
    """log pi(token) (and the entropy) from hidden states through a frozen LM head, chunk by chunk.

    d log pi(a) / dh = (W[a] - pi @ W) / T and dH / dh = -(pi * (log pi + H)) @ W / T are computed in the
    forward pass, while each chunk's logits exist, so only these [M, d] tensors wait for the backward
    pass: never the [M, V] logits or their softmax. The backward pass scales them by the incoming
    gradients; the matmul it would have done moved to the forward pass, so the work is the same.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature: float, chunk: int, entropy: bool):
        grads = ctx.needs_input_grad[0]
        logp = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        ent = torch.empty_like(logp) if entropy else None
        d_logp = torch.empty_like(hidden) if grads else None
        d_ent = torch.empty_like(hidden) if grads and entropy else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = F.linear(hidden[rows], weight, bias).float() / temperature
            log_pi = F.log_softmax(z, dim=-1)
            del z
            tok = tokens[rows]
            logp[rows] = log_pi.gather(-1, tok[:, None]).squeeze(-1)
            pi = log_pi.exp() if grads or entropy else None
            if entropy:
                ent[rows] = -(pi * log_pi).sum(-1)
            if grads:
                w = weight.float()
                d_logp[rows] = (w[tok] - pi @ w) / temperature
                if entropy:
                    d_ent[rows] = -(pi * (log_pi + ent[rows, None])) @ w / temperature
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


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0,
                  entropy: bool = False,
                  real: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log softmax(head(h) / T)[token] [B, n], entropy of that softmax [B, n] or None) from hidden
    states h [B, n, d] and tokens [B, n], in float32, LOGIT_CHUNK logits at a time. `real` [B, n]
    (bool): the positions that need them; the others (padding) get 0 and no pass through the head.

    A frozen linear head (LoRA, and every no-grad pass) keeps no logits for the backward pass
    (_FrozenHeadLogprobs); a trainable one (model.lora=null, or an adapter on the head) goes through
    autograd chunk by chunk, keeping each chunk's log-softmax for its backward pass.
    """
    if real is not None and not bool(real.all()):
        logp, ent = head_logprobs(hidden[real], head, tokens[real], temperature, entropy)
        spread = lambda x: x.new_zeros(tokens.shape).masked_scatter(real, x)  # noqa: E731
        return spread(logp), (spread(ent) if entropy else None)
    shape, flat, flat_tokens = tokens.shape, hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    chunk = max(1, LOGIT_CHUNK // head.weight.shape[0])
    frozen = not torch.is_grad_enabled() or not any(p.requires_grad for p in head.parameters())
    if type(head) is torch.nn.Linear and frozen:
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):  # FSDP: gathered (it is the root unit's, normally whole after a forward)
            weight = weight.full_tensor()
            bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
        logp, ent = _FrozenHeadLogprobs.apply(flat, weight, bias, flat_tokens, temperature, chunk, entropy)
    else:
        parts = []
        for h, tok in zip(flat.split(chunk), flat_tokens.split(chunk)):
            log_pi = F.log_softmax(head(h).float() / temperature, dim=-1)
            parts.append((log_pi.gather(-1, tok[:, None]).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)
                          if entropy else None))
        logp = torch.cat([p[0] for p in parts])
        ent = torch.cat([p[1] for p in parts]) if entropy else None
    return logp.view(shape), (ent.view(shape) if entropy else None)
