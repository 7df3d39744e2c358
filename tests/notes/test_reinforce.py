import pytest
import torch

from rlnotes.notes import returns_to_go

from .helpers import (
    DTYPES,
    assert_finite,
    assert_matches,
    make_mask,
    unmodified,
    with_padding_garbage,
)


def ref_returns(rewards, mask, gamma):
    """G_t from its definition: discounted sum over the real tokens from t on."""
    out = [[0.0] * len(row) for row in rewards]
    for i, (r, m) in enumerate(zip(rewards, mask)):
        real = [t for t in range(len(r)) if m[t]]
        for j, t in enumerate(real):
            out[i][t] = sum(gamma ** (k - j) * r[real[k]] for k in range(j, len(real)))
    return out


def test_returns_to_go_hand_values():
    # gamma = 0.5: G_2 = 2, G_1 = 0 + 0.5 * 2 = 1, G_0 = 1 + 0.5 * 1 = 1.5; padding -> 0.
    rewards = torch.tensor([[1.0, 0.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(returns_to_go(rewards, mask, 0.5), torch.tensor([[1.5, 1.0, 2.0, 0.0]]))
    # A padding gap is skipped, not a step: the same returns with a hole at position 1.
    rewards = torch.tensor([[1.0, 7.0, 0.0, 2.0]])
    mask = torch.tensor([[True, False, True, True]])
    torch.testing.assert_close(returns_to_go(rewards, mask, 0.5), torch.tensor([[1.5, 0.0, 1.0, 2.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["right", "arbitrary"])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_returns_to_go_matches_loop_reference(dtype, kind, gamma):
    gen = torch.Generator().manual_seed(0)
    for B, T in [(4, 1), (6, 5), (8, 17)]:
        mask = make_mask(gen, B, T, kind)
        rewards = torch.randn(B, T, generator=gen).to(dtype)
        out = unmodified(returns_to_go, with_padding_garbage(rewards, mask), mask.float(), gamma)
        ref = ref_returns(rewards.double().tolist(), mask.tolist(), gamma)
        assert out.dtype == dtype and out.shape == (B, T)
        assert_finite(out)
        assert_matches(out, ref, dtype)
        assert torch.all(out[~mask] == 0)


def test_returns_to_go_keeps_autograd():
    rewards = torch.randn(3, 4, requires_grad=True)
    returns_to_go(rewards, torch.ones(3, 4), 0.5).sum().backward()
    # d(sum_t G_t)/dr_s = sum_{t<=s} gamma^(s-t): 1, 1.5, 1.75, 1.875 for every row.
    torch.testing.assert_close(rewards.grad, torch.tensor([[1.0, 1.5, 1.75, 1.875]]).expand(3, 4))


def test_kl_penalized_rewards_put_the_outcome_on_the_last_real_token():
    from rlnotes.notes.reinforce import kl_penalized_rewards

    rewards = torch.tensor([1.0, -2.0])
    kl = torch.tensor([[0.5, 1.0, 2.0], [0.1, 0.2, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # r_t = R 1[t = last] - beta KL_t, beta = 0.1
    torch.testing.assert_close(kl_penalized_rewards(rewards, kl, mask, 0.1),
                               torch.tensor([[-0.05, 1.0 - 0.1, -0.2], [-0.01, -0.02, -2.0 - 0.03]]))
