import math

import pytest
import torch

from rlnotes.notes import KL_ESTIMATORS, kl_penalty

from .helpers import DTYPES, assert_finite, assert_matches, unmodified


def ref_kl(logp, ref, estimator):
    d = ref - logp  # log pi_ref - log pi
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    d = min(max(d, -20.0), 20.0)  # the documented clamp
    return math.exp(d) - d - 1


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_k3_is_nonnegative_and_finite_everywhere(dtype):
    d = torch.cat([torch.linspace(-60, 60, 2001), torch.tensor([-1e-6, 1e-7, 0.0, 1e4, -1e4])])
    logp = torch.zeros_like(d).to(dtype)
    out = kl_penalty(logp, d.to(dtype), "k3")
    assert_finite(out)
    assert torch.all(out >= 0)
    assert out.max().item() == pytest.approx(math.exp(20) - 21, rel=1e-2)  # the clamp caps it


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
