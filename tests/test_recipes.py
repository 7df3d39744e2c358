"""The real-model recipes of docs/results.md still learn (slow: `make test-slow` / `pytest -m slow`)."""

import json

import pytest
from rich.console import Console

from rlnotes.commands.train import train
from tests.conftest import compose


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 5.4 minutes on a quiet machine (dev accuracy 17.5% -> 76%)
def test_the_smollm2_arith_recipe_still_learns_in_a_short_run(tmp_path):
    """experiment=smollm2_arith cut short (25 warm-up steps, 5 of GRPO; ~5 minutes on 2 cores), scored
    greedily on the 200 two-digit dev problems: from the base model's 17.5% to at least 60%."""
    train(compose("experiment=smollm2_arith", "sft_warmup.steps=25", "trainer.steps=30", "trainer.eval_every=30",
                  "data.eval_split=dev", "logging.progress=false"), tmp_path, Console(quiet=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert accuracy[0] < 0.3 and accuracy[-1] >= 0.6, accuracy
    assert all("reward/mean" in r for r in rows if 25 < r["step"] <= 30)  # the GRPO steps ran
