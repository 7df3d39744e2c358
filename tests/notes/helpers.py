"""Shared test helpers: dtypes and tolerances, padded masks with edge-case rows, input guards."""

import torch

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype: torch.dtype) -> dict:
    """Tolerances against a float64 reference computed from the same (rounded) inputs."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def make_mask(gen: torch.Generator, B: int, T: int, kind: str) -> torch.Tensor:
    """Bool [B, T] mask. Row 0 is empty, row 1 has one real token, row 2 is full (B >= 4).

    kind="right": real tokens are a prefix, padding on the right; "arbitrary": any pattern.
    """
    if kind == "right":
        lengths = torch.randint(0, T + 1, (B,), generator=gen)
        lengths[:3] = torch.tensor([0, 1, T])
        mask = torch.arange(T) < lengths[:, None]
    else:
        mask = torch.rand(B, T, generator=gen) < 0.6
        mask[0] = False
        mask[1] = False
        mask[1, torch.randint(0, T, (1,), generator=gen)] = True
        mask[2] = True
    return mask


def assert_matches(out: torch.Tensor, reference, dtype: torch.dtype) -> None:
    """out has the inputs' dtype and matches a float64 reference (a float or nested lists)."""
    assert out.dtype == dtype
    expected = torch.tensor(reference, dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected, **tol(dtype))


def with_padding_garbage(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with NaN and inf written at padding, to show they never leak into a masked result."""
    garbage = torch.full_like(x, float("nan"))
    garbage[..., ::2] = float("inf")
    return torch.where(mask, x, garbage)


def unmodified(fn, *args, **kwargs):
    """Call fn and assert that no tensor argument was changed in place; return its result."""
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*args, **kwargs)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return out


def assert_finite(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert torch.isfinite(t.float()).all(), t


def ref_aggregate(v, m, mode, max_len=None):
    """Slow reference on nested lists of floats."""
    B, T = len(v), len(v[0])
    rows_sum = [sum(v[i][t] for t in range(T) if m[i][t]) for i in range(B)]
    rows_len = [sum(1 for t in range(T) if m[i][t]) for i in range(B)]
    if mode == "token-mean":
        return sum(rows_sum) / sum(rows_len) if sum(rows_len) else 0.0
    if mode == "seq-mean-token-mean":
        return sum(s / n if n else 0.0 for s, n in zip(rows_sum, rows_len)) / B
    if mode == "seq-mean-token-sum":
        return sum(rows_sum) / B
    if mode == "seq-mean-token-sum-norm":
        return sum(rows_sum) / (B * (max_len or T))
    raise AssertionError(mode)
