"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

Schulman 2020, "Approximating KL divergence". With r = pi_ref / pi at a sampled token:

    k1 = -log r           unbiased; high variance, negative on some tokens
    k2 = 0.5 (log r)^2    biased (right to second order as pi -> pi_ref); low variance, >= 0
    k3 = r - 1 - log r    unbiased; low variance, >= 0 (GRPO's, Shao et al. 2024, Eq. 4)
"""

import torch
from torch import Tensor

from rlnotes.notes._common import check_choice, upcast

# exp(20) ~ 5e8 stays finite in float32 and bfloat16 (not in float16).
_MAX_LOG_RATIO = 20.0


def _k1(log_r: Tensor) -> Tensor:
    return -log_r


def _k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r**2


def _k3(log_r: Tensor) -> Tensor:
    log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.expm1(log_r) - log_r  # expm1 keeps it accurate and >= 0 for small log r


# Keys are the config option names.
KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """k1 = -d, k2 = d^2 / 2, k3 = e^d - d - 1 with d = log pi_ref - log pi (Schulman 2020).

    The three estimators of "Approximating KL divergence"; k3 is GRPO's (Shao et al. 2024, Eq. 4).
    logprobs, ref_logprobs: [B, T] log-probs of the sampled tokens -> [B, T], in the logprobs'
    dtype (math in at least float32). Padding is not masked here: aggregate does that.
    k3 clamps d to [-20, 20] so e^d never overflows; beyond that its gradient is 0.
    ref_logprobs are a constant and are detached.
    """
    check_choice("KL estimator", estimator, KL_ESTIMATORS)
    log_r = upcast(ref_logprobs.detach()) - upcast(logprobs)
    return KL_ESTIMATORS[estimator](log_r).to(logprobs.dtype)
