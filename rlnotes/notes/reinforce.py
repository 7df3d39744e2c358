"""Discounted returns-to-go, the return that REINFORCE weighs each action's log-probability by."""

import torch
from torch import Tensor

from rlnotes.notes._common import as_bool, upcast


def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{l>=0} gamma^l r_{t+l} (Williams 1992, REINFORCE; Sutton et al. 1999, Thm. 1).

    rewards, mask: [B, T] -> [B, T], 0 at padding. The sum runs over the real tokens of each row:
    padding between real tokens is skipped and neither adds a reward nor counts as a step of
    discount. Math in at least float32, returned in the rewards' dtype; autograd is left alone.
    """
    m = as_bool(mask).expand_as(rewards)
    r = upcast(rewards)
    g = r.new_zeros(r.shape[:-1])
    out = []
    for t in reversed(range(r.shape[-1])):
        g = torch.where(m[..., t], r[..., t] + gamma * g, g)
        out.append(torch.where(m[..., t], g, 0.0))
    return torch.stack(out[::-1], dim=-1).to(rewards.dtype)
