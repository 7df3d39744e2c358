"""Helpers shared by the notes: mask coercion, per-token broadcasting, option checks."""

import torch
from torch import Tensor


def as_bool(mask: Tensor) -> Tensor:
    """The mask as bool; a float mask marks real tokens with 1.0 (any nonzero counts)."""
    return mask if mask.dtype == torch.bool else mask != 0


def upcast(x: Tensor) -> Tensor:
    """x in the dtype the math runs in: at least float32 (bfloat16 goes up, float64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def per_token(x: Tensor, like: Tensor) -> Tensor:
    """A per-sequence [B] tensor as [B, 1], so it broadcasts over the tokens of `like` [B, T]."""
    return x.unsqueeze(-1) if x.dim() == like.dim() - 1 else x


def check_choice(kind: str, choice: str, choices: dict) -> None:
    """One error line naming the valid keys when `choice` is not one of them."""
    if choice not in choices:
        raise ValueError(f"unknown {kind} {choice!r}; valid choices: {', '.join(choices)}")
