"""The reference pass on a spare core, in a forked process (rlnotes.engine.hardware.beside): when a
core is spare; that the process gives the main process's numbers, its errors in one piece and ends
with the run; that it keeps no run dir locked; and that GRPO and DPO runs with it are the runs
without it, number for number."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from rich.console import Console

from rlnotes.commands.train import train
from rlnotes.engine.hardware.beside import ReferenceProcess, spare_core
from tests.conftest import compose

CPU = torch.device("cpu")
linux = pytest.mark.skipif(sys.platform != "linux", reason="the reference's process is forked, on Linux only")


@pytest.fixture
def cores(monkeypatch):
    """Set the CPUs this process may run on (its affinity) and torch's thread count."""
    def set_cores(count: int, threads: int = 1) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        monkeypatch.setattr(sys, "platform", "linux")
    return set_cores


def test_a_core_is_spare_where_auto_gave_one_thread_and_the_process_has_two(cores, monkeypatch):
    from rlnotes.engine.hardware.threads import AUTO_ONE_THREAD_BELOW

    small, large = torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
    large.weight = torch.nn.Parameter(torch.empty(AUTO_ONE_THREAD_BELOW))
    cores(2)
    assert spare_core("auto", small, 1, CPU)
    assert not spare_core(1, small, 1, CPU)  # one thread asked for: one core
    assert not spare_core(None, small, 1, CPU) and not spare_core(2, small, 1, CPU)
    assert not spare_core("auto", large, 1, CPU)  # one thread from OMP_NUM_THREADS=1: the user's one core
    assert not spare_core("auto", small, 2, CPU)  # two processes share the two cores
    assert not spare_core("auto", small, 1, torch.device("cuda"))  # the passes run on the GPU
    cores(1)
    assert not spare_core("auto", small, 1, CPU)
    cores(8, threads=2)  # torch's threads compute every pass already
    assert not spare_core("auto", small, 1, CPU)
    cores(8)
    assert spare_core("auto", small, 4, CPU) and not spare_core("auto", small, 5, CPU)
    monkeypatch.setattr(sys, "platform", "darwin")  # no fork
    assert not spare_core("auto", small, 1, CPU)


def tiny_policy_and_rows():
    from omegaconf import OmegaConf

    from rlnotes.core.schema import ModelConfig
    from rlnotes.engine.policy.policy import Policy

    policy = Policy.from_config(OmegaConf.structured(ModelConfig(name_or_path="tiny")), CPU)
    with torch.no_grad():  # an adapter that counts (B = 0 is the base itself)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(3, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, :3], mask[2, -2:] = 0, 0
    return policy, ids, mask


@linux
def test_the_process_gives_the_reference_log_probs_of_this_one_and_ends_when_closed():
    policy, ids, mask = tiny_policy_and_rows()
    process = ReferenceProcess(policy)
    try:
        answer = process.submit([(ids[:2], mask[:2]), (ids[2:], mask[2:])], 5, 0.7)
        policy.train()  # the policy trains on meanwhile; the reference is the base, evaluated
        here = policy.ref_logprobs(ids, mask, 5, 0.7)
        logprobs, seconds, waited = answer()
        assert torch.equal(logprobs, here) and seconds > 0 and waited >= 0
        assert answer() is answer()  # asked again: the same answer, nothing more read
        assert (here - policy.logprobs(ids, mask, 5, 0.7).detach()).abs().max() > 1e-3  # not the policy's
        process.submit([(ids, mask)], 5, 1.0)  # an answer nobody asks for (its caller raised first)
        assert torch.equal(process.submit([(ids, mask)], 3, 1.0)()[0], policy.ref_logprobs(ids, mask, 3))
    finally:
        process.close()
    assert process.process.exitcode == 0  # it saw the pipe close and returned


@linux
def test_a_run_that_stops_mid_pass_ends_the_process_quietly():
    """Ctrl-C or an error stops the run while the child computes: the parent closes the pipe without
    reading the answer, and the child, finding no one to send it to, returns (exit code 0, no traceback)."""
    policy, ids, mask = tiny_policy_and_rows()
    process = ReferenceProcess(policy)
    process.submit([(ids.repeat(64, 1), mask.repeat(64, 1))], 5, 1.0)  # a pass long enough to close during
    process.close()
    assert process.process.exitcode == 0


@linux
def test_an_error_in_the_process_is_raised_here_with_its_traceback():
    policy, ids, mask = tiny_policy_and_rows()
    process = ReferenceProcess(policy)
    try:
        answer = process.submit([(ids, mask[:, :5])], 3, 1.0)  # a mask that does not fit the ids
        with pytest.raises(RuntimeError, match="the reference pass raised, in its process:\n.*Traceback"):
            answer()
        assert process.submit([(ids, mask)], 3, 1.0)()[0].shape == (4, 3)  # and it serves on
    finally:
        process.close()


@linux
def test_the_process_keeps_no_run_dir_locked(tmp_path):
    """A forked child holds copies of the parent's descriptors: those of run dir locks it closes, so a
    dir the parent gives up is free while the child lives."""
    from rlnotes.run import rundir

    policy, ids, mask = tiny_policy_and_rows()
    rundir.own(tmp_path / "run")
    process = ReferenceProcess(policy)
    try:
        process.submit([(ids, mask)], 3, 1.0)()  # the child is running (its fork handlers ran)
        rundir.release(tmp_path / "run")
        rundir.own(tmp_path / "run")  # a lock of its own again: refused if the child still held the old one
        rundir.release(tmp_path / "run")
        assert process.process.is_alive()
    finally:
        process.close()


def run(tmp_path, spare: bool, monkeypatch, *overrides):
    """A short tiny run with the spare core forced on or off: its metrics and its final adapter."""
    import rlnotes.training.setup
    from safetensors.torch import load_file

    monkeypatch.setattr(rlnotes.training.setup, "spare_core", lambda *args: spare)
    console = Console(record=True, width=300)
    train(compose("logging.progress=false", *overrides), tmp_path, console)
    assert ("the reference pass beside the policy's, on a second core" in console.export_text()) == spare
    timing = lambda key: key.startswith("time/") or key.endswith("_per_s")  # noqa: E731
    rows = [{k: v for k, v in json.loads(line).items() if not timing(k)}
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(tmp_path / "final" / "adapter_model.safetensors")


@linux
@pytest.mark.parametrize("algo", ["grpo", "dpo"])
def test_a_run_with_the_reference_beside_is_the_run_without(tmp_path, monkeypatch, algo):
    from rlnotes.engine.hardware import beside

    served = []
    real = beside.ReferenceProcess.submit
    monkeypatch.setattr(beside.ReferenceProcess, "submit", lambda self, *a: served.append(1) or real(self, *a))
    overrides = ("trainer.steps=3", f"algo={algo}", "trainer.micro_batch_size=4")  # a few passes a step
    alone, weights = run(tmp_path / "alone", False, monkeypatch, *overrides)
    assert not served
    spare, spare_weights = run(tmp_path / "spare", True, monkeypatch, *overrides)
    assert len(served) >= 3  # every step's reference passes went to the process
    assert spare == alone
    assert weights.keys() == spare_weights.keys()
    assert all(torch.equal(weights[k], spare_weights[k]) for k in weights)
