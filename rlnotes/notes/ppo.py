"""PPO's clipped surrogate and clipped value loss (Schulman et al. 2017)."""

from typing import NamedTuple

import torch
from torch import Tensor

from rlnotes.notes._common import per_token, upcast
from rlnotes.notes.kl import kl_penalty
from rlnotes.notes.masked import aggregate, masked_mean

# exp(20) ~ 5e8: a larger log-ratio is clamped so rho stays finite (its gradient is then 0).
_MAX_LOG_RATIO = 20.0


def _surrogates(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
) -> tuple[Tensor, Tensor]:
    """(rho A, clip(rho, 1 - eps, 1 + eps_high) A), [B, T] in at least float32."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = per_token(upcast(advantages.detach()), logprobs)
    log_ratio = upcast(logprobs) - upcast(old_logprobs.detach())
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return ratio * adv, ratio.clamp(1 - clip_eps, 1 + eps_high) * adv


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> Tensor:
    """-min(rho A, clip(rho, 1-eps, 1+eps_high) A), rho = pi/pi_old (Schulman et al. 2017, Eq. 7).

    logprobs, old_logprobs: [B, T]. advantages: [B, T], or [B] broadcast over tokens.
    Returns the per-token loss [B, T] in the logprobs' dtype; aggregate it with a mask.
    clip_eps_high defaults to clip_eps; a larger one is DAPO's clip-higher (Yu et al. 2025,
    Sec. 3.1). old_logprobs and advantages are constants: they are detached.
    The log-ratio is clamped to [-20, 20] so rho stays finite (not in the paper).
    """
    unclipped, clipped = _surrogates(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high)
    return (-torch.minimum(unclipped, clipped)).to(logprobs.dtype)


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(ppo_clip_loss, ppo_clip_fraction) from one computation of rho A and clip(rho) A.

    Shapes as ppo_clip_loss, mask [B, T]: the per-token loss [B, T] and the clip fraction, a
    scalar (detached: it is for the log).
    """
    unclipped, clipped = _surrogates(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high)
    frac = masked_mean((clipped < unclipped).to(unclipped.dtype), mask).detach()
    return (-torch.minimum(unclipped, clipped)).to(logprobs.dtype), frac


def ppo_clip_fraction(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> Tensor:
    """Share of real tokens where the min picks the clipped term and it differs (for logging).

    That is A > 0 and rho > 1 + eps_high, or A < 0 and rho < 1 - eps: the tokens whose gradient
    the clip sets to 0. Shapes as ppo_clip_loss, mask [B, T]. Returns a scalar in at least
    float32; 0 when there are no real tokens.
    """
    return clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high)[1]


def value_loss(
    values: Tensor, old_values: Tensor | None, returns: Tensor, clip_eps: float | None = None
) -> Tensor:
    """0.5 (V - R)^2; with clip_eps, 0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2).

    values, old_values, returns: [B, T] -> per-token loss [B, T] in the values' dtype.
    Value clipping is not in the PPO paper (Schulman et al. 2017, Eq. 9 has the plain squared
    error); it comes from OpenAI baselines' PPO2. old_values may be None without clip_eps.
    old_values and returns are targets: they are detached.
    """
    v, target = upcast(values), upcast(returns.detach())
    loss = (v - target) ** 2
    if clip_eps is not None:
        if old_values is None:
            raise ValueError("value_loss: clip_eps needs old_values")
        old = upcast(old_values.detach())
        v_clipped = torch.clamp(v, old - clip_eps, old + clip_eps)
        loss = torch.maximum(loss, (v_clipped - target) ** 2)
    return (0.5 * loss).to(values.dtype)


class PPOLoss(NamedTuple):
    """ppo_loss's scalar, its parts and what it measured on the way (detached, for the log)."""
    loss: Tensor        # L = L_clip + c1 L_value - c2 entropy, to minimise
    value_loss: Tensor  # the aggregated value loss L_value
    clip_frac: Tensor   # share of real tokens whose gradient the clip set to 0
    approx_kl: Tensor   # mean k3 KL(pi_old || pi) per real token: how far the update moved


def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    value_clip_eps: float | None = None,
    vf_coef: float = 0.5,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    aggregation: str = "token-mean",
    max_len: int | None = None,
) -> PPOLoss:
    """L = agg(-min(rho A, clip(rho) A)) + c1 agg(L_V) - c2 agg(H) (Schulman et al. 2017, Eq. 9).

    logprobs, old_logprobs, advantages, values, old_values, returns, mask: [B, T]; entropy: [B, T]
    per-token entropy of pi, or None (no bonus). The sign of L is the paper's objective's
    negated: a loss to minimise. max_len is L of seq-mean-token-sum-norm (default T).
    """
    pg, clip_frac = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_eps)
    v_loss = aggregate(value_loss(values, old_values, returns, value_clip_eps), mask, aggregation, max_len)
    loss = aggregate(pg, mask, aggregation, max_len) + vf_coef * v_loss
    if entropy is not None:
        loss = loss - entropy_coef * aggregate(entropy, mask, aggregation, max_len)
    approx_kl = masked_mean(kl_penalty(old_logprobs, logprobs.detach(), "k3"), mask)
    return PPOLoss(loss, v_loss.detach(), clip_frac, approx_kl)
