"""DPO end to end on the tiny model: the held-out margin grows, the first loss is log 2, and the
precomputed reference and micro-batching leave the step unchanged."""

import json
import math

import pytest
from rich.console import Console

from rlnotes.commands.train import train
from tests.conftest import compose, record_passes


def run(tmp_path, *overrides):
    cfg = compose("algo=dpo", "logging.progress=false", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_dpo_learns_held_out_preferences(tmp_path):
    # letters_pairs: "aaaa" preferred to another letter repeated; the tiny model separates it in
    # seconds (arith_pairs, the default task, needs a real model).
    rows = run(tmp_path, "data=letters_pairs", "trainer.steps=30", "trainer.eval_every=10", "data.eval_size=32")
    first, last = rows[0], rows[-1]
    assert first["eval/dpo_margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at init
    assert last["eval/dpo_accuracy"] > 0.8
    assert last["eval/dpo_margin"] > first["eval/dpo_margin"] + 0.5
    assert last["dpo/chosen_reward"] > last["dpo/rejected_reward"]
    assert last["loss"] < 0.5 * math.log(2)


def test_first_loss_is_log_2(tmp_path):
    """LoRA's B starts at zero, so pi == pi_ref and h = 0: -log sigma(0) = log 2."""
    row = run(tmp_path, "trainer.steps=1")[-1]  # the row of step 1 (row 0: the evaluation before it)
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert row["dpo/margin"] == pytest.approx(0.0, abs=1e-6)
    assert row["optim/grad_norm"] > 0


def test_accuracy_0_before_the_first_update_is_every_pair_tied(tmp_path):
    """Pair accuracy counts strict wins r(y_w) > r(y_l), as TRL does; before the first update the
    policy is the reference, every implicit reward is exactly 0 and so every pair ties: accuracy 0,
    ties 1 (dpo/ties, eval/dpo_ties), which says what that 0 means. Once the policy moves, no pair ties."""
    rows = run(tmp_path, "data=letters_pairs", "trainer.steps=3", "trainer.eval_every=1", "eval.size=16")
    assert (rows[0]["eval/dpo_accuracy"], rows[0]["eval/dpo_ties"]) == (0.0, 1.0)  # step 0: the evaluation before it
    assert (rows[1]["dpo/accuracy"], rows[1]["dpo/ties"]) == (0.0, 1.0)  # step 1's batch, measured before its update
    for row in rows[2:]:
        assert row["dpo/ties"] == 0.0 and row["eval/dpo_ties"] == 0.0
        assert row["eval/dpo_accuracy"] == pytest.approx(round(row["eval/dpo_accuracy"] * 16) / 16)  # a share of 16


def test_precomputed_reference_gives_the_same_step(tmp_path):
    per_batch = run(tmp_path / "a", "trainer.steps=2", "trainer.batch_size=4", "data.train_size=16")
    table = run(tmp_path / "b", "trainer.steps=2", "trainer.batch_size=4", "data.train_size=16",
                "algo.precompute_ref=true")
    for a, b in zip(per_batch[1:], table[1:]):  # the steps' rows, after the evaluation of step 0
        for key in ("loss", "optim/grad_norm", "dpo/margin", "dpo/chosen_reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_micro_batches_give_the_same_step(tmp_path):
    whole = run(tmp_path / "a", "trainer.steps=2", "trainer.batch_size=6")
    split = run(tmp_path / "b", "trainer.steps=2", "trainer.batch_size=6", "trainer.micro_batch_size=3")
    for a, b in zip(whole[1:], split[1:]):
        for key in ("loss", "optim/grad_norm", "dpo/margin", "dpo/accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_a_token_budget_gives_the_same_step(tmp_path, monkeypatch):
    whole = run(tmp_path / "a", "trainer.steps=2", "trainer.batch_size=6", "trainer.micro_batch_memory=null")
    cuts = record_passes(monkeypatch)
    split = run(tmp_path / "b", "trainer.steps=2", "trainer.batch_size=6", "trainer.micro_batch_tokens=120")
    assert len(cuts) == 2 and all(sum(c) == 6 and len(c) > 1 for c in cuts), cuts
    for a, b in zip(whole[1:], split[1:]):
        for key in ("loss", "optim/grad_norm", "dpo/margin", "dpo/accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_ipo_with_label_smoothing_is_refused():
    from rlnotes.commands.cli import UsageError

    with pytest.raises(UsageError, match="label_smoothing"):
        compose("algo=dpo", "algo.loss_type=ipo", "algo.label_smoothing=0.1")


@pytest.mark.slow
def test_dpo_smollm2_two_steps(tmp_path):
    rows = run(tmp_path, "model=smollm2-135m", "trainer.steps=2", "trainer.batch_size=4", "eval.size=4")
    assert rows[1]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # step 1 (row 0: the evaluation before it)
    assert all(math.isfinite(r["loss"]) and r["optim/grad_norm"] > 0 for r in rows[1:])
    assert (tmp_path / "final" / "adapter_config.json").exists()
