import math
import statistics

import pytest
import torch

from rlnotes.notes import (
    AGGREGATIONS,
    group_advantages,
    grpo_loss,
    masked_mean,
    ppo_clip_fraction,
)

from .helpers import (
    DTYPES,
    assert_finite,
    assert_matches,
    make_mask,
    ref_aggregate,
    tol,
    unmodified,
)


def ref_group_advantages(rewards, group_size, scale_by_std, eps):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        out += [(r - mean) / (std + eps) if scale_by_std else r - mean for r in group]
    return out


def ref_grpo(logp, old, ref, adv, mask, eps, beta, mode):
    per_token = []
    for i in range(len(logp)):
        row = []
        for t in range(len(logp[0])):
            rho = math.exp(logp[i][t] - old[i][t])
            d = ref[i][t] - logp[i][t]
            kl = math.exp(d) - d - 1
            row.append(-min(rho * adv[i], min(max(rho, 1 - eps), 1 + eps) * adv[i]) + beta * kl)
        per_token.append(row)
    return ref_aggregate(per_token, mask, mode)


def test_group_advantages_hand_values():
    # Group 0: [1, 0, 0, 1], mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.5773503,
    # A = +-0.5 / (0.5773503 + 1e-4) = +-0.8658758. Group 1: all 2 -> exactly 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = 0.8658758
    expect = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(unmodified(group_advantages, rewards, 4), expect)
    # Dr. GRPO: centered only.
    expect = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, 4, scale_by_std=False), expect)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_group_advantages_match_loop_reference(dtype, scale_by_std, group_size):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(5 * group_size, generator=gen).to(dtype)
    rewards[:group_size] = 0.3  # one group of equal rewards
    out = group_advantages(rewards, group_size, scale_by_std)
    ref = ref_group_advantages(rewards.double().tolist(), group_size, scale_by_std, 1e-4)
    assert out.dtype == dtype and out.shape == rewards.shape
    assert_matches(out, ref, dtype)
    assert torch.all(out[:group_size] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [0.1, 1 / 3, -7.3, 1e6])
def test_equal_rewards_give_exactly_zero(dtype, value):
    for group_size in (1, 3, 5, 16):
        out = group_advantages(torch.full((2 * group_size,), value, dtype=dtype), group_size)
        assert torch.equal(out, torch.zeros_like(out))


def test_group_size_one_gives_zero_and_bad_sizes_raise():
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 5.0, -2.0]), 1), torch.zeros(3))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), 0)


def test_integer_rewards_give_float_advantages():
    out = group_advantages(torch.tensor([1, 0, 1, 1]), 2, scale_by_std=False)
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, 0.0, 0.0]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_grpo_loss_matches_loop_reference(dtype, mode):
    gen = torch.Generator().manual_seed(0)
    B, T = 8, 6
    mask = make_mask(gen, B, T, "right")
    old = (-2 * torch.rand(B, T, generator=gen)).to(dtype)
    logp = (old.float() + 0.3 * torch.randn(B, T, generator=gen)).to(dtype)
    ref = (old.float() + 0.3 * torch.randn(B, T, generator=gen)).to(dtype)
    adv = group_advantages(torch.randn(B, generator=gen), 4).to(dtype)
    out = unmodified(grpo_loss, logp, old, ref, adv, mask.float(), 0.2, 0.04, None, "k3", mode).loss
    expect = ref_grpo(
        *(x.double().tolist() for x in (logp, old, ref, adv)), mask.tolist(), 0.2, 0.04, mode
    )
    assert out.dtype == dtype and out.shape == ()
    assert_finite(out)
    assert_matches(out, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_gradient_at_pi_old_equals_pi_ref_is_the_policy_gradient(dtype):
    gen = torch.Generator().manual_seed(1)
    B, T = 6, 5
    mask = make_mask(gen, B, T, "right")
    logp = (-2 * torch.rand(B, T, generator=gen)).to(dtype).requires_grad_()
    adv = torch.randn(B, generator=gen).to(dtype)
    grpo_loss(logp, logp, logp, adv, mask).loss.backward()  # one tensor for pi, pi_old and pi_ref
    # seq-mean-token-mean: d L / d log pi_{i,t} = -(1/B) A_i / |o_i| on real tokens, else 0
    # (rho = 1 sits inside the clip, and k3 has zero gradient at pi = pi_ref).
    lengths = mask.sum(1, keepdim=True).clamp(min=1)
    expect = torch.where(mask, -adv.float()[:, None] / (B * lengths), 0.0)
    assert_finite(logp.grad)
    torch.testing.assert_close(logp.grad.float(), expect, **tol(dtype))


def test_grpo_kl_term_gradient_is_zero_only_at_the_reference():
    logp = torch.randn(3, 4).requires_grad_()
    mask, zero_adv = torch.ones(3, 4), torch.zeros(3)
    grpo_loss(logp, logp, logp.detach(), zero_adv, mask, beta=0.5).loss.backward()
    assert torch.equal(logp.grad, torch.zeros(3, 4))
    logp.grad = None
    grpo_loss(logp, logp, logp.detach() + 0.1, zero_adv, mask, beta=0.5).loss.backward()
    assert torch.all(logp.grad != 0)  # away from pi_ref the KL term does pull


def test_grpo_beta_zero_needs_no_reference_and_beta_positive_does():
    gen = torch.Generator().manual_seed(2)
    logp, old, ref = -torch.rand(3, 4, 5, generator=gen)
    adv, mask = torch.randn(4, generator=gen), torch.ones(4, 5)
    without_kl = grpo_loss(logp, old, ref, adv, mask, beta=0.0).loss
    torch.testing.assert_close(grpo_loss(logp, old, None, adv, mask, beta=0.0).loss, without_kl)
    assert grpo_loss(logp, old, ref, adv, mask, beta=0.1).loss > without_kl  # k3 >= 0 adds a penalty
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, None, adv, mask, beta=0.04)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        grpo_loss(logp, old, None, adv, mask, beta=0.0, kl_estimator="k5")
    with pytest.raises(ValueError, match="token-mean"):
        grpo_loss(logp, old, ref, adv, mask, aggregation="mean")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_loss_edge_rows_are_finite(dtype):
    # An empty row, a one-token row, equal rewards (A = 0), and garbage logprobs at padding.
    mask = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[nan, inf, -1.0], [-1.0, nan, 0.0], [-1.0, -2.0, -3.0]])
    logp = logp.to(dtype).requires_grad_()
    ref = torch.full((3, 3), -1.5, dtype=dtype)
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), 3).to(dtype)
    for mode in AGGREGATIONS:
        logp.grad = None
        out = grpo_loss(logp, logp.detach(), ref, adv, mask, aggregation=mode).loss
        out.backward()
        assert_finite(out, logp.grad)


def test_grpo_loss_reports_its_clip_fraction_and_kl():
    gen = torch.Generator().manual_seed(3)
    old, ref = -torch.rand(2, 4, 5, generator=gen)
    logp = old + 0.5 * torch.randn(4, 5, generator=gen)
    adv, mask = torch.randn(4, generator=gen), make_mask(gen, 4, 5, "right")
    out = grpo_loss(logp, old, ref, adv, mask, clip_eps=0.1, kl_estimator="k1")
    torch.testing.assert_close(out.clip_frac, ppo_clip_fraction(logp, old, adv, mask, 0.1))
    torch.testing.assert_close(out.kl, masked_mean(logp - ref, mask))
    assert 0 < out.clip_frac < 1
    assert grpo_loss(logp, old, None, adv, mask, beta=0.0).kl.isnan()  # no reference, no KL


def test_informative_groups_are_those_whose_rewards_differ():
    from rlnotes.notes import informative_groups

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    assert informative_groups(rewards, 3).tolist() == [True, True, False]
