import pytest
import torch

from rlnotes.notes import AGGREGATIONS, policy_gradient_loss

from .helpers import (
    DTYPES,
    assert_finite,
    assert_matches,
    make_mask,
    ref_aggregate,
    unmodified,
    with_padding_garbage,
)


def test_policy_gradient_loss_hand_value():
    # Per token -A log pi: row 0 (A = 1): 1, 2; row 1 (A = -2): -1, padding.
    # token-mean: (1 + 2 - 1) / 3 = 2/3; seq-mean-token-mean: (3/2 + -1/1) / 2 = 0.25
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert policy_gradient_loss(logprobs, advantages, mask).item() == pytest.approx(2 / 3)
    per_seq = policy_gradient_loss(logprobs, advantages, mask, "seq-mean-token-mean")
    assert per_seq.item() == pytest.approx(0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_policy_gradient_loss_matches_loop_reference(dtype, mode):
    gen = torch.Generator().manual_seed(0)
    B, T = 7, 6
    mask = make_mask(gen, B, T, "right")
    logprobs = -torch.rand(B, T, generator=gen).to(dtype) * 3
    for adv in (torch.randn(B, generator=gen).to(dtype), torch.randn(B, T, generator=gen).to(dtype)):
        a = adv.double().tolist()
        per_token = [
            [-(a[i][t] if adv.dim() == 2 else a[i]) * lp for t, lp in enumerate(row)]
            for i, row in enumerate(logprobs.double().tolist())
        ]
        ref = ref_aggregate(per_token, mask.tolist(), mode)
        out = unmodified(policy_gradient_loss, with_padding_garbage(logprobs, mask), adv, mask, mode)
        assert_finite(out)
        assert_matches(out, ref, dtype)


def test_sequence_advantages_broadcast_and_are_detached():
    gen = torch.Generator().manual_seed(1)
    logprobs = torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, generator=gen, requires_grad=True)
    mask = make_mask(gen, 4, 5, "right")
    per_seq = policy_gradient_loss(logprobs, adv, mask)
    expanded = policy_gradient_loss(logprobs, adv.detach()[:, None].expand(4, 5), mask)
    torch.testing.assert_close(per_seq, expanded)
    assert not per_seq.requires_grad  # no path to the advantages


def test_surrogate_gradient_is_the_reinforce_estimator_on_a_bandit():
    """Softmax bandit: the mean surrogate gradient estimates grad_theta sum_a pi(a) r(a)."""
    gen = torch.Generator().manual_seed(0)
    n = 20000
    logits = torch.tensor([0.5, -0.3, 0.1, 0.0], dtype=torch.float64, requires_grad=True)
    reward = torch.tensor([1.0, 0.0, 2.0, -1.0], dtype=torch.float64)
    pi = torch.softmax(logits, 0).detach()
    exact = pi * (reward - (pi * reward).sum())  # d/dtheta_k sum_a pi_a r_a = pi_k (r_k - E[r])

    actions = torch.multinomial(pi, n, replacement=True, generator=gen)
    logprobs = torch.log_softmax(logits, 0)[actions].unsqueeze(1)  # [n, 1]: one token per sample
    logprobs.retain_grad()
    loss = policy_gradient_loss(logprobs, reward[actions], torch.ones(n, 1))
    loss.backward()
    estimate = -logits.grad  # descent on the loss is ascent on expected reward

    # Per-sample gradients g_n = r(a_n) (onehot(a_n) - pi), for the standard error.
    per_sample = -n * logprobs.grad * (torch.nn.functional.one_hot(actions, 4) - pi)
    torch.testing.assert_close(per_sample.mean(0), estimate)
    stderr = per_sample.std(0) / n**0.5
    assert torch.all((estimate - exact).abs() < 5 * stderr), (estimate, exact, stderr)
    assert torch.all(exact.abs() > 10 * stderr)  # the check has power: the signal dwarfs the noise
