"""Reward model end to end on the tiny model: it ranks held-out pairs, micro-batching leaves the
step unchanged, and the saved model scores completions as a reward (reward=model)."""

import json
import math

import pytest
from rich.console import Console

from rlnotes.commands.train import train
from rlnotes.data.datasets import load_task
from tests.conftest import compose


def run(tmp_path, *overrides, algo="algo=rm"):
    cfg = compose(algo, "logging.progress=false", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return cfg, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    # letters_pairs ("aaaa" over another letter repeated): separable by the tiny model in a
    # second; arith_pairs (the default) is not, at this size.
    path = tmp_path_factory.mktemp("rm")
    cfg, rows = run(path, "data=letters_pairs", "trainer.steps=30", "trainer.eval_every=10", "data.eval_size=32")
    return path, cfg, rows


def test_rm_ranks_held_out_pairs(trained):
    _, _, rows = trained
    first, last = rows[0], rows[-1]
    assert rows[1]["loss"] > 0.3  # step 1 (row 0: the evaluation before it)
    assert last["eval/rm_accuracy"] > 0.9
    assert last["eval/rm_margin"] > first["eval/rm_margin"] + 3.0
    assert last["loss"] < 0.05


def test_saved_reward_model_scores_like_the_trained_one(trained):
    """reward=model reloads base + adapter + head from final/ and ranks the held-out pairs as the
    last eval did."""
    from rlnotes.rewards.builtin import reward_model

    path, cfg, rows = trained
    assert (path / "final" / "reward_head.safetensors").exists()
    _, eval_rows = load_task(cfg.data)
    eval_rows = eval_rows[:cfg.eval.size]
    prompts = [r["prompt"] for r in eval_rows]
    chosen = reward_model(prompts, [r["chosen"] for r in eval_rows], path=str(path / "final"))
    rejected = reward_model(prompts, [r["rejected"] for r in eval_rows], path=str(path / "final"))
    margins = [c - r for c, r in zip(chosen, rejected)]
    assert sum(m > 0 for m in margins) / len(margins) == pytest.approx(rows[-1]["eval/rm_accuracy"])
    assert sum(margins) / len(margins) == pytest.approx(rows[-1]["eval/rm_margin"], rel=1e-4)


def test_grpo_runs_on_the_reward_model(trained, tmp_path):
    path, _, _ = trained
    _, rows = run(tmp_path, f"reward.path={path / 'final'}", "reward=model", "trainer.steps=2", algo="algo=grpo")
    assert all(math.isfinite(r["reward/mean"]) and r["reward/failures"] == 0 for r in rows)


def test_reward_model_needs_a_path():
    from rlnotes.commands.cli import UsageError

    with pytest.raises(UsageError, match="reward.path"):
        compose("reward=model")


def test_micro_batches_give_the_same_step(tmp_path):
    _, whole = run(tmp_path / "a", "trainer.steps=2", "trainer.batch_size=6")
    _, split = run(tmp_path / "b", "trainer.steps=2", "trainer.batch_size=6", "trainer.micro_batch_size=3")
    for a, b in zip(whole[1:], split[1:]):
        for key in ("loss", "optim/grad_norm", "rm/accuracy", "rm/margin"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_rm_smollm2_two_steps(tmp_path):
    _, rows = run(tmp_path, "model=smollm2-135m", "trainer.steps=2", "trainer.batch_size=4", "eval.size=4")
    assert all(math.isfinite(r["loss"]) and r["optim/grad_norm"] > 0 for r in rows[1:])
    assert (tmp_path / "final" / "reward_head.safetensors").exists()


def test_the_head_has_only_parameters_the_loss_determines(trained):
    """r = w . h_last: no bias, which the Bradley-Terry loss (a function of r_w - r_l) cannot determine
    and whose rounding-noise gradient Adam would turn into lr-sized drifts of every reward."""
    from safetensors.torch import load_file

    path, _, _ = trained
    assert sorted(load_file(str(path / "final" / "reward_head.safetensors"))) == ["weight"]


def test_a_head_saved_with_a_bias_still_loads(trained, tmp_path):
    """Heads of earlier versions carry a bias: loaded into their own shape, it shifts every reward."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from rlnotes.rewards.model import HEAD, load

    path, _, _ = trained
    old = tmp_path / "final"
    shutil.copytree(path / "final", old)
    shutil.copy(path / "config.yaml", tmp_path / "config.yaml")
    state = load_file(str(old / f"{HEAD}.safetensors"))
    save_file({**state, "bias": torch.tensor([0.5])}, str(old / f"{HEAD}.safetensors"))
    _, head, _, _ = load(old, torch.device("cpu"))
    x = torch.randn(3, head.in_features)
    torch.testing.assert_close(head(x).squeeze(-1), x @ state["weight"][0] + 0.5)
