"""Masked reductions, and the named ways to turn per-token losses into one scalar.

Every reduction selects real tokens with `torch.where`, not `v * mask`, so NaN or inf at padding
never reaches the result (0 * inf is NaN). Sums run in at least float32; results come back in
the values' dtype.
"""

import torch
from torch import Tensor

from rlnotes.notes._common import as_bool, check_choice, upcast


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(v * m), over everything or along `dim`.

    values, mask: broadcastable, typically [B, T]. Returns a scalar, or values reduced over `dim`.
    """
    kept = torch.where(as_bool(mask), upcast(values), 0.0)
    total = kept.sum() if dim is None else kept.sum(dim)
    return total.to(values.dtype)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(v * m) / sum(m), over everything or along `dim`; 0 where there are no real tokens.

    values, mask: broadcastable, typically [B, T]. Returns a scalar, or values reduced over `dim`.
    """
    m = as_bool(mask)
    kept = torch.where(m, upcast(values), 0.0)
    count = m.expand_as(kept).to(kept.dtype)
    if dim is None:
        return (kept.sum() / count.sum().clamp(min=1)).to(values.dtype)
    return (kept.sum(dim) / count.sum(dim).clamp(min=1)).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the real tokens (PPO implementations' advantage norm).

    values, mask: [B, T] -> [B, T], 0 at padding. mean and var are over all real tokens of the
    batch; var is the population variance (divide by n), so one real token gives 0, not NaN.
    shift_mean=False adds the mean back: the values are rescaled but keep their mean.
    """
    m = as_bool(mask)
    x = upcast(values)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    white = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        white = white + mean
    return torch.where(m, white, 0.0).to(values.dtype)


# Each takes per-token values already zeroed at padding (upcast), the bool mask and max_len.
def _token_mean(v: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return v.sum() / m.sum().clamp(min=1)


def _seq_mean_token_mean(v: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return (v.sum(-1) / m.sum(-1).clamp(min=1)).mean()


def _seq_mean_token_sum(v: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    return v.sum(-1).mean()


def _seq_mean_token_sum_norm(v: Tensor, m: Tensor, max_len: int | None) -> Tensor:
    rows = v.numel() // v.shape[-1]
    return v.sum() / (rows * (max_len or v.shape[-1]))


# Keys are the config option names.
AGGREGATIONS = {
    # DAPO (Yu et al. 2025, Sec. 3.3): every token of the batch weighs the same.
    "token-mean": _token_mean,
    # GRPO (Shao et al. 2024, Eq. 3): 1/G sum_i 1/|o_i| sum_t, every sequence weighs the same.
    "seq-mean-token-mean": _seq_mean_token_mean,
    # REINFORCE on whole sequences: log pi(o_i) = sum_t log pi(o_i,t).
    "seq-mean-token-sum": _seq_mean_token_sum,
    # Dr. GRPO (Liu et al. 2025): a constant 1/(B L) in place of 1/|o_i|, no length bias.
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


# The divisor Z of each mode, from a batch's real tokens, rows and L (see aggregation_divisor).
_DIVISORS = {
    "token-mean": lambda tokens, rows, length: tokens,
    "seq-mean-token-mean": lambda tokens, rows, length: rows,
    "seq-mean-token-sum": lambda tokens, rows, length: rows,
    "seq-mean-token-sum-norm": lambda tokens, rows, length: rows * length,
}


def aggregation_divisor(mode: str, tokens: float, rows: float, length: int) -> float:
    """Z of aggregate(v, m, mode) = S / Z, where S adds up over rows (sum_t v m, or each row's mean).

    Z = sum(m) for token-mean, B for seq-mean-token-mean and seq-mean-token-sum, B L for
    seq-mean-token-sum-norm; tokens = sum(m), rows = B and length = L of one batch. Split a batch
    into micro-batches k: aggregate(batch) = sum_k aggregate(k) Z_k / Z_batch, whatever the split.
    """
    check_choice("aggregation", mode, AGGREGATIONS)
    return _DIVISORS[mode](tokens, rows, length)


def aggregate(
    values: Tensor, mask: Tensor, mode: str = "token-mean", max_len: int | None = None
) -> Tensor:
    """Per-token values [B, T] -> one scalar, by a named rule (see AGGREGATIONS).

    token-mean: sum(v m) / sum(m). seq-mean-token-mean: 1/B sum_i sum_t(v m) / sum_t(m).
    seq-mean-token-sum: 1/B sum_i sum_t(v m). seq-mean-token-sum-norm: sum(v m) / (B L), with
    L = max_len or T (Liu et al. 2025, Dr. GRPO: a constant in place of |o_i|).
    values, mask: [B, T] (mask bool or 1.0/0.0). A row without real tokens adds 0, never NaN.
    """
    check_choice("aggregation", mode, AGGREGATIONS)
    m = as_bool(mask).expand_as(values)
    kept = torch.where(m, upcast(values), 0.0)
    return AGGREGATIONS[mode](kept, m, max_len).to(values.dtype)
