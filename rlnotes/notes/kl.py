"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

Schulman 2020, "Approximating KL divergence". With r = pi_ref / pi at a sampled token:

    k1 = -log r           unbiased; high variance, negative on some tokens
    k2 = 0.5 (log r)^2    biased (right to second order as pi -> pi_ref); low variance, >= 0
    k3 = r - 1 - log r    unbiased; low variance, >= 0 (GRPO's, Shao et al. 2024, Eq. 4)
"""

import math

import torch
from torch import Tensor

from rlnotes.notes._common import check_choice, upcast


def overflow_bound(*dtypes: torch.dtype) -> float:
    """The largest log r whose e^(log r) is finite in every one of `dtypes` (0.1% under
    log(max): float32 and bfloat16 ~88.6, float16 ~11.1, float64 ~709), so rounding the
    bound itself cannot tip exp over."""
    return 0.999 * math.log(min(torch.finfo(d).max for d in dtypes))


def _k1(log_r: Tensor, out_dtype: torch.dtype) -> Tensor:
    return -log_r


def _k2(log_r: Tensor, out_dtype: torch.dtype) -> Tensor:
    return 0.5 * log_r**2


def _k3(log_r: Tensor, out_dtype: torch.dtype) -> Tensor:
    # e^x - 1 - x > 0 grows like e^x only for large positive x: clamp there alone, where e^x would
    # overflow the math's or the result's dtype. For x -> -inf it is -1 - x: no clamp, so its value
    # and its gradient (-1 w.r.t. log r) stay exact where the policy is far above the reference.
    log_r = log_r.clamp(max=overflow_bound(log_r.dtype, out_dtype))
    return torch.expm1(log_r) - log_r  # expm1 keeps it accurate and >= 0 for small log r


# Keys are the config option names.
KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """k1 = -d, k2 = d^2 / 2, k3 = e^d - d - 1 with d = log pi_ref - log pi (Schulman 2020).

    The three estimators of "Approximating KL divergence"; k3 is GRPO's (Shao et al. 2024, Eq. 4).
    logprobs, ref_logprobs: [B, T] log-probs of the sampled tokens -> [B, T], in the logprobs'
    dtype (math in at least float32). Padding is not masked here: aggregate does that.
    k3 clamps d from above only, where e^d would overflow (d > ~88.6 in float32 and bfloat16,
    ~11.1 in float16, see overflow_bound): its value is then capped and its gradient 0. Below,
    it is exact for any d (at d = -30 it is 29, not a clamped 19).
    ref_logprobs are a constant and are detached.
    """
    check_choice("KL estimator", estimator, KL_ESTIMATORS)
    log_r = upcast(ref_logprobs.detach()) - upcast(logprobs)
    return KL_ESTIMATORS[estimator](log_r, logprobs.dtype).to(logprobs.dtype)
