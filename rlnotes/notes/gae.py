"""Generalized advantage estimation: a lambda-weighted sum of TD residuals."""

import torch
from torch import Tensor

from rlnotes.notes._common import as_bool, upcast


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t (GAE, Eq. 16).

    Generalized advantage estimation (Schulman et al. 2015).
    rewards, values, mask: [B, T] -> (advantages, returns), both [B, T] and 0 at padding, with
    returns = A + V, the value target. V = 0 after the last real token of a row (the episode ends
    there). Padding inside a row is skipped: t+1 means the next real token.
    lam=1 gives A_t = G_t - V_t; lam=0 gives A_t = delta_t.
    Math in at least float32, returned in the rewards' dtype. Autograd is left alone: callers
    detach (values usually come from a critic that is being trained).
    """
    m = as_bool(mask).expand_as(rewards)
    r, v = upcast(rewards), upcast(values)
    next_value = r.new_zeros(r.shape[:-1])
    adv = r.new_zeros(r.shape[:-1])
    out = []
    for t in reversed(range(r.shape[-1])):
        delta = r[..., t] + gamma * next_value - v[..., t]
        adv = torch.where(m[..., t], delta + gamma * lam * adv, adv)
        next_value = torch.where(m[..., t], v[..., t], next_value)
        out.append(torch.where(m[..., t], adv, 0.0))
    advantages = torch.stack(out[::-1], dim=-1)
    returns = torch.where(m, advantages + v, 0.0)
    return advantages.to(rewards.dtype), returns.to(rewards.dtype)
