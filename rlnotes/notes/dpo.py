"""Direct preference optimization: the preference loss on the policy's implicit reward."""

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

from rlnotes.notes._common import check_choice, upcast


def _sigmoid(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    ls = label_smoothing
    return -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)


def _ipo(h: Tensor, beta: float, label_smoothing: float) -> Tensor:
    return (h - 1 / (2 * beta)) ** 2


# Keys are the config option names.
DPO_LOSS_TYPES = {"sigmoid": _sigmoid, "ipo": _ipo}


class DPOLoss(NamedTuple):
    """dpo_loss's per-pair losses and the implicit rewards it compared (detached, for the log)."""
    loss: Tensor              # [B] per-pair loss; its mean over pairs is what DPO minimises
    chosen_rewards: Tensor    # [B] r(x, y_w) = beta log pi/pi_ref (y_w), Eq. 5
    rejected_rewards: Tensor  # [B] r(x, y_l)


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOLoss:
    """-log sigma(beta h), h = log(pi/pi_ref)(y_w) - log(pi/pi_ref)(y_l) (Rafailov 2023, Eq. 7).

    Direct preference optimization (Rafailov et al. 2023).
    All inputs: [B] log-probs summed over each completion's tokens -> DPOLoss: the per-pair loss
    [B] in the policy's dtype (math in at least float32), and the implicit rewards of both sides.
    sigmoid: -(1 - ls) log sigma(beta h) - ls log sigma(-beta h); label_smoothing ls > 0 is the
    conservative DPO variant for noisy labels (not in the paper).
    ipo: (h - 1/(2 beta))^2 (Azar et al. 2023, IPO, with tau = beta); it takes no label_smoothing.
    Some implementations feed IPO length-averaged log-probs; pass those in if that is meant.
    """
    check_choice("DPO loss type", loss_type, DPO_LOSS_TYPES)
    if loss_type == "ipo" and label_smoothing != 0:
        raise ValueError("dpo_loss: label_smoothing applies to loss_type='sigmoid' only")
    h = (upcast(policy_chosen_logps) - upcast(ref_chosen_logps)) - (
        upcast(policy_rejected_logps) - upcast(ref_rejected_logps)
    )
    loss = DPO_LOSS_TYPES[loss_type](h, beta, label_smoothing).to(policy_chosen_logps.dtype)
    return DPOLoss(loss, dpo_implicit_rewards(policy_chosen_logps.detach(), ref_chosen_logps.detach(), beta),
                   dpo_implicit_rewards(policy_rejected_logps.detach(), ref_rejected_logps.detach(), beta))


def dpo_implicit_rewards(policy_logps: Tensor, ref_logps: Tensor, beta: float) -> Tensor:
    """r(x, y) = beta log pi(y|x) / pi_ref(y|x) (Rafailov et al. 2023, Eq. 5, less beta log Z(x)).

    policy_logps, ref_logps: [B] summed log-probs -> [B]. The beta log Z(x) term cancels in any
    comparison of two completions of one prompt, so it is left out. Not detached.
    """
    return beta * (policy_logps - ref_logps)
