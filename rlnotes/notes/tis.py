"""Truncated importance sampling: correcting a policy gradient for tokens another engine sampled."""

import math

import torch
from torch import Tensor

from rlnotes.notes._common import upcast


def truncated_is_weights(logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """w_t = min(pi(a_t|s_t) / mu(a_t|s_t), C) (Yao et al. 2025, truncated importance sampling).

    The tokens were sampled by an engine mu (vLLM) whose numerics differ from the trainer's pi;
    multiplying each token's policy-gradient term by w_t makes the gradient the on-policy one again,
    and the cap C bounds its variance (Ionides 2008). logprobs, sampler_logprobs: [B, T] -> [B, T],
    detached (a weight, not a path for gradients); exp(min(log pi - log mu, log C)) never overflows.
    """
    if cap < 1:
        raise ValueError(f"truncated_is_weights: cap={cap} must be at least 1")
    log_ratio = upcast(logprobs.detach()) - upcast(sampler_logprobs.detach())
    return torch.exp(log_ratio.clamp(max=math.log(cap))).to(logprobs.dtype)
