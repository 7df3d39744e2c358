"""Several processes (torchrun, gloo on CPU): the same run as one process, one run dir, no hangs.

The in-process tests cover the pieces with one process; three subprocess tests start real
process groups of 2: every runner against its one-process twin (tests/ddp_worker.py), the console
script's own launcher, and a Hydra multirun under torchrun.
"""

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from rlnotes.commands.cli import main
from rlnotes.commands.launch import torchrun_command
from rlnotes.commands.rundirs import stamp_dirs
from rlnotes.engine.hardware import distributed
from rlnotes.engine.sampling.generate import (
    completion_seeds,
    generate,
    seeded_uniform,
    mix32,
    sample_seeded,
)
from rlnotes.engine.sampling.settings import SamplingSettings
from tests.conftest import RLNOTES

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("trainer.steps=2", "trainer.batch_size=4")
SYSTEM = ("You are a patient tutor. Read the request, think about which letter it asks for, and reply with words "
          "that start with that letter only. Keep every reply short and plain, with no lists and no extra remarks.")
HELD_OUT = ("trainer.eval_every=1", "data.eval_size=8", "eval.size=8")
# Runs tests/ddp_worker.py makes on 2 processes; those in EXACT must match one process to float
# tolerance (with per-prompt seeds, the default under torchrun, the samples are the same).
CASES = {
    "grpo": (*SMALL, "trainer.eval_every=2", "eval.size=4"),
    "dapo": ("algo=dapo", *SMALL, "optim.lr=0.05", "trainer.micro_batch_size=2"),  # token-mean over 4 passes
    "reinforce": ("algo=reinforce", *SMALL),
    "dpo": ("algo=dpo", *SMALL, *HELD_OUT, "trainer.micro_batch_size=1"),
    "sft": ("algo=sft", *SMALL, *HELD_OUT, "trainer.micro_batch_size=1"),
    "rm": ("algo=rm", "data=letters_pairs", *SMALL, *HELD_OUT),
    "ppo": ("algo=ppo", "trainer.steps=4", "trainer.batch_size=4"),
    # multi-turn episodes: each rank runs its own episodes and environments
    "episodes": ("rollout=multi_turn", "rollout.env=letters", "rollout.max_turns=2", "rollout.max_new_tokens=6",
                 "rollout.max_episode_tokens=64", "reward=env", *SMALL),
    # two environments that rows choose among (MIXED_ROWS): env/NAME/... over both ranks' episodes
    "environments": ("rollout=multi_turn", "rollout.env={letters: letters, again: tests.test_routing:Again}",
                     "data=file", "data.path={OUT}/mixed.jsonl", "rollout.max_turns=2", "rollout.max_new_tokens=6",
                     "reward=env", *SMALL),
    "system": (*SMALL, f"data.system_prompt='{SYSTEM}'"),  # its prefix forwarded once on each rank
    "fsdp_system": ("hardware.strategy=fsdp", *SMALL, f"data.system_prompt='{SYSTEM}'"),
    "grpo_4": ("trainer.steps=4", "trainer.batch_size=4", "trainer.save_every=2", "trainer.keep_last=null"),
    "grpo_resumed": ("trainer.steps=4", "trainer.batch_size=4", "trainer.resume={OUT}/grpo_4/checkpoints/step_000002"),
    "fsdp_grpo": ("hardware.strategy=fsdp", *SMALL, "trainer.eval_every=2", "eval.size=4"),
    "fsdp_dpo": ("hardware.strategy=fsdp", "algo=dpo", *SMALL, *HELD_OUT, "algo.precompute_ref=true"),
    "fsdp_full_sft": ("hardware.strategy=fsdp", "model.lora=null", "algo=sft", *SMALL, *HELD_OUT),
    "fsdp_ppo": ("hardware.strategy=fsdp", "algo=ppo", "trainer.steps=4", "trainer.batch_size=4"),
    "fsdp_4": ("hardware.strategy=fsdp", "trainer.steps=4", "trainer.batch_size=4", "trainer.save_every=2",
               "trainer.keep_last=null"),
    "fsdp_resumed": ("hardware.strategy=fsdp", "trainer.steps=4", "trainer.batch_size=4",
                     "trainer.resume={OUT}/fsdp_4/checkpoints/step_000002"),
}
EXACT = ("grpo", "dapo", "reinforce", "dpo", "sft", "rm", "episodes", "environments", "system", "fsdp_grpo",
         "fsdp_dpo", "fsdp_full_sft", "fsdp_system")
# The rows of the "environments" case, written to OUT/mixed.jsonl before the processes start.
MIXED_ROWS = "".join(json.dumps({"prompt": f"Write the letter {c}:", "letter": c, "environment": name}) + "\n"
                     for name in ("letters", "again") for c in "abc") * 3


@pytest.fixture(autouse=True)
def _never_exec(monkeypatch):
    """A check that wrongly passes must fail the test, not turn pytest into torchrun."""
    def refuse(nproc, argv):
        raise AssertionError(f"would have started {nproc} processes for {argv}")
    monkeypatch.setattr("rlnotes.commands.train.launch", refuse)


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT), **extra)


def _why(stderr: str) -> str:
    """What a failed launch printed that says why: from its first fatal error or traceback (a rank's
    crash ends with a list of extension modules long enough to hide it), then its end."""
    starts = [i for i in (stderr.find("Fatal Python error"), stderr.find("Traceback")) if i >= 0]
    if not starts:
        return stderr[-3000:]
    # an abort from C++ (gloo, a std::terminate) says why in the lines just before Python's own report
    start = max(0, min(starts) - 800)
    return stderr[start:][:3800] + "\n[...]\n" + stderr[-1500:]


def _rows(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(a: dict, b: dict, context: str) -> None:
    """Every metric but timings equal to float tolerance."""
    keys = [k for k in a if not k.startswith(("time/", "perf/"))]
    assert keys and set(keys) <= set(b), (context, set(keys) - set(b))
    for key in keys:
        if a[key] is None:
            assert b[key] is None, (context, key)
        else:
            assert b[key] == pytest.approx(a[key], rel=2e-4, abs=2e-6), (context, key, a[key], b[key])


# ---------------------------------------------------------------------------------------------
# Seeded sampling (rollout.per_prompt_seed).


def test_mix32_is_lowbias32():
    assert mix32(torch.tensor([0, 1, 2, 2**32 - 1])).tolist() == [0, 1753845952, 3507691905, 1734902346]


def test_seeded_tokens_follow_the_probabilities():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(40_000, 4)
    tokens = sample_seeded(probs, completion_seeds(7, (0, 0), torch.arange(10_000), 4), t=3)
    freq = torch.bincount(tokens, minlength=4) / 40_000
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=0.01), freq
    u = seeded_uniform(torch.arange(100_000), 0)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005


def test_keys_are_distinct_per_draw_prompt_and_sample():
    seeds = [completion_seeds(0, draw, torch.arange(4), 4) for draw in ((0, 0), (1, 0), (0, 1))]
    assert len(set(torch.cat(seeds).tolist())) == 48
    assert completion_seeds(0, (5, 0), torch.tensor([2, 3]), 4).tolist() == completion_seeds(
        0, (5, 0), torch.arange(4), 4)[8:].tolist()  # prompt 2 of a batch is prompt 2 wherever it is sampled


def test_a_seeded_completion_does_not_depend_on_its_batch():
    """Four prompts sampled together or in two halves (two ranks) give the same completions."""
    from omegaconf import OmegaConf

    from rlnotes.core.schema import ModelConfig
    from rlnotes.engine.model.loading import load_base

    model, tok = load_base(OmegaConf.structured(ModelConfig()))
    prompts = [tok(p)["input_ids"] for p in ("Write a", "Write the letter b:", "c", "Write the letter d please:")]
    seeds = completion_seeds(3, (1, 0), torch.arange(4), 2)
    whole = generate(model, tok, prompts, 2, SamplingSettings(8), seeds=seeds)
    halves = [generate(model, tok, prompts[i:i + 2], 2, SamplingSettings(8), seeds=seeds[2 * i:2 * i + 4])
              for i in (0, 2)]
    assert whole.texts == halves[0].texts + halves[1].texts
    other = generate(model, tok, prompts, 2, SamplingSettings(8), seeds=completion_seeds(4, (1, 0), torch.arange(4), 2))
    assert other.texts != whole.texts


# ---------------------------------------------------------------------------------------------
# One process: the pieces are no-ops; the batch splits as the docs say.


def test_with_one_process_everything_is_a_no_op():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    distributed.sum_gradients([p])
    assert p.grad.tolist() == [1.0, 2.0, 3.0]
    rows = torch.arange(6.0)
    assert distributed.gather_rows(rows) is rows
    assert distributed.reduce_metrics({"time/x": 1.5}, {"time/x": "max"}) == {"time/x": 1.5}
    assert distributed.sum_over_ranks([2, 3.5]) == [2.0, 3.5] and not distributed.any_rank(False)


# A process of a group ends through end_process: its exit handlers and buffered output survive.
ENDING = """
import atexit, os, sys, tempfile
import torch.distributed as dist
from rlnotes.commands import cli
from rlnotes.engine.hardware import distributed
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
atexit.register(distributed._leave)
atexit.register(lambda: print("handler ran", "left" if not dist.is_initialized() else "still in", flush=True))
cli.main = lambda: (sys.stdout.write("buffered, no newline"), CODE)[1]
sys.stdout = open(sys.stdout.fileno(), "w", buffering=4096, closefd=False)
cli.run()
print("not reached")
"""


@pytest.mark.parametrize("code, status, err", [(None, 0, ""), (3, 3, ""), ("'stopped: why'", 1, "stopped: why")])
def test_a_process_of_a_group_ends_with_its_handlers_and_output(code, status, err):
    """cli.run in a process that joined a group: main's code as the exit status, every exit handler
    run (the group's first: LIFO), buffered output flushed, nothing after."""
    done = subprocess.run([sys.executable, "-c", ENDING.replace("CODE", str(code))], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout.startswith("buffered, no newline") and "not reached" not in done.stdout
    assert "handler ran still in" in done.stdout  # registered last, so it ran first; then the group was left
    assert err in done.stderr and "Fatal" not in done.stderr


@pytest.mark.parametrize("rank, bounds", [(0, (0, 2)), (1, (2, 5))])
def test_each_rank_takes_a_contiguous_part(monkeypatch, rank, bounds):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    assert distributed.shard_bounds(5) == bounds
    assert distributed.shard("abcde") == list("abcde"[slice(*bounds)])


def test_dynamic_sampling_keeps_the_groups_one_process_would(monkeypatch):
    from rlnotes.algos.grpo import kept_groups

    flags = torch.tensor([False, True, True, False, True, True])  # 6 groups, 3 per rank
    monkeypatch.setenv("WORLD_SIZE", "2")
    # One process would keep groups 1, 2 and 4 (the first three informative ones).
    assert kept_groups(flags, 0, 3).tolist() == [1, 2]
    assert kept_groups(flags, 3, 3).tolist() == [1]     # group 4 is rank 1's second group
    assert kept_groups(flags, 3, 2).tolist() == []      # rank 1 keeps nothing: rank 0 fills the batch


def test_micro_batch_weights_divide_by_the_global_batch():
    from rlnotes.training.batching import Totals, micro_batch_weight

    chunk = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])   # 2 rows, 3 tokens on this rank
    totals = Totals(tokens=12.0, rows=8, longest=3)            # the global batch over every rank
    assert micro_batch_weight("token-mean", chunk, totals) == pytest.approx(3 / 12)
    assert micro_batch_weight("seq-mean-token-mean", chunk, totals) == pytest.approx(2 / 8)


@pytest.mark.parametrize("overrides, message", [
    (("hardware=ddp", "hardware.nproc=3"), "trainer.batch_size=8 does not split evenly over 3 processes"),
    (("hardware=ddp", "rollout.per_prompt_seed=false"), "rollout.per_prompt_seed=false cannot work with 2 processes"),
    (("hardware=ddp", "algo=ppo", "algo.minibatch_size=4", "trainer.batch_size=9", "hardware.nproc=3"),
     "algo.minibatch_size=4 does not split evenly over 3 processes"),
    (("hardware.strategy=zero",), "hardware.strategy='zero' is not valid; choose one of: ddp, fsdp"),
    (("-m", "hardware=ddp", "hardware.nproc=2,4"), "hardware.nproc takes 2 values in this sweep"),
])
def test_a_layout_that_cannot_work_fails_in_one_line(overrides, message, capsys):
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: ") and message in err and "\n" not in err, err


def test_the_launcher_runs_this_command_under_torchrun():
    command = torchrun_command(4, ["hardware=ddp", "seed=1"])
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert command[3:] == ["--standalone", "--nproc_per_node=4", "-m", "rlnotes", "train", "hardware=ddp", "seed=1"]


def test_run_dirs_take_one_time():
    now = datetime(2026, 12, 2, 9, 5, 7)
    assert stamp_dirs("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}-${algo.name}", now) == \
        "outputs/2026-12-02/09-05-07-${algo.name}"


# ---------------------------------------------------------------------------------------------
# Two processes.


@pytest.mark.long
@pytest.mark.timeout(300)
def test_two_processes_train_as_one(tmp_path):
    """Every runner on 2 gloo processes vs 1 process with the same global batch and seed: the same
    losses, gradient norms and metrics; PPO runs; a resumed 2-process run continues exactly."""
    from rich.console import Console

    from rlnotes.commands.train import train
    from tests.conftest import compose

    out = tmp_path / "ddp"
    out.mkdir()
    (out / "mixed.jsonl").write_text(MIXED_ROWS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "ddp_worker.py"), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=280)
    assert done.returncode == 0, _why(done.stderr)
    assert "Unable to fetch remote file" not in done.stderr  # FSDP's saves never ask the hub about "tiny"
    for name in EXACT:
        one = tmp_path / "one" / name
        overrides = [o.replace("{OUT}", str(out)) for o in CASES[name]]
        train(compose("logging.progress=false", "rollout.per_prompt_seed=true", *overrides), one, Console(quiet=True))
        a, b = _rows(one / "metrics.jsonl"), _rows(out / name / "metrics.jsonl")
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for x, y in zip(a, b):
            _same(x, y, f"{name} step {x['step']}")
        assert (out / name / "final").is_dir()
    ppo = _rows(out / "ppo" / "metrics.jsonl")
    assert [r["step"] for r in ppo] == [2, 4] and all(r["policy/updates"] == 2 for r in ppo)
    for whole, resumed in (("grpo_4", "grpo_resumed"), ("fsdp_4", "fsdp_resumed")):
        a, b = _rows(out / whole / "metrics.jsonl"), _rows(out / resumed / "metrics.jsonl")
        assert [r["step"] for r in b] == [1, 2, 3, 4]
        for x, y in zip(a[2:], b[2:]):
            _same(x, y, f"{resumed} step {x['step']}")
    assert (out / "fsdp_full_sft" / "final" / "model.safetensors").is_file()  # FSDP's shards gathered for saving
    assert len(_rows(out / "grpo" / "eval.jsonl")) == 2  # before the first step and after the last, once each
    mixed = _rows(out / "environments" / "metrics.jsonl")   # each environment's metrics were compared above
    assert all(any(f"env/{name}/reward_mean" in r for r in mixed) for name in ("letters", "again"))


@pytest.mark.long
@pytest.mark.timeout(200)
def test_console_script_starts_torchrun_and_writes_one_run_dir(tmp_path):
    command = [RLNOTES, "train", "hardware=ddp", "hardware.nproc=2", "trainer.steps=2", "trainer.batch_size=4",
               "logging.progress=false"]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, _why(done.stderr)
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    assert [r["step"] for r in _rows(runs[0] / "metrics.jsonl")] == [1, 2]
    assert (runs[0] / "final" / "adapter_model.safetensors").is_file()
    assert done.stderr.count("done: 2 steps") == 1  # rank 0 speaks, the other rank is quiet


@pytest.mark.long
@pytest.mark.timeout(200)
def test_a_multirun_under_torchrun_does_not_hang(tmp_path):
    """One process group per process, kept across the sweep's jobs; one sweep dir, one summary."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rlnotes",
               "train", "-m", "seed=0,1", "trainer.steps=2", "trainer.batch_size=4", "logging.progress=false"]
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180)
    assert done.returncode == 0, _why(done.stderr)
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1, sweeps
    assert sorted(p.parent.name for p in sweeps[0].glob("*/metrics.jsonl")) == ["0", "1"]
    assert all(len(_rows(p)) == 2 for p in sweeps[0].glob("*/metrics.jsonl"))
    assert (sweeps[0] / "summary.md").is_file()
