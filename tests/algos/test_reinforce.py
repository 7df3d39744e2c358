"""REINFORCE end to end on the tiny model, and its baselines by hand."""

import json
import math

import pytest
import torch
from rich.console import Console

from rlnotes.algos.reinforce import mean_baseline
from rlnotes.commands.train import train
from rlnotes.notes.reinforce import leave_one_out_baseline, terminal_rewards
from tests.conftest import compose


def run(tmp_path, *overrides):
    cfg = compose("logging.progress=false", "algo=reinforce", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def mean_reward(rows):
    return sum(r["reward/mean"] for r in rows) / len(rows)


def test_rloo_learns_to_write_the_letter(tmp_path):
    rows = run(tmp_path, "algo=rloo", "trainer.steps=40")
    first, last = mean_reward(rows[:5]), mean_reward(rows[-5:])
    assert first < 0.1 and last > first + 0.5, (first, last)


@pytest.mark.parametrize("baseline", ["none", "mean", "value"])
def test_every_baseline_raises_the_reward(tmp_path, baseline):
    rows = run(tmp_path, f"algo.baseline={baseline}", "trainer.steps=30")
    first, last = mean_reward(rows[:5]), mean_reward(rows[-5:])
    assert last > first + 0.3, (first, last)
    assert ("value/loss" in rows[-1]) == (baseline == "value")
    assert (tmp_path / "final" / "value_head.safetensors").exists() == (baseline == "value")


def test_leave_one_out_baseline_by_hand():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 1.0, 1.0])
    expected = torch.tensor([9 / 3, 8 / 3, 7 / 3, 6 / 3, 2 / 3, 2 / 3, 1 / 3, 1 / 3])
    torch.testing.assert_close(leave_one_out_baseline(returns, 4), expected)
    # G = 2: each completion's baseline is the other one's return.
    torch.testing.assert_close(leave_one_out_baseline(returns[:4], 2), torch.tensor([2.0, 1.0, 4.0, 3.0]))
    with pytest.raises(ValueError):
        leave_one_out_baseline(returns, 1)


def test_running_mean_baseline_updates():
    state = {}
    assert mean_baseline(state, torch.tensor([1.0, 3.0]), 0.9).tolist() == [2.0, 2.0]  # first batch: its mean
    assert state["reinforce/mean_return"] == pytest.approx(2.0)
    assert mean_baseline(state, torch.tensor([0.0, 0.0]), 0.9).tolist() == [2.0, 2.0]  # earlier batches only
    assert state["reinforce/mean_return"] == pytest.approx(0.9 * 2.0 + 0.1 * 0.0)
    torch.testing.assert_close(mean_baseline(state, torch.tensor([5.0]), 0.9), torch.tensor([1.8]))


def test_terminal_rewards_sit_on_the_last_real_token():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_large_kl_penalty_keeps_the_policy_near_the_reference(tmp_path):
    free = run(tmp_path / "free", "algo.beta=0.001", "trainer.steps=20")
    held = run(tmp_path / "held", "algo.beta=2.0", "trainer.steps=20")
    kl = lambda rows: sum(r["kl/ref"] for r in rows[-5:]) / 5  # noqa: E731
    assert kl(held) < 0.5 * kl(free), (kl(held), kl(free))


def test_presets_and_checks():
    from rlnotes.commands.cli import UsageError

    cfg = compose("algo=rloo")
    assert (cfg.algo.name, cfg.algo.baseline, cfg.algo.group_size, cfg.data.name) == ("reinforce", "group", 4,
                                                                                       "letters")
    with pytest.raises(UsageError, match="group_size"):
        compose("algo=rloo", "algo.group_size=1")
    with pytest.raises(UsageError, match="algo.baseline"):
        compose("algo=reinforce", "algo.baseline=median")


@pytest.mark.slow
def test_reinforce_smollm2_two_steps(tmp_path):
    rows = run(tmp_path, "model=smollm2-135m", "data=arith", "algo=rloo", "trainer.steps=2",
               "rollout.max_new_tokens=32")
    assert all(math.isfinite(r["loss"]) and r["optim/grad_norm"] > 0 for r in rows)
