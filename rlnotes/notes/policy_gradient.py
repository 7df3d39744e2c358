"""The policy-gradient surrogate: a loss whose gradient is the REINFORCE estimator."""

from torch import Tensor

from rlnotes.notes._common import per_token
from rlnotes.notes.masked import aggregate


def policy_gradient_loss(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, aggregation: str = "token-mean"
) -> Tensor:
    """L = aggregate(-A_t log pi(a_t | s_t)): -grad L is the REINFORCE estimator (Williams 1992).

    With A the return G_t (or G_t minus a baseline), -grad L estimates the policy gradient
    grad J = E[sum_t grad log pi(a_t | s_t) Q(s_t, a_t)] (Sutton et al. 1999, Thm. 1).

    logprobs: [B, T] log pi of the sampled tokens. advantages: [B, T], or [B] for one value per
    sequence (broadcast over its tokens). mask: [B, T]. Returns a scalar in the logprobs' dtype.
    The advantages are constants of the surrogate: they are detached here.
    """
    adv = per_token(advantages.detach(), logprobs)
    return aggregate(-adv * logprobs, mask, aggregation)
