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


def terminal_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """r_t = R on the last real token of each row, 0 elsewhere: an outcome reward as per-token rewards.

    rewards: [B] (one per completion), mask: [B, T] -> [B, T] in at least float32. A row without
    real tokens gets no reward.
    """
    m = as_bool(mask)
    pos = torch.arange(m.shape[-1], device=m.device)
    last = torch.where(m, pos, -1).max(-1, keepdim=True).values
    return torch.where((pos == last) & (last >= 0), upcast(rewards)[..., None], 0.0)


def leave_one_out_baseline(returns: Tensor, group_size: int) -> Tensor:
    """b_i = 1/(G-1) sum_{j != i} R_j within each group (Kool et al. 2019; Ahmadian et al. 2024, RLOO).

    returns: [N], group by group (G = group_size completions of one prompt next to each other)
    -> [N]. Independent of R_i, so subtracting it keeps the policy gradient unbiased. G >= 2.
    """
    if group_size < 2 or returns.shape[0] % group_size:
        raise ValueError(f"leave-one-out needs groups of at least 2; got {returns.shape[0]} returns, G={group_size}")
    r = upcast(returns).reshape(-1, group_size)
    return ((r.sum(-1, keepdim=True) - r) / (group_size - 1)).reshape(-1).to(returns.dtype)


def kl_penalized_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """r_t = R 1[t = |o|] - beta KL_t (Ouyang et al. 2022, InstructGPT, Eq. 2, per token).

    The outcome R on the last real token and a KL(pi || pi_ref) penalty on every token.
    rewards: [B]; kl: [B, T] per-token KL estimates (kl_penalty); mask: [B, T] -> [B, T] in at
    least float32. Padding positions are left to the caller's mask.
    """
    return terminal_rewards(rewards, mask) - beta * kl
