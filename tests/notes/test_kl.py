import math

import pytest
import torch

from rlnotes.notes import KL_ESTIMATORS, kl_penalty
from rlnotes.notes.kl import overflow_bound

from .helpers import DTYPES, assert_finite, assert_matches, unmodified


def ref_kl(logp, ref, estimator):
    d = ref - logp  # log pi_ref - log pi
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return math.exp(d) - d - 1  # unclamped: the inputs here are far from overflow


def test_kl_penalty_hand_values():
    # log pi = -1, log pi_ref = -1.5: k1 = 0.5, k2 = 0.5 * 0.25 = 0.125,
    # k3 = exp(-0.5) - (-0.5) - 1 = 0.6065307 - 0.5 = 0.1065307
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.1065307, rel=1e-6)
    assert kl_penalty(logp, ref).item() == pytest.approx(0.1065307, rel=1e-6)  # k3 is the default


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
def test_kl_penalty_matches_loop_reference(dtype, estimator):
    gen = torch.Generator().manual_seed(0)
    logp = (-3 * torch.rand(5, 7, generator=gen)).to(dtype)
    ref = (-3 * torch.rand(5, 7, generator=gen)).to(dtype)
    out = unmodified(kl_penalty, logp, ref, estimator)
    expect = [
        [ref_kl(a, b, estimator) for a, b in zip(row_p, row_r)]
        for row_p, row_r in zip(logp.double().tolist(), ref.double().tolist())
    ]
    assert out.dtype == dtype and out.shape == (5, 7)
    assert_matches(out, expect, dtype)


# log r = log pi_ref - log pi from -200 to +80: far below the reference (where k3's old lower clamp
# at -20 capped it) up to just under float32's exp overflow (~88.7).
WIDE = torch.cat([torch.linspace(-200, 80, 561, dtype=torch.float64),
                  torch.tensor([-30.0, -20.5, -1e-6, 0.0, 1e-7, 20.5, 85.0], dtype=torch.float64)])
EXACT = {"k1": (lambda d: -d, lambda d: -torch.ones_like(d)),
         "k2": (lambda d: 0.5 * d * d, lambda d: d),
         "k3": (lambda d: torch.expm1(d) - d, lambda d: torch.expm1(d))}  # value, d/d(log r)


@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_match_the_unclamped_formula(estimator, dtype):
    """Against the plain formula in float64 over a wide range of log r: the same value and the
    same gradient w.r.t. log pi (which is -d/d(log r)) everywhere, no clamp below overflow."""
    d = WIDE.to(dtype).double()  # the reference sees the same rounded inputs
    logp = torch.zeros(len(d), dtype=dtype, requires_grad=True)
    out = kl_penalty(logp, d.to(dtype), estimator)
    out.sum().backward()
    value, grad = EXACT[estimator]
    torch.testing.assert_close(out.double(), value(d), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp.grad.double(), -grad(d), rtol=1e-6, atol=1e-6)


def test_k3_at_log_r_minus_30_is_29_with_gradient():
    """TRL's k3 at log r = -30 is e^-30 + 29 ~ 29.0; a clamp at -20 gave 19 and no gradient."""
    logp = torch.tensor([30.0 - 50.0], requires_grad=True)  # log pi = -20, log pi_ref = -50
    out = kl_penalty(logp, torch.tensor([-50.0]), "k3")
    out.backward()
    assert out.item() == pytest.approx(29.0, rel=1e-6)
    assert logp.grad.item() == pytest.approx(1.0, rel=1e-6)  # d k3 / d log pi = 1 - e^d


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
def test_k3_is_nonnegative_and_finite_everywhere(dtype):
    """Past the overflow point of the dtype, k3 is capped (value finite, gradient 0), never inf."""
    d = torch.cat([torch.linspace(-60, 60, 2001), torch.linspace(60, 1e4, 50), torch.tensor([-1e4, 1e30])])
    logp = torch.zeros(len(d), dtype=dtype, requires_grad=True)
    out = kl_penalty(logp, d.to(dtype), "k3")
    out.sum().backward()
    assert_finite(out, logp.grad)
    assert torch.all(out >= 0)
    cap = overflow_bound(torch.float32, dtype)
    assert out.max().item() == pytest.approx(math.exp(cap) - cap - 1, rel=1e-2)  # only the overflow clamp caps it
    below = d.to(dtype).double() < -cap
    expect = -1 - d.to(dtype).double()[below]  # e^d - 1 - d with e^d ~ 0: unclamped however far below
    torch.testing.assert_close(out.double()[below], expect, rtol=1e-2, atol=0)


@pytest.mark.parametrize("estimator", list(KL_ESTIMATORS))
def test_estimators_against_exact_kl_of_two_categoricals(estimator):
    pi = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    pi_ref = torch.tensor([0.3, 0.3, 0.25, 0.15], dtype=torch.float64)
    exact = (pi * (pi / pi_ref).log()).sum().item()  # 0.0298975
    assert exact == pytest.approx(0.0298975, rel=1e-5)
    k_all = kl_penalty(pi.log(), pi_ref.log(), estimator)  # the estimator at each outcome
    expectation = (pi * k_all).sum().item()
    n = 20000
    gen = torch.Generator().manual_seed(0)
    samples = k_all[torch.multinomial(pi, n, replacement=True, generator=gen)]
    stderr = samples.std().item() / n**0.5
    if estimator == "k2":  # biased, but close for nearby distributions
        assert expectation == pytest.approx(exact, rel=0.05)
        assert samples.mean().item() == pytest.approx(exact, abs=0.05 * exact + 5 * stderr)
    else:  # unbiased: exact in expectation, and the sample mean within 5 standard errors
        assert expectation == pytest.approx(exact, rel=1e-9)
        assert abs(samples.mean().item() - exact) < 5 * stderr
    assert (estimator != "k1") == bool(torch.all(k_all >= 0))  # only k1 goes negative here


def test_kl_gradients():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = logp.detach().clone().requires_grad_()
    # At pi = pi_ref: d k1/d log pi = 1, while k2 and k3 have zero gradient (a minimum).
    kl_penalty(logp, ref, "k1").sum().backward()
    torch.testing.assert_close(logp.grad, torch.ones(3))
    for estimator in ("k2", "k3"):
        logp.grad = None
        kl_penalty(logp, ref, estimator).sum().backward()
        torch.testing.assert_close(logp.grad, torch.zeros(3))
    assert ref.grad is None  # the reference is a constant


def test_unknown_estimator_names_the_choices():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
