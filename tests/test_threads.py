"""hardware.threads: auto picks one thread for a small model and torch's default for a larger one;
an explicit number wins; null leaves torch's default; a bad value is one error line. OpenMP's threads
spin briefly before they sleep unless the user chose how they wait."""

from __future__ import annotations

import os

import pytest
import torch
from rich.console import Console

from rlnotes.commands import cli
from rlnotes.engine.hardware.openmp import SPIN_COUNT, wait_briefly
from rlnotes.engine.hardware.threads import AUTO_ONE_THREAD_BELOW, auto_threads, set_threads
from tests.conftest import compose, set_step


def test_auto_is_one_thread_below_the_measured_size_and_torchs_default_from_it():
    assert auto_threads(90_000) == 1                           # the tiny model
    assert auto_threads(350_000) == 1                          # measured still faster on one thread
    assert auto_threads(1_360_000) == 0                        # measured faster on two (threads spinning briefly)
    assert auto_threads(AUTO_ONE_THREAD_BELOW - 1) == 1
    assert auto_threads(AUTO_ONE_THREAD_BELOW) == 0            # 0: torch's default
    assert auto_threads(135_000_000) == 0                      # SmolLM2-135M


def test_set_threads_explains_auto_and_leaves_numbers_and_null_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)   # its note is the next test's
    small, large = torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
    large.weight = torch.nn.Parameter(torch.empty(AUTO_ONE_THREAD_BELOW))
    torch.set_num_threads(2)
    assert set_threads(None, small) == "" and torch.get_num_threads() == 2
    assert set_threads("auto", large).startswith("2 threads: hardware.threads=auto") and torch.get_num_threads() == 2
    text = set_threads("auto", small)
    assert torch.get_num_threads() == 1
    assert text == f"1 thread: hardware.threads=auto, 0.00M parameters, fewer than {AUTO_ONE_THREAD_BELOW / 1e6:g}M"
    assert set_threads(2, small) == "" and torch.get_num_threads() == 2


def test_auto_says_when_torchs_default_comes_from_omp_num_threads(monkeypatch):
    """A 135M model's start line said '1 thread: hardware.threads=auto, 134.52M parameters, at least
    20M' without saying that OMP_NUM_THREADS=1 made torch's default one thread."""
    large = torch.nn.Linear(10, 10)
    large.weight = torch.nn.Parameter(torch.empty(AUTO_ONE_THREAD_BELOW))
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_threads("auto", large) == (f"1 thread (from OMP_NUM_THREADS=1): hardware.threads=auto, "
                                          f"{AUTO_ONE_THREAD_BELOW / 1e6:.2f}M parameters, at least "
                                          f"{AUTO_ONE_THREAD_BELOW / 1e6:g}M")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")   # torch's count is not the variable's: nothing said of it
    assert set_threads("auto", large).startswith("1 thread: hardware.threads=auto")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert set_threads("auto", large).startswith("1 thread: hardware.threads=auto")
    small = torch.nn.Linear(10, 10)   # auto's own one thread: the variable is not why
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_threads("auto", small).startswith("1 thread: hardware.threads=auto, 0.00M parameters, fewer than")


def threads_in_run(tmp_path, *overrides):
    """torch.get_num_threads() inside the train step of a one-step tiny GRPO run, and the start line."""
    from rlnotes.commands.train import train
    from rlnotes.algos.registry import REGISTRY

    real, seen = REGISTRY["grpo"].train_step, []

    def step(ctx, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(ctx, *args, **kwargs)

    torch.set_num_threads(2)
    console = Console(record=True, width=300)
    set_step("grpo", step)
    try:
        train(compose("trainer.steps=1", "logging.progress=false", *overrides), tmp_path, console)
    finally:
        set_step("grpo", real)
    return seen, console.export_text()


def test_a_tiny_run_with_auto_uses_one_thread_and_says_why(tmp_path):
    seen, text = threads_in_run(tmp_path)
    assert seen == [1]
    assert "LoRA; 1 thread: hardware.threads=auto, 0.11M parameters, fewer than" in text


def test_an_explicit_thread_count_wins_over_auto(tmp_path):
    seen, text = threads_in_run(tmp_path, "hardware.threads=2")
    assert seen == [2] and "hardware.threads=auto" not in text


@pytest.mark.parametrize("value, expected", [
    ("two", "hardware.threads='two' is not valid; give auto, null or an integer of at least 1 (torch threads"),
    ("1.5", "hardware.threads=1.5 is not valid; give auto, null or an integer of at least 1"),
    ("true", "hardware.threads=True is not valid"),
    ("0", "hardware.threads=0 must be at least 1 (torch threads per process; null = torch's default, auto ="),
])
def test_a_bad_thread_count_is_one_line(value, expected):
    from tests.test_config import one_line

    assert expected in one_line([f"hardware.threads={value}"])


@pytest.mark.parametrize("value", ["auto", "null", "1", "3"])
def test_auto_null_and_positive_integers_are_valid(value):
    compose(f"hardware.threads={value}")


def test_openmp_threads_spin_briefly_unless_the_user_chose_how_they_wait(monkeypatch):
    env = {}
    wait_briefly(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SPIN_COUNT}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(mine)
        wait_briefly(env)
        assert env == mine  # either variable set: both left as the user has them

    # the command sets them before anything imports torch (into a copy of the environment: the
    # command's other settings must not reach the tests after this one)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    monkeypatch.setattr(os, "environ", env)
    cli._environment()
    assert (env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"]) == ("PASSIVE", SPIN_COUNT)
