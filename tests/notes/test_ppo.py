import math

import pytest
import torch

from rlnotes.notes import ppo_clip_fraction, ppo_clip_loss, value_loss

from .helpers import DTYPES, assert_finite, assert_matches, make_mask, unmodified


def ref_ppo(logp, old, adv, eps_low, eps_high):
    rho = math.exp(logp - old)
    return -min(rho * adv, min(max(rho, 1 - eps_low), 1 + eps_high) * adv)


def ref_value(v, old, ret, eps):
    loss = (v - ret) ** 2
    if eps is not None:
        loss = max(loss, (min(max(v, old - eps), old + eps) - ret) ** 2)
    return 0.5 * loss


def ppo_at(rho, adv, **kwargs):
    """ppo_clip_loss for explicit ratios: logprobs = log rho, old_logprobs = 0."""
    rho, adv = torch.tensor(rho).log(), torch.tensor(adv)
    return ppo_clip_loss(rho, torch.zeros_like(rho), adv, **kwargs)


def test_ppo_clip_loss_hand_values_at_and_beyond_the_clip():
    # eps = 0.2. A = +1: the gain stops at rho = 1.2; A = -1: the loss stops falling at rho = 0.8.
    rho = [0.7, 0.8, 1.0, 1.2, 1.3]
    torch.testing.assert_close(ppo_at(rho, [1.0] * 5), torch.tensor([-0.7, -0.8, -1.0, -1.2, -1.2]))
    torch.testing.assert_close(ppo_at(rho, [-1.0] * 5), torch.tensor([0.8, 0.8, 1.0, 1.2, 1.3]))
    # Just beyond the boundary the clipped value holds exactly.
    torch.testing.assert_close(ppo_at([1.2001], [2.0]), torch.tensor([-2.4]))
    torch.testing.assert_close(ppo_at([0.7999], [-2.0]), torch.tensor([1.6]))
    # DAPO clip-higher, eps_high = 0.28: rho = 1.25 is no longer clipped, 1.3 clips at 1.28;
    # the low side still clips at 0.8: -min(-0.75, -0.8) = 0.8.
    high = {"clip_eps": 0.2, "clip_eps_high": 0.28}
    torch.testing.assert_close(ppo_at([1.25, 1.3], [1.0, 1.0], **high), torch.tensor([-1.25, -1.28]))
    torch.testing.assert_close(ppo_at([0.75], [-1.0], **high), torch.tensor([0.8]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps_high", [None, 0.28])
def test_ppo_clip_loss_matches_loop_reference(dtype, eps_high):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 9
    old = (-3 * torch.rand(B, T, generator=gen)).to(dtype)
    logp = (old.float() + 0.4 * torch.randn(B, T, generator=gen)).to(dtype)
    for adv in (torch.randn(B, generator=gen).to(dtype), torch.randn(B, T, generator=gen).to(dtype)):
        out = unmodified(ppo_clip_loss, logp, old, adv, 0.2, eps_high)
        a = adv.double().tolist()
        ref = [
            [
                ref_ppo(lp, o, a[i][t] if adv.dim() == 2 else a[i], 0.2, eps_high or 0.2)
                for t, (lp, o) in enumerate(zip(row_lp, row_o))
            ]
            for i, (row_lp, row_o) in enumerate(zip(logp.double().tolist(), old.double().tolist()))
        ]
        assert out.dtype == dtype and out.shape == (B, T)
        assert_matches(out, ref, dtype)


def test_ppo_gradient_is_zero_exactly_where_the_clip_binds():
    rho = torch.tensor([0.5, 0.7, 0.9, 1.0, 1.1, 1.3, 1.5])
    for sign in (1.0, -1.0):
        adv = torch.full_like(rho, 2.0 * sign)
        logp = rho.log().requires_grad_()
        ppo_clip_loss(logp, torch.zeros_like(rho), adv).sum().backward()
        binds = (rho > 1.2) if sign > 0 else (rho < 0.8)
        # d(-rho A)/d log pi = -rho A where the unclipped term is the min; 0 where the clip binds.
        expect = torch.where(binds, 0.0, -rho * adv)
        torch.testing.assert_close(logp.grad, expect)
        assert torch.all((logp.grad == 0) == binds)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ppo_clip_loss_extreme_ratios_stay_finite(dtype):
    logp = torch.tensor([[-100.0, 0.0, -1e-3, -50.0]], dtype=dtype)
    old = torch.tensor([[0.0, -100.0, 0.0, -50.0]], dtype=dtype)
    for adv in (torch.ones(1, dtype=dtype), -torch.ones(1, dtype=dtype)):
        assert_finite(ppo_clip_loss(logp, old, adv))


def test_old_logprobs_and_advantages_are_constants():
    logp = torch.randn(2, 3, requires_grad=True)
    adv = torch.randn(2, requires_grad=True)
    ppo_clip_loss(logp, logp, adv).sum().backward()  # the same tensor as old: rho = 1, grad = -A
    torch.testing.assert_close(logp.grad, -adv.detach()[:, None].expand(2, 3))
    assert adv.grad is None


def test_ppo_clip_fraction_hand_value():
    # rho 0.5 with A < 0: clipped; rho 1.0: not; rho 1.5 with A > 0: clipped;
    # rho 1.5 with A < 0: unclipped branch is the min; last token is padding. -> 2 / 4 = 0.5
    logp = torch.tensor([[0.5, 1.0, 1.5, 1.5, 1.5]]).log()
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    frac = unmodified(ppo_clip_fraction, logp, torch.zeros_like(logp), adv, mask)
    assert frac.item() == pytest.approx(0.5)
    higher = ppo_clip_fraction(logp, torch.zeros_like(logp), adv, mask, 0.2, 0.6)  # 1.5 < 1.6 now
    assert higher.item() == pytest.approx(0.25)
    assert ppo_clip_fraction(logp, logp, adv, torch.zeros(1, 5)).item() == 0.0  # no real tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_ppo_clip_fraction_matches_loop_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    B, T = 8, 7
    mask = make_mask(gen, B, T, "right")
    old = torch.zeros(B, T, dtype=dtype)
    logp = (0.3 * torch.randn(B, T, generator=gen)).to(dtype)
    adv = torch.randn(B, generator=gen).to(dtype)
    lp, a, m = logp.double().tolist(), adv.double().tolist(), mask.tolist()
    hits = [
        (a[i] > 0 and math.exp(lp[i][t]) > 1.2) or (a[i] < 0 and math.exp(lp[i][t]) < 0.8)
        for i in range(B)
        for t in range(T)
        if m[i][t]
    ]
    frac = ppo_clip_fraction(logp, old, adv, mask)
    assert 0 < sum(hits) < len(hits)  # both kinds of token are present
    assert frac.item() == pytest.approx(sum(hits) / len(hits), abs=1e-6)


def test_value_loss_hand_values():
    # old 1.5, eps 0.2: V is clipped into [1.3, 1.7].
    # V=1.0, R=2: max((1-2)^2 = 1, (1.3-2)^2 = 0.49) = 1 -> 0.5
    # V=2.5, R=2: max(0.25, (1.7-2)^2 = 0.09) = 0.25 -> 0.125
    # V=2.5, R=3: max(0.25, (1.7-3)^2 = 1.69) = 1.69 -> 0.845
    values = torch.tensor([1.0, 2.5, 2.5])
    old = torch.full((3,), 1.5)
    returns = torch.tensor([2.0, 2.0, 3.0])
    torch.testing.assert_close(value_loss(values, old, returns, 0.2), torch.tensor([0.5, 0.125, 0.845]))
    torch.testing.assert_close(value_loss(values, None, returns), torch.tensor([0.5, 0.125, 0.125]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [None, 0.2])
def test_value_loss_matches_loop_reference(dtype, eps):
    gen = torch.Generator().manual_seed(2)
    values, old, returns = (torch.randn(3, 5, 6, generator=gen)).to(dtype)
    out = unmodified(value_loss, values, old, returns, eps)
    ref = [
        [ref_value(v, o, r, eps) for v, o, r in zip(*rows)]
        for rows in zip(values.double().tolist(), old.double().tolist(), returns.double().tolist())
    ]
    assert_matches(out, ref, dtype)


def test_value_loss_gradient_stops_where_the_clipped_error_wins():
    values = torch.tensor([2.5, 2.5], requires_grad=True)
    value_loss(values, torch.tensor([1.5, 1.5]), torch.tensor([2.0, 3.0]), 0.2).sum().backward()
    # Row 0: the unclipped error wins, grad = V - R = 0.5. Row 1: the clipped one wins, grad 0.
    torch.testing.assert_close(values.grad, torch.tensor([0.5, 0.0]))


def test_value_loss_clip_needs_old_values():
    with pytest.raises(ValueError, match="old_values"):
        value_loss(torch.zeros(2), None, torch.zeros(2), clip_eps=0.2)


def test_ppo_loss_is_the_sum_of_its_parts_and_reports_them():
    from rlnotes.notes import aggregate, kl_penalty, masked_mean, ppo_loss

    gen = torch.Generator().manual_seed(4)
    old, v, old_v, ret, entropy = torch.randn(5, 3, 4, generator=gen)
    logp, adv, mask = old + 0.5 * torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen), \
        torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    out = ppo_loss(logp, old, adv, v, old_v, ret, mask, clip_eps=0.1, value_clip_eps=0.2, vf_coef=0.5,
                   entropy=entropy, entropy_coef=0.01, aggregation="seq-mean-token-mean")
    agg = lambda x: aggregate(x, mask, "seq-mean-token-mean")  # noqa: E731
    v_loss = agg(value_loss(v, old_v, ret, 0.2))
    torch.testing.assert_close(out.loss, agg(ppo_clip_loss(logp, old, adv, 0.1)) + 0.5 * v_loss - 0.01 * agg(entropy))
    torch.testing.assert_close(out.value_loss, v_loss)
    torch.testing.assert_close(out.clip_frac, ppo_clip_fraction(logp, old, adv, mask, 0.1))
    torch.testing.assert_close(out.approx_kl, masked_mean(kl_penalty(old, logp, "k3"), mask))  # KL(pi_old || pi)
    assert 0 < out.clip_frac < 1
