import math

import pytest
import torch

from rlnotes.notes import (
    AGGREGATIONS,
    aggregate,
    aggregation_divisor,
    masked_mean,
    masked_sum,
    masked_whiten,
)

from .helpers import (
    DTYPES,
    assert_finite,
    assert_matches,
    make_mask,
    ref_aggregate,
    tol,
    unmodified,
    with_padding_garbage,
)


def ref_whiten(v, m, shift_mean):
    real = [v[i][t] for i in range(len(v)) for t in range(len(v[0])) if m[i][t]]
    mean = sum(real) / len(real) if real else 0.0
    var = sum((x - mean) ** 2 for x in real) / len(real) if real else 0.0
    scale = 1 / math.sqrt(var + 1e-8)
    shift = 0.0 if shift_mean else mean
    return [
        [(x - mean) * scale + shift if mi else 0.0 for x, mi in zip(row, mrow)]
        for row, mrow in zip(v, m)
    ]


def test_aggregate_hand_values():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, m, "token-mean").item() == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx(2.75)  # (3/2 + 4/1) / 2
    assert aggregate(v, m, "seq-mean-token-sum").item() == pytest.approx(3.5)  # (3 + 4) / 2
    assert aggregate(v, m, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 6)  # 7 / (2 * 3)
    assert aggregate(v, m, "seq-mean-token-sum-norm", max_len=7).item() == pytest.approx(0.5)  # 7/14


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["right", "arbitrary"])
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_aggregate_matches_loop_reference(dtype, kind, mode):
    gen = torch.Generator().manual_seed(0)
    for B, T in [(4, 1), (5, 7), (9, 13)]:
        mask = make_mask(gen, B, T, kind)
        v = torch.randn(B, T, generator=gen).to(dtype)
        ref = ref_aggregate(v.double().tolist(), mask.tolist(), mode, max_len=T + 3)
        out = unmodified(aggregate, with_padding_garbage(v, mask), mask.float(), mode, max_len=T + 3)
        assert out.dtype == dtype and out.shape == ()
        assert_finite(out)
        assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_aggregate_of_empty_mask_is_zero_with_finite_gradient(dtype, mode):
    v = torch.randn(3, 4).to(dtype).requires_grad_()
    out = aggregate(v, torch.zeros(3, 4), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(v.grad, torch.zeros_like(v))


def test_aggregate_bool_and_float_masks_agree_and_padding_does_not_matter():
    gen = torch.Generator().manual_seed(1)
    mask = make_mask(gen, 6, 5, "right")
    v = torch.randn(6, 5, generator=gen)
    for mode in AGGREGATIONS:
        a = aggregate(v, mask, mode)
        assert torch.equal(a, aggregate(v, mask.float(), mode))
        # Extra padding columns change nothing, except through L in the -norm mode.
        padded = torch.cat([v, torch.randn(6, 3, generator=gen)], dim=1)
        padded_mask = torch.cat([mask, torch.zeros(6, 3, dtype=torch.bool)], dim=1)
        torch.testing.assert_close(aggregate(padded, padded_mask, mode, max_len=5), a)


def test_aggregate_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-mean"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "sequence-mean")


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_sum_and_mean_match_loops(dtype):
    gen = torch.Generator().manual_seed(2)
    mask = make_mask(gen, 6, 5, "arbitrary")
    v = torch.randn(6, 5, generator=gen).to(dtype)
    vl, ml = v.double().tolist(), mask.tolist()
    row_sums = [sum(x for x, mi in zip(r, mr) if mi) for r, mr in zip(vl, ml)]
    row_lens = [sum(mr) for mr in ml]
    garbage = with_padding_garbage(v, mask)
    expect = {
        "sum": torch.tensor(sum(row_sums)),
        "mean": torch.tensor(sum(row_sums) / sum(row_lens)),
        "row_sum": torch.tensor(row_sums),
        "row_mean": torch.tensor([s / n if n else 0.0 for s, n in zip(row_sums, row_lens)]),
    }
    got = {
        "sum": unmodified(masked_sum, garbage, mask),
        "mean": unmodified(masked_mean, garbage, mask),
        "row_sum": masked_sum(garbage, mask, dim=-1),
        "row_mean": masked_mean(garbage, mask.float(), dim=1),
    }
    for key, out in got.items():
        assert out.dtype == dtype
        assert_finite(out)
        torch.testing.assert_close(out.double(), expect[key].double(), **tol(dtype))
    assert got["row_mean"][0].item() == 0.0  # row 0 is empty


def test_masked_whiten_hand_values():
    v = torch.tensor([[1.0, 2.0, 3.0, float("nan")]])
    m = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # mean 2, var (1 + 0 + 1) / 3 = 2/3, 1 / sqrt(2/3) = 1.2247
    torch.testing.assert_close(masked_whiten(v, m), torch.tensor([[-1.2247449, 0.0, 1.2247449, 0.0]]))
    # shift_mean=False adds the mean 2 back at real tokens.
    torch.testing.assert_close(
        masked_whiten(v, m, shift_mean=False), torch.tensor([[0.7752551, 2.0, 3.2247449, 0.0]])
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop_reference(dtype, shift_mean):
    gen = torch.Generator().manual_seed(3)
    mask = make_mask(gen, 7, 6, "arbitrary")
    v = (3 * torch.randn(7, 6, generator=gen) + 1).to(dtype)
    out = unmodified(masked_whiten, with_padding_garbage(v, mask), mask.float(), shift_mean)
    ref = ref_whiten(v.double().tolist(), mask.tolist(), shift_mean)
    assert_finite(out)
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_whiten_edge_cases_are_finite(dtype):
    empty = masked_whiten(torch.randn(2, 3).to(dtype), torch.zeros(2, 3))
    one = masked_whiten(torch.randn(2, 3).to(dtype), torch.tensor([[0, 1, 0], [0, 0, 0]]))
    const = masked_whiten(torch.full((2, 3), 5.0, dtype=dtype), torch.ones(2, 3))
    for out in (empty, one, const):
        assert torch.equal(out, torch.zeros_like(out))  # nothing to whiten: 0, not NaN


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batch_aggregates_weighted_by_their_divisors_add_up_to_the_batchs(mode):
    values = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 6.0, 0.0, 0.0]])
    mask = values != 0
    z = lambda m, length: aggregation_divisor(mode, float(m.sum()), m.shape[0], length)  # noqa: E731
    parts = sum(aggregate(values[k], mask[k], mode, 4) * z(mask[k], 4) for k in (slice(0, 1), slice(1, 3)))
    torch.testing.assert_close(parts / z(mask, 4), aggregate(values, mask, mode, 4))
