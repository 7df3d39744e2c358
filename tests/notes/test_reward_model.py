import math

import pytest
import torch

from rlnotes.notes import bradley_terry_loss

from .helpers import DTYPES, assert_finite, assert_matches, unmodified


def test_bradley_terry_hand_values():
    # -log sigma(2 - 1) = log(1 + e^-1) = 0.3132617; equal rewards give log 2; a reversed pair
    # -log sigma(-1) = log(1 + e) = 1.3132617.
    out = bradley_terry_loss(torch.tensor([2.0, 0.5, 1.0]), torch.tensor([1.0, 0.5, 2.0]))
    torch.testing.assert_close(out, torch.tensor([0.3132617, math.log(2), 1.3132617]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bradley_terry_matches_loop_reference_and_is_stable(dtype):
    gen = torch.Generator().manual_seed(0)
    chosen, rejected = (5 * torch.randn(2, 32, generator=gen)).to(dtype)
    chosen[:2] = torch.tensor([1e4, -1e4])  # huge margins either way
    out = unmodified(bradley_terry_loss, chosen, rejected)
    expect = [
        math.log1p(math.exp(-(c - r))) if c >= r else (r - c) + math.log1p(math.exp(c - r))
        for c, r in zip(chosen.double().tolist(), rejected.double().tolist())
    ]
    assert_finite(out)
    assert_matches(out, expect, dtype)


def test_bradley_terry_gradient_widens_the_margin():
    chosen = torch.randn(8, requires_grad=True)
    rejected = torch.randn(8, requires_grad=True)
    bradley_terry_loss(chosen, rejected).sum().backward()
    assert torch.all(chosen.grad < 0) and torch.all(rejected.grad > 0)
    torch.testing.assert_close(chosen.grad, -rejected.grad)
