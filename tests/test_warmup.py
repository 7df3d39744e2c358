"""The SFT warm-up (sft_warmup): supervised steps on demonstrations as the first steps of a run."""

import re
import signal

import pytest

from rlnotes.commands.cli import UsageError
from rlnotes.run import checkpoint
from rlnotes.training import loop
from rlnotes.training.optimizer import schedule
from tests.conftest import compose
from tests.test_checkpoint import run, stop_at

ARITH = ("data=arith", "reward=arith", "sft_warmup.steps=3", "sft_warmup.column=answer", "sft_warmup.batch_size=8",
         "trainer.steps=6")


def test_warmup_steps_come_first_at_their_own_rate_then_the_algorithm_with_a_fresh_optimizer(tmp_path, monkeypatch):
    real, moments = loop.warmup_step, []

    def spy(ctx):
        metrics = real(ctx)
        moments.append(len(ctx.model.optimizer.state))
        return metrics

    monkeypatch.setattr(loop, "warmup_step", spy)
    rows = run(tmp_path, *ARITH, "optim.lr=1e-4", "sft_warmup.lr=3e-3")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all("sft_warmup/loss" in r and "reward/mean" not in r for r in rows[:3])
    assert all("reward/mean" in r and "sft_warmup/loss" not in r for r in rows[3:])
    assert [r["optim/lr"] for r in rows] == [3e-3] * 3 + [1e-4] * 3
    assert moments[:2] != [0, 0] and moments[2] == 0  # Adam's moments of the warm-up are gone after its last step


def test_optim_schedule_shapes_the_warmup_rate_over_its_own_steps(tmp_path):
    rows = run(tmp_path, *ARITH, "optim.schedule=linear", "sft_warmup.lr=3e-3", "optim.lr=1e-4")
    assert [r["optim/lr"] for r in rows] == pytest.approx([3e-3, 2e-3, 1e-3, 1e-4, 1e-4 * 2 / 3, 1e-4 / 3])


def test_the_schedule_runs_over_the_steps_after_the_warmup():
    cfg = compose("sft_warmup.steps=3", "trainer.steps=13", "optim.schedule=linear")
    factor = schedule(cfg)
    assert [factor(s) for s in (0, 2, 3, 8, 12)] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.1])
    warm = schedule(compose("sft_warmup.steps=2", "trainer.steps=6", "optim.warmup_steps=2"))
    assert [warm(s) for s in range(6)] == pytest.approx([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("where, call", [("warm-up", 2), ("first step of the algorithm", 1)])
def test_a_run_stopped_in_or_right_after_its_warmup_resumes_exactly(tmp_path, monkeypatch, where, call):
    """Ctrl-C in the 2nd warm-up step (after it drew its rows) or in the algorithm's first step: the
    resumed run repeats the uninterrupted one exactly (the warm-up's data position, the fresh optimizer
    and the schedule's offset all follow from the step)."""
    overrides = (*ARITH, "trainer.eval_every=3", "eval.size=4")
    whole = run(tmp_path / "whole", *overrides)
    with monkeypatch.context() as patch:
        if where == "warm-up":
            real, calls = loop.warmup_step, []

            def step(ctx):
                calls.append(1)
                if len(calls) == call:
                    ctx.data.warmup_sampler.next_batch()
                    signal.raise_signal(signal.SIGINT)
                return real(ctx)

            patch.setattr(loop, "warmup_step", step)
        else:
            stop_at(patch, "grpo", call, signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "split", *overrides)
    saved = [p.name for p in checkpoint.checkpoints(tmp_path / "split")]
    assert saved == (["step_000001"] if where == "warm-up" else ["step_000003"])
    assert run(tmp_path / "split", *overrides, "trainer.resume=auto") == whole


def test_a_warmup_on_the_letter_gives_the_algorithm_a_head_start(tmp_path):
    """letters: ten supervised steps on the row's letter, then GRPO on the share of that letter. The
    first GRPO step already earns most of the reward, which GRPO alone does not within its steps."""
    cold = run(tmp_path / "cold", "trainer.steps=3")
    warm = run(tmp_path / "warm", "sft_warmup.steps=10", "sft_warmup.column=letter", "sft_warmup.lr=1e-2",
               "trainer.steps=13")
    assert warm[0]["sft_warmup/loss"] > 2.0 > 0.5 > warm[9]["sft_warmup/loss"]
    assert max(r["reward/mean"] for r in cold) < 0.1
    assert min(r["reward/mean"] for r in warm[10:]) > 0.5


@pytest.mark.parametrize("overrides, message", [
    (("sft_warmup.steps=8", "trainer.steps=8"), "sft_warmup.steps=8 leaves none of trainer.steps=8 to algo=grpo"),
    (("sft_warmup.steps=-1",), "sft_warmup.steps=-1 must be at least 0"),
    (("sft_warmup.lr=0",), "sft_warmup.lr=0 must be in (0, 1]"),
])
def test_bad_warmup_settings_fail_in_one_line(overrides, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        compose(*overrides)


def test_a_missing_demonstration_column_names_the_columns_there_are(tmp_path):
    with pytest.raises(Exception, match="sft_warmup.steps=3 trains on each row's demonstration, but task arith "
                                        r"\(train\) row 1, column 'completion' has no text nor conversation; "
                                        "set sft_warmup.column "
                                        "to one of: answer"):
        run(tmp_path, *ARITH, "sft_warmup.column=completion")
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_run_says_what_the_warmup_does(tmp_path, capsys):
    from rlnotes.commands.cli import main

    assert main(["train", *ARITH, f"hydra.run.dir={tmp_path}", "logging.progress=false"]) == 0
    out = " ".join(capsys.readouterr().err.split())
    assert "run: 3 optimizer steps = 3 batches = 24 prompts" in out
    assert ("sft_warmup: first 3 supervised steps on the demonstrations in column 'answer' (8 rows a step, lr "
            "0.001), then the 3 of algo=grpo above: trainer.steps=6 in all") in out
