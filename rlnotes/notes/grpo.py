"""GRPO: group-relative advantages, and the clipped surrogate with a KL penalty to the reference."""

from typing import NamedTuple

import torch
from torch import Tensor

from rlnotes.notes._common import check_choice, upcast
from rlnotes.notes.kl import KL_ESTIMATORS, kl_penalty
from rlnotes.notes.masked import aggregate, masked_mean
from rlnotes.notes.ppo import clipped_surrogate


def group_advantages(
    rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-4
) -> Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + eps) within each group (Shao et al. 2024, Sec. 4.1.2).

    DeepSeekMath's outcome-supervision advantage.
    rewards: [N], group by group (the G = group_size completions of prompt 0, then of prompt 1,
    ...) -> [N]. std is the unbiased sample std (torch.std). scale_by_std=False gives
    R_i - mean(R) (Liu et al. 2025, Dr. GRPO). eps keeps near-equal groups finite (not in the
    paper). A group of equal rewards, or of one completion, gets exactly 0: it carries no signal.
    """
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    r = upcast(rewards).reshape(-1, group_size)
    # Shift by each group's first reward: equal rewards then give exactly 0, not rounding noise.
    shifted = r - r[:, :1]
    centered = shifted - shifted.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centered = centered / (shifted.std(dim=1, keepdim=True) + eps)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return centered.reshape(-1).to(dtype)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """max_i R_i != min_i R_i within each group (Yu et al. 2025, DAPO, Sec. 3.2, Eq. 11's filter).

    rewards: [N], group by group -> [N / G] bool: True for the groups whose rewards are not all
    equal. A group of equal rewards has A_i = 0 for every completion: it carries no gradient.
    """
    groups = rewards.view(-1, group_size)
    return groups.max(-1).values != groups.min(-1).values


class GRPOLoss(NamedTuple):
    """grpo_loss's scalar and what it measured on the way (detached, for the log)."""
    loss: Tensor       # the aggregated loss to minimise
    clip_frac: Tensor  # share of real tokens whose gradient the clip set to 0 (ppo_clip_fraction)
    kl: Tensor         # mean KL(pi || pi_ref) per real token by kl_estimator; NaN without ref_logprobs


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    clip_eps_high: float | None = None,
    kl_estimator: str = "k3",
    aggregation: str = "seq-mean-token-mean",
    max_len: int | None = None,
) -> GRPOLoss:
    """aggregate(-min(rho A, clip(rho, 1-eps, 1+eps_high) A) + beta KL) (Shao et al. 2024, Eq. 3).

    logprobs, old_logprobs, ref_logprobs, mask: [B, T]; advantages: [B] (one per completion,
    from group_advantages) or [B, T]. Returns GRPOLoss: the loss, a scalar in the logprobs' dtype,
    with its clip fraction and mean KL.
    The default aggregation is the paper's 1/G sum_i 1/|o_i| sum_t; "token-mean" with
    clip_eps_high > clip_eps is DAPO (Yu et al. 2025), "seq-mean-token-sum-norm" with
    unscaled advantages is Dr. GRPO (Liu et al. 2025). beta=0 drops the KL term and
    ref_logprobs may then be None. max_len is L of seq-mean-token-sum-norm (default T).
    """
    check_choice("KL estimator", kl_estimator, KL_ESTIMATORS)
    per_token, clip_frac = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high)
    if beta != 0 and ref_logprobs is None:
        raise ValueError(f"grpo_loss: beta={beta} needs ref_logprobs (or set beta=0)")
    kl = None if ref_logprobs is None else kl_penalty(logprobs, ref_logprobs, kl_estimator)
    if beta != 0:
        per_token = per_token + beta * kl
    mean_kl = masked_mean(kl.detach(), mask) if kl is not None else torch.tensor(float("nan"))
    return GRPOLoss(aggregate(per_token, mask, aggregation, max_len), clip_frac, mean_kl)
