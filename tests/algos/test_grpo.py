"""GRPO end to end on the tiny model: it learns, and micro-batching does not change the math."""

import json

import pytest
from rich.console import Console

from rlnotes.commands.train import train
from rlnotes.notes import AGGREGATIONS
from tests.conftest import compose, record_passes


def run(tmp_path, *overrides):
    cfg = compose("logging.progress=false", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_grpo_learns_to_write_the_letter(tmp_path):
    rows = run(tmp_path, "trainer.steps=50")
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1 and last > first + 0.4, (first, last)
    assert rows[-1]["kl/ref"] > rows[0]["kl/ref"]
    assert rows[-1]["policy/entropy"] < rows[0]["policy/entropy"] - 1.0


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batches_give_the_same_step(tmp_path, aggregation):
    """One pass over 16 completions and 16 passes of one give the same loss and gradient."""
    common = ("trainer.steps=2", "trainer.batch_size=4", f"algo.aggregation={aggregation}")
    whole = run(tmp_path / "whole", *common)
    split = run(tmp_path / "split", *common, "trainer.micro_batch_size=1")
    for a, b in zip(whole, split):
        assert a["reward/mean"] == b["reward/mean"]  # same samples
        for key in ("optim/grad_norm", "kl/ref", "policy/clip_frac"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
        # The loss sums per-token terms of size ~|A| ~ 1 that cancel to nearly 0 (A sums to 0 in a
        # group): float32 summation in another order moves it by ~1e-7 per hundred tokens.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=2e-6)


def test_a_token_budget_gives_the_same_step(tmp_path, monkeypatch):
    """Passes cut by trainer.micro_batch_tokens (16 completions in uneven passes) give one pass's step."""
    common = ("trainer.steps=2", "trainer.batch_size=4")
    whole = run(tmp_path / "whole", *common, "trainer.micro_batch_memory=null")
    cuts = record_passes(monkeypatch)
    split = run(tmp_path / "split", *common, "trainer.micro_batch_tokens=150")
    training, reference = cuts[0::2], cuts[1::2]  # each step: the training passes, then the reference's
    assert len(cuts) == 4 and all(sum(c) == 16 for c in cuts), cuts
    assert all(len(c) > 1 and len(set(c)) > 1 for c in training), cuts  # uneven passes
    assert all(len(r) < len(t) for t, r in zip(training, reference)), cuts  # without gradients: larger passes
    for a, b in zip(whole, split):
        assert a["reward/mean"] == b["reward/mean"]  # same samples
        for key in ("optim/grad_norm", "kl/ref", "policy/clip_frac"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=2e-6)


def test_several_updates_per_batch_clip_the_ratio(tmp_path):
    rows = run(tmp_path, "trainer.steps=8", "algo.epochs=4", "optim.lr=3e-2")
    assert [r["step"] for r in rows] == [4, 8]
    # The first pass of a batch reports pi == pi_old (nothing clipped); with mu > 1 the
    # later passes move pi, which shows in the weights: the second batch's samples differ.
    assert all(r["policy/clip_frac"] == 0.0 for r in rows)


def test_beta_zero_skips_the_reference_pass(tmp_path):
    rows = run(tmp_path, "trainer.steps=2", "algo.beta=0")
    assert rows[0]["kl/ref"] is None and "time/reference_s" not in rows[0]
    rows = run(tmp_path / "b", "trainer.steps=2")
    assert rows[0]["time/reference_s"] > 0


def test_same_seed_same_run(tmp_path):
    a = run(tmp_path / "a", "trainer.steps=3")
    b = run(tmp_path / "b", "trainer.steps=3")
    c = run(tmp_path / "c", "trainer.steps=3", "seed=1")
    key = lambda rows: [(r["reward/mean"], r["loss"], r["optim/grad_norm"]) for r in rows]  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(c)


def test_non_finite_loss_skips_updates_then_stops(tmp_path, monkeypatch):
    from rlnotes.core.errors import TrainingError
    from rlnotes.algos import grpo

    real = grpo.grpo_loss

    def nan_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        return out._replace(loss=out.loss * float("nan"))

    monkeypatch.setattr(grpo, "grpo_loss", nan_loss)
    with pytest.raises(TrainingError, match="non-finite"):
        run(tmp_path, "trainer.steps=5")
    assert not (tmp_path / "final").exists()


def test_final_policy_is_saved(tmp_path):
    run(tmp_path, "trainer.steps=1")
    assert (tmp_path / "final" / "adapter_config.json").exists()
    assert (tmp_path / "config.yaml").read_text().count("group_size: 4") == 1


def test_ctrl_c_keeps_the_policy_and_the_metrics(tmp_path, monkeypatch):
    import dataclasses

    from rlnotes.algos import grpo
    from rlnotes.algos.registry import REGISTRY

    real, calls = grpo.train_step, []

    def interrupted_at_third(ctx):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(ctx)

    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(REGISTRY["grpo"], train_step=interrupted_at_third))
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "trainer.steps=10")
    assert (tmp_path / "checkpoints" / "step_000002" / "adapter_config.json").exists()  # a resumable checkpoint
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def _adapter(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "adapter_model.safetensors")


def first_letter_is_a(prompts, completions, **_):
    """1 for a completion that starts with 'a', else 0: ties within most of the tiny model's groups."""
    return [float(c.lstrip().startswith("a")) for c in completions]


@pytest.mark.parametrize("last_step_all_equal", [False, True])
def test_completions_without_advantage_are_not_forwarded_and_the_step_is_the_same(tmp_path, monkeypatch,
                                                                                  last_step_all_equal):
    """beta = 0: a completion whose advantage is 0 (its group's rewards all equal) adds exactly nothing
    to the gradient, so the training pass leaves it out; every step's loss, gradient and weights are
    those of the pass over every completion. Also when no completion of a step has an advantage
    (the update is then Adam's with a zero gradient, as with the full pass)."""
    import torch

    from rlnotes.algos import grpo

    common = ("trainer.steps=4", "trainer.batch_size=8", "algo.beta=0", "reward=custom", "optim.lr=0.05",
              "reward.target=tests.algos.test_grpo.first_letter_is_a", "trainer.save_every=0")
    if last_step_all_equal:  # the last step's rewards all 0
        real = grpo.group_advantages
        calls = []

        def advantages(rewards, *a, **k):
            calls.append(1)
            return real(rewards * 0 if len(calls) == 4 else rewards, *a, **k)
        monkeypatch.setattr(grpo, "group_advantages", advantages)
    skipped = run(tmp_path / "skipped", *common)
    skipped_weights = _adapter(tmp_path / "skipped")
    if last_step_all_equal:
        calls.clear()
    monkeypatch.setattr(grpo, "rows_with_gradient", lambda advantages, beta, sharded: torch.arange(len(advantages)))
    every = run(tmp_path / "every", *common)
    assert [r["reward/mean"] for r in skipped] == [r["reward/mean"] for r in every]  # same samples
    assert any(0 < r["perf/trained_frac"] < 1 for r in skipped)  # a step with some groups tied, some not
    assert all(r["perf/trained_frac"] == 1 for r in every)
    if last_step_all_equal:
        assert skipped[-1]["perf/trained_frac"] == 0 and skipped[-1]["optim/grad_norm"] == 0
    for a, b in zip(skipped, every):
        assert a["optim/grad_norm"] == pytest.approx(b["optim/grad_norm"], rel=1e-4, abs=1e-7)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=2e-6)
    for name, w in _adapter(tmp_path / "every").items():
        # Within float32 rounding that Adam (lr 0.05) carries over four steps: the passes multiply
        # different numbers of rows; a completion wrongly left out moves a weight by ~lr.
        assert torch.allclose(skipped_weights[name], w, rtol=1e-4, atol=2e-5), name
