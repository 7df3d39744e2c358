"""Seeded tiny runs of every algorithm give the metrics they gave when the reference was written.

A change of structure (files moved, code split, one path for what were two) must not change what a
run computes. Each case trains the tiny model for a few steps and compares every logged metric but
the wall-time ones (time/*, perf/*) with tests/reference/<case>.jsonl, written by an earlier commit:

    python tests/test_reference_runs.py --write     # only when a change of the math is intended

The keys of every row must be the same, and every value must agree within what float32 rounding on
another CPU moves it (REL, ABS below), not more.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REFERENCE = Path(__file__).parent / "reference"
COMMON = ["trainer.steps=3", "trainer.batch_size=4", "trainer.save_every=0", "logging.progress=false",
          "logging.samples_every=0", "seed=0"]
SAMPLING = ["algo.group_size=2", "trainer.eval_every=3", "eval.size=8"]
# case -> overrides: every algorithm and the options that take another path through its runner.
CASES = {
    "grpo": ["algo=grpo", *SAMPLING],
    "grpo_mu2_micro": ["algo=grpo", *SAMPLING, "algo.epochs=2", "trainer.steps=4", "trainer.micro_batch_size=2"],
    "dr_grpo": ["algo=dr_grpo", *SAMPLING],
    "dapo": ["algo=dapo", *SAMPLING, "algo.group_size=4"],
    "rloo": ["algo=rloo", *SAMPLING],
    "reinforce": ["algo=reinforce", *SAMPLING, "algo.beta=0.05"],
    "reinforce_value": ["algo=reinforce", *SAMPLING, "algo.baseline=value", "trainer.micro_batch_size=4"],
    "ppo": ["algo=ppo", *SAMPLING, "algo.minibatch_size=4", "algo.entropy_coef=0.01", "trainer.steps=8"],
    "dpo": ["algo=dpo", "trainer.eval_every=2"],
    "dpo_ipo_precomputed": ["algo=dpo", "algo.loss_type=ipo", "algo.precompute_ref=true", "trainer.micro_batch_size=2"],
    "sft": ["algo=sft", "trainer.eval_every=2", "trainer.micro_batch_size=2"],
    "rm": ["algo=rm", "trainer.eval_every=2"],
}
UNTIMED = ("time/", "perf/")
# How far a metric may move: |reference - now| <= REL |reference| + ABS. The references were written
# on one CPU; another runs other float32 kernels (vector widths, MKL's code path, summation order),
# and a few optimizer steps carry that rounding on. Measured by running every case with the kernels
# of other CPUs forced on one machine (ATEN_CPU_CAPABILITY=avx2 or default, MKL_ENABLE_INSTRUCTIONS=
# AVX2 or SSE4_2, against AVX-512): relative differences up to 2.5e-5; absolute up to 1.1e-7 where a
# value is near 0 by cancellation (a loss of terms of size ~1 summing to ~1e-4; KL to the reference
# at the first step, 0 in exact arithmetic and ~1e-8 in float32). Every case stayed within a tenth
# of this tolerance. A change of behaviour moves metrics far more; each of these planted changes
# failed every case it reaches: the k3 estimator scaled by 1.001 (grpo, grpo_mu2_micro, ppo: the
# cases with a k3 KL term), DPO's beta 0.1 -> 0.1001 (both DPO cases), clip_eps 0.2 -> 0.21 (the
# cases whose ratio leaves 1: grpo_mu2_micro, ppo), the learning rate 1% higher (policy metrics, not
# only optim/lr), Adam's eps 1e-8 -> 1e-7 (9 of the 12 cases).
REL, ABS = 1e-4, 1e-6


def run_case(name: str, tmp_path: Path) -> list[dict]:
    """The metrics rows of case `name` (wall-time metrics left out), trained in this process."""
    import torch

    from rlnotes.commands.cli import main

    torch.set_num_threads(1)
    run = tmp_path / name
    code = main(["train", *COMMON, *CASES[name], f"hydra.run.dir={run}"])
    assert code == 0, f"{name}: rlnotes train exited with {code}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= REL * abs(a) + ABS
    return a == b


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_seeded_tiny_run_logs_the_reference_metrics(name, tmp_path):
    expected = [json.loads(line) for line in (REFERENCE / f"{name}.jsonl").read_text().splitlines()]
    got = run_case(name, tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in expected], f"{name}: logged steps differ"
    for want, have in zip(expected, got):
        assert sorted(have) == sorted(want), f"{name} step {want['step']}: keys differ: " \
            f"{sorted(set(have) ^ set(want))}"
        differ = {k: (want[k], have[k]) for k in want if not _same(want[k], have[k])}
        assert not differ, f"{name} step {want['step']}: (reference, now) {differ}"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    REFERENCE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for case in sorted(CASES):
            rows = run_case(case, Path(tmp))
            (REFERENCE / f"{case}.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
            print(f"wrote {REFERENCE / case}.jsonl ({len(rows)} rows)")
