"""Rewards: the built-in reward functions (importable from here: `from rlnotes.rewards import
number_match`), a user's functions resolved by import path or file, their weighted sum robust to a
function that fails (rlnotes.rewards.scoring.Rewards), and reward models (rlnotes.rewards.model)."""

from rlnotes.rewards.builtin import (
    REWARDS,
    countdown,
    exact_match,
    format_match,
    length_penalty,
    letter_share,
    math_match,
    number_match,
    reward_model,
)

__all__ = ["REWARDS", "countdown", "exact_match", "format_match", "length_penalty", "letter_share", "math_match",
           "number_match", "reward_model"]
