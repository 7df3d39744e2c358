"""SFT end to end on the tiny model: it memorises a handful of arith answers, and micro-batching
does not change the step."""

import json
import math

import pytest
import torch
from rich.console import Console

from rlnotes.commands.train import train
from rlnotes.data.datasets import load_task
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.prompts import encode_prompts
from rlnotes.engine.sampling.generate import generate
from rlnotes.engine.sampling.settings import SamplingSettings
from tests.conftest import compose, record_passes


def run(tmp_path, *overrides):
    cfg = compose("algo=sft", "logging.progress=false", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return cfg, [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def greedy(cfg, adapter_dir, prompts):
    """Near-greedy completions (temperature 1e-4) of the trained adapter."""
    from peft import PeftModel

    from rlnotes.engine.model.loading import load_base

    base, tok = load_base(cfg.model)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = encode_prompts(tok, prompts, chat_template=False)
    return generate(model, tok, ids, 1, SamplingSettings(8, temperature=1e-4), torch.Generator().manual_seed(0)).texts


def test_sft_memorises_a_few_answers(tmp_path):
    # 8 training rows of arith_sft: the 95k-parameter char model memorises them, it cannot
    # learn addition in seconds.
    cfg, rows = run(tmp_path, "data.train_size=8", "trainer.steps=80", "optim.lr=1e-2")
    assert rows[1]["loss"] > 3.0  # step 1 (row 0: the evaluation before it)
    assert rows[-1]["loss"] < 0.2 * rows[1]["loss"]
    assert rows[-1]["sft/ppl"] == pytest.approx(math.exp(rows[-1]["loss"]))
    train_rows, _ = load_task(cfg.data)
    texts = greedy(cfg, tmp_path / "final", [r["prompt"] for r in train_rows])
    right = sum(t == r["completion"] for t, r in zip(texts, train_rows))
    assert right >= 7, list(zip(texts, [r["completion"] for r in train_rows]))


@pytest.mark.parametrize("split_by", ["trainer.micro_batch_size=3", "trainer.micro_batch_tokens=60"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_same_step(tmp_path, monkeypatch, aggregation, split_by):
    common = ("trainer.steps=2", "trainer.batch_size=6", f"algo.aggregation={aggregation}")
    _, whole = run(tmp_path / "a", *common, "trainer.micro_batch_memory=null")
    cuts = record_passes(monkeypatch)
    _, split = run(tmp_path / "b", *common, split_by)
    assert all(len(c) > 1 for c in cuts) and len(cuts) == (0 if "size" in split_by else 2), cuts
    for a, b in zip(whole[1:], split[1:]):
        for key in ("loss", "optim/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_loss_is_the_completion_nll_only(tmp_path):
    """Step 1's loss equals a hand-computed token mean of -log pi over completion tokens (EOS
    included, prompt excluded), from the untrained model."""
    cfg, rows = run(tmp_path, "trainer.steps=1", "trainer.batch_size=2", "data.train_size=2")
    row = rows[-1]  # step 1
    policy = Policy.from_config(cfg.model, torch.device("cpu"))
    from rlnotes.data.sampler import PromptSampler

    batch = PromptSampler(load_task(cfg.data)[0], 2, cfg.seed).next_batch()
    tok = policy.tokenizer
    total, count = 0.0, 0
    for r in batch:
        prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        target = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt + target])
        with torch.no_grad():
            logp = policy.model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        for t, tok_id in enumerate(target):
            total -= float(logp[len(prompt) - 1 + t, tok_id])
            count += 1
    assert row["loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.slow
def test_sft_smollm2_two_steps(tmp_path):
    _, rows = run(tmp_path, "model=smollm2-135m", "trainer.steps=2", "trainer.batch_size=4", "eval.size=4")
    assert all(math.isfinite(r["loss"]) and r["optim/grad_norm"] > 0 for r in rows[1:])
    assert rows[-1]["loss"] < rows[0]["eval/sft_loss"] + 1.0
