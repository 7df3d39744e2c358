"""The Bradley-Terry loss that trains a reward model on preference pairs."""

import torch.nn.functional as F
from torch import Tensor

from rlnotes.notes._common import upcast


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """-log sigma(r(x, y_w) - r(x, y_l)) (Ouyang et al. 2022, InstructGPT, Eq. 1).

    chosen_rewards, rejected_rewards: [B] scalar rewards -> per-pair loss [B], float32 compute,
    returned in the chosen rewards' dtype. The paper averages over all K choose 2 pairs of a
    prompt; here each row is one pair and the caller averages.
    """
    margin = upcast(chosen_rewards) - upcast(rejected_rewards)
    return (-F.logsigmoid(margin)).to(chosen_rewards.dtype)
