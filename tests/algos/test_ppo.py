"""PPO end to end on the tiny model: it learns, its critic learns, and it makes only the passes
the math needs."""

import json
import math
from statistics import median

import pytest
from rich.console import Console

from rlnotes.algos import ppo
from rlnotes.algos.registry import REGISTRY
from rlnotes.commands.train import train
from rlnotes.training.setup import setup
from tests.conftest import compose, record_forwards, record_passes

# 8 prompts x 4 completions per batch, two epochs of two minibatches: 4 optimizer steps a batch.
SMALL = ("algo.group_size=4", "algo.minibatch_size=16", "algo.epochs=2")


def run(tmp_path, *overrides):
    cfg = compose("logging.progress=false", "algo=ppo", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def test_ppo_learns_to_write_the_letter(tmp_path):
    # beta=0: on this sparse reward (mean 0.02 at first) the k1 penalty at beta=0.05 drowns the signal.
    rows = run(tmp_path, *SMALL, "algo.beta=0", "trainer.steps=64")
    first, last = mean(rows[:3], "reward/mean"), mean(rows[-3:], "reward/mean")
    assert first < 0.1 and last > first + 0.4, (first, last)
    assert [r["step"] for r in rows[:2]] == [4, 8]
    assert (tmp_path / "final" / "value_head.safetensors").exists()


@pytest.mark.long
def test_the_critic_learns_a_reward_it_can_predict(tmp_path, monkeypatch):
    """A reward fixed by the prompt: the policy cannot change it, V(s_t) can learn it."""
    (tmp_path / "prompt_reward.py").write_text(
        "def by_prompt(prompts, completions, **_):\n"
        "    return [1.0 if p.endswith(':') else 0.0 for p in prompts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = run(tmp_path / "run", "algo.group_size=4", "algo.minibatch_size=32", "algo.epochs=4", "algo.beta=0",
               "algo.value_clip_eps=null", "trainer.steps=120", "reward=custom",
               "reward.target=prompt_reward.by_prompt")
    # Medians: a batch whose prompts all get the same reward has Var(R) ~ 0 and a meaningless EV.
    loss, ev = ([r[key] for r in rows] for key in ("value/loss", "value/explained_variance"))
    assert median(loss[-8:]) < 0.5 * median(loss[:3]), loss
    assert median(ev[-8:]) > median(ev[:3]) + 0.3, ev


def test_one_forward_per_minibatch(tmp_path, monkeypatch):
    """Generation aside, a batch costs: 1 reference pass (beta > 0) + 1 pass for V_old +
    one pass per minibatch and epoch, which gives both log-probs and values. With
    trainer.shared_prompt each pass is two model calls: the distinct prompts, then the completions."""
    real = ppo.sample_and_score
    for beta, reference_passes, shared in ((0.05, 1, False), (0.0, 0, False), (0.05, 1, True)):
        cfg = compose("logging.progress=false", "algo=ppo", *SMALL, f"algo.beta={beta}", "trainer.steps=4",
                      f"trainer.shared_prompt={str(shared).lower()}")
        ctx = setup(cfg, REGISTRY["ppo"], tmp_path / f"{beta}-{shared}", Console(quiet=True))
        calls = record_forwards(monkeypatch)

        def sample_then_count(*args):
            out = real(*args)
            calls.clear()
            return out

        monkeypatch.setattr(ppo, "sample_and_score", sample_then_count)
        metrics = ppo.train_step(ctx)
        minibatches = 8 * 4 // 16
        assert len(calls) == (reference_passes + 1 + 2 * minibatches) * (2 if shared else 1)
        assert ctx.run.step == metrics["policy/updates"] == 2 * minibatches


def test_a_token_budget_gives_the_same_steps(tmp_path, monkeypatch):
    """The batch's passes (reference, V_old) and each shuffled minibatch's, cut by the token budget."""
    whole = run(tmp_path / "a", *SMALL, "trainer.steps=4", "trainer.micro_batch_memory=null")
    cuts = record_passes(monkeypatch)
    split = run(tmp_path / "b", *SMALL, "trainer.steps=4", "trainer.micro_batch_tokens=200")
    assert [sum(c) for c in cuts] == [32, 32, 16, 16, 16, 16] and all(len(c) > 1 for c in cuts), cuts
    for a, b in zip(whole, split):
        for key in ("loss", "value/loss", "policy/approx_kl", "policy/clip_frac", "optim/grad_norm", "kl/ref"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_trainer_steps_count_optimizer_steps(tmp_path):
    rows = run(tmp_path, *SMALL, "trainer.steps=6")
    assert [r["step"] for r in rows] == [4, 6]
    assert all(math.isfinite(r["kl/ref"]) and 0 <= r["policy/clip_frac"] <= 1 for r in rows)


def test_target_kl_stops_the_epochs_early(tmp_path):
    rows = run(tmp_path, *SMALL, "algo.epochs=4", "algo.target_kl=1e-9", "optim.lr=3e-2", "trainer.steps=4")
    assert rows[0]["policy/updates"] == 2  # the first epoch's KL already exceeds it


def test_entropy_bonus_and_plain_value_loss_run(tmp_path):
    rows = run(tmp_path, *SMALL, "algo.entropy_coef=0.01", "algo.value_clip_eps=null", "trainer.steps=4")
    assert math.isfinite(rows[0]["loss"]) and rows[0]["optim/grad_norm"] > 0


def test_minibatch_size_must_divide_the_batch():
    from rlnotes.commands.cli import UsageError

    with pytest.raises(UsageError, match="minibatch_size"):
        compose("algo=ppo", "algo.minibatch_size=3")


@pytest.mark.slow
def test_ppo_smollm2_two_steps(tmp_path):
    rows = run(tmp_path, "model=smollm2-135m", "data=arith", "algo.group_size=4", "algo.minibatch_size=32",
               "algo.epochs=2", "trainer.steps=2", "rollout.max_new_tokens=32")
    assert all(math.isfinite(r["loss"]) and r["optim/grad_norm"] > 0 for r in rows)
    assert (tmp_path / "final" / "value_head.safetensors").exists()
