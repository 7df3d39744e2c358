import inspect
import math

import pytest
import torch

from rlnotes.notes import DPO_LOSS_TYPES, dpo_implicit_rewards, dpo_loss

from .helpers import DTYPES, assert_finite, assert_matches, tol, unmodified


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_dpo(pc, pr, rc, rr, beta, loss_type, ls):
    h = (pc - rc) - (pr - rr)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return -(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h)


def test_dpo_loss_hand_values():
    # h = (-1 - -2) - (-3 - -2.5) = 1 + 0.5 = 1.5; beta h = 0.15
    args = [torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.5)]
    # sigmoid: -log sigma(0.15) = log(1 + e^-0.15) = log(1.8607080) = 0.6209571
    assert dpo_loss(*args).loss.item() == pytest.approx(0.6209571, rel=1e-6)
    # ls = 0.1: -log sigma(-0.15) = 0.15 + 0.6209571 = 0.7709571;
    # 0.9 * 0.6209571 + 0.1 * 0.7709571 = 0.5588614 + 0.0770957 = 0.6359571
    assert dpo_loss(*args, label_smoothing=0.1).loss.item() == pytest.approx(0.6359571, rel=1e-6)
    # ipo: (1.5 - 1 / 0.2)^2 = (-3.5)^2 = 12.25
    assert dpo_loss(*args, loss_type="ipo").loss.item() == pytest.approx(12.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type,ls", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_loss_matches_loop_reference(dtype, loss_type, ls):
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-20 * torch.rand(4, 16, generator=gen)).to(dtype)
    out = unmodified(dpo_loss, pc, pr, rc, rr, 0.3, loss_type, ls).loss
    rows = zip(*(x.double().tolist() for x in (pc, pr, rc, rr)))
    expect = [ref_dpo(*xs, 0.3, loss_type, ls) for xs in rows]
    assert out.dtype == dtype and out.shape == (16,)
    assert_matches(out, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dpo_loss_is_log2_when_policy_equals_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    chosen, rejected = (-30 * torch.rand(2, 8, generator=gen)).to(dtype)
    out = dpo_loss(chosen, rejected, chosen, rejected).loss
    torch.testing.assert_close(out.float(), torch.full((8,), math.log(2)), **tol(dtype))


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    gen = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = -20 * torch.rand(4, 32, generator=gen)
    pc.requires_grad_()
    pr.requires_grad_()
    dpo_loss(pc, pr, rc, rr, beta=0.5).loss.sum().backward()
    assert torch.all(pc.grad < 0) and torch.all(pr.grad > 0)
    # d/d pi_c of -log sigma(beta h) = -beta sigma(-beta h); the opposite for pi_r.
    h = (pc - rc) - (pr - rr)
    torch.testing.assert_close(pc.grad, -0.5 * torch.sigmoid(-0.5 * h.detach()))
    torch.testing.assert_close(pr.grad, 0.5 * torch.sigmoid(-0.5 * h.detach()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loss_type", list(DPO_LOSS_TYPES))
def test_dpo_loss_large_margins_are_finite(dtype, loss_type):
    big = torch.tensor([-1e4, 1e4, 0.0], dtype=dtype).requires_grad_()
    zeros = torch.zeros(3, dtype=dtype)
    out = dpo_loss(big, zeros, zeros, zeros, beta=1.0, loss_type=loss_type).loss
    out.sum().backward()
    assert_finite(out, big.grad)


def test_dpo_rejects_unknown_type_and_smoothing_with_ipo():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="sigmoid, ipo"):
        dpo_loss(x, x, x, x, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="ipo", label_smoothing=0.1)


def test_dpo_implicit_rewards():
    policy = torch.tensor([-1.0, -4.0], requires_grad=True)
    ref = torch.tensor([-2.0, -3.0])
    rewards = unmodified(dpo_implicit_rewards, policy, ref, 0.1)
    torch.testing.assert_close(rewards, torch.tensor([0.1, -0.1]))  # 0.1 * (-1 + 2), 0.1 * (-4 + 3)
    assert rewards.requires_grad  # the caller decides whether to detach
    # The DPO loss is -log sigma of the chosen-minus-rejected implicit reward.
    margin = rewards[:1] - rewards[1:]
    out = dpo_loss(policy[:1], policy[1:], ref[:1], ref[1:], beta=0.1)
    torch.testing.assert_close(out.loss, -torch.nn.functional.logsigmoid(margin))
    # ... and reports those rewards, detached (they are for the log).
    torch.testing.assert_close(torch.cat([out.chosen_rewards, out.rejected_rewards]), rewards.detach())
    assert not out.chosen_rewards.requires_grad


def test_dpo_signature_defaults():
    params = inspect.signature(dpo_loss).parameters.values()
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    assert defaults == {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0}
