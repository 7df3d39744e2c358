"""The equations of the notes, one pure tensor function each; they import only torch.

Glossary (the same everywhere):
    B  sequences (completions) in a batch      G  completions per prompt (a group)
    T  completion tokens, padded               N  rewards laid out group by group, N = B
    logprobs      log pi(a_t | s_t) of the sampled tokens under the policy being trained, [B, T]
    old_logprobs  the same under the policy that sampled them (pi_old), [B, T]
    ref_logprobs  the same under the frozen reference policy (pi_ref), [B, T]
    advantages    [B, T], or [B] for one value per sequence (broadcast over its tokens)
    mask          [B, T], 1.0 (or True) on real completion tokens, 0.0 (or False) on padding

dtypes: the math runs in at least float32 and results come back in the main input's dtype
(bfloat16 in, bfloat16 out); devices follow the inputs. Per-token functions return [B, T] and
do not mask; `aggregate` (and the scalar losses built on it) masks with torch.where, so NaN or
inf at padding never leaks. Constants of a surrogate (advantages, old and reference log-probs,
value targets) are detached inside; gae and returns_to_go leave autograd to the caller.
Option strings are checked against the tables AGGREGATIONS, KL_ESTIMATORS and DPO_LOSS_TYPES,
whose keys are the config option names.
"""

from rlnotes.notes.dpo import DPO_LOSS_TYPES, dpo_implicit_rewards, dpo_loss
from rlnotes.notes.gae import gae
from rlnotes.notes.grpo import group_advantages, grpo_loss, informative_groups
from rlnotes.notes.kl import KL_ESTIMATORS, kl_penalty
from rlnotes.notes.masked import (
    AGGREGATIONS,
    aggregate,
    aggregation_divisor,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from rlnotes.notes.policy_gradient import policy_gradient_loss
from rlnotes.notes.ppo import ppo_clip_fraction, ppo_clip_loss, ppo_loss, value_loss
from rlnotes.notes.reinforce import returns_to_go
from rlnotes.notes.reward_model import bradley_terry_loss
from rlnotes.notes.tis import truncated_is_weights

__all__ = [
    "AGGREGATIONS",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "aggregate",
    "aggregation_divisor",
    "bradley_terry_loss",
    "dpo_implicit_rewards",
    "dpo_loss",
    "gae",
    "group_advantages",
    "grpo_loss",
    "informative_groups",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_gradient_loss",
    "ppo_clip_fraction",
    "ppo_clip_loss",
    "ppo_loss",
    "returns_to_go",
    "truncated_is_weights",
    "value_loss",
]
