import pytest
import torch

from rlnotes.notes import gae, returns_to_go

from .helpers import (
    DTYPES,
    assert_finite,
    assert_matches,
    make_mask,
    unmodified,
    with_padding_garbage,
)


def ref_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l} from the definition, over the real tokens of each row."""
    adv = [[0.0] * len(row) for row in rewards]
    ret = [[0.0] * len(row) for row in rewards]
    for i, (r, v, m) in enumerate(zip(rewards, values, mask)):
        real = [t for t in range(len(r)) if m[t]]
        next_v = [v[real[j + 1]] if j + 1 < len(real) else 0.0 for j in range(len(real))]
        delta = [r[t] + gamma * next_v[j] - v[t] for j, t in enumerate(real)]
        for j, t in enumerate(real):
            adv[i][t] = sum((gamma * lam) ** (k - j) * delta[k] for k in range(j, len(real)))
            ret[i][t] = adv[i][t] + v[t]
    return adv, ret


def test_gae_hand_values():
    # gamma 0.9, lam 0.8, gamma lam = 0.72:
    # delta_2 = 1 + 0.9*0 - 0.7 = 0.3;  delta_1 = 0.9*0.7 - 0.6 = 0.03;  delta_0 = 0.9*0.6 - 0.5 = 0.04
    # A_2 = 0.3;  A_1 = 0.03 + 0.72*0.3 = 0.246;  A_0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = 0.71712, 0.846, 1.0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.8]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))
    # The same tokens with a padding hole at position 1 give the same numbers around it.
    adv, ret = gae(
        torch.tensor([[0.0, 5.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 9.0, 0.6, 0.7]]),
        torch.tensor([[True, False, True, True]]),
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.0, 0.246, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.0, 0.846, 1.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["right", "arbitrary"])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (0.8, 0.0)])
def test_gae_matches_loop_reference(dtype, kind, gamma, lam):
    gen = torch.Generator().manual_seed(0)
    for B, T in [(4, 1), (6, 5), (8, 17)]:
        mask = make_mask(gen, B, T, kind)
        rewards = torch.randn(B, T, generator=gen).to(dtype)
        values = torch.randn(B, T, generator=gen).to(dtype)
        r, v = with_padding_garbage(rewards, mask), with_padding_garbage(values, mask)
        adv, ret = unmodified(gae, r, v, mask.float(), gamma, lam)
        r, v = rewards.double().tolist(), values.double().tolist()
        ref_adv, ref_ret = ref_gae(r, v, mask.tolist(), gamma, lam)
        assert adv.dtype == ret.dtype == dtype
        assert_finite(adv, ret)
        assert_matches(adv, ref_adv, dtype)
        assert_matches(ret, ref_ret, dtype)
        assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


@pytest.mark.parametrize("kind", ["right", "arbitrary"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_lambda_one_is_return_minus_value(kind, gamma):
    gen = torch.Generator().manual_seed(1)
    mask = make_mask(gen, 6, 9, kind)
    rewards, values = torch.randn(2, 6, 9, generator=gen)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=1.0)
    g = returns_to_go(rewards, mask, gamma)
    torch.testing.assert_close(adv, torch.where(mask, g - values, 0.0))
    torch.testing.assert_close(ret, g)  # with lam = 1 the value target is the Monte Carlo return


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_lambda_zero_is_td_residual(gamma):
    gen = torch.Generator().manual_seed(2)
    mask = make_mask(gen, 6, 9, "right")
    rewards, values = torch.randn(2, 6, 9, generator=gen)
    # Right padding: the next value is the next column while it is real, else 0.
    next_values = torch.where(mask[:, 1:], values[:, 1:], 0.0)
    next_values = torch.cat([next_values, torch.zeros(6, 1)], dim=1)
    delta = torch.where(mask, rewards + gamma * next_values - values, 0.0)
    adv, _ = gae(rewards, values, mask, gamma=gamma, lam=0.0)
    torch.testing.assert_close(adv, delta)


def test_gae_leaves_autograd_to_the_caller():
    values = torch.randn(2, 3, requires_grad=True)
    adv, ret = gae(torch.randn(2, 3), values, torch.ones(2, 3))
    assert adv.requires_grad and ret.requires_grad
