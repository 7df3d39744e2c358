"""How many torch threads a process computes with (hardware.threads): a number given, torch's
default, or auto, which a small model runs fastest with one thread and a larger one with all."""

from __future__ import annotations

import os

import torch

# hardware.threads=auto: one thread for a model of fewer parameters than this, torch's default from
# it up (all cores; under torchrun the launcher's OMP_NUM_THREADS share). Below it a step's matmuls are
# too small to split: threads only add hand-off and wake-up costs. scripts/bench_threads.py times a GRPO
# step at widths around it with one thread and with all (figures: docs/benchmarks.md); more cores may move
# the crossover down, never below the sizes measured faster on one. It was 20M while threads slept at once
# between parallel regions (rlnotes.engine.hardware.openmp): each region paid a wake-up; with the short spin
# two threads won from 1.36M parameters (0.35M: 0.94x, 1.36M: 1.29x, 5.35M: 1.32x, 21M: 1.62x).
AUTO_ONE_THREAD_BELOW = 1_000_000


def auto_threads(parameters: int) -> int:
    """hardware.threads=auto: 1 for a model below AUTO_ONE_THREAD_BELOW parameters, else 0 (torch's default)."""
    return 1 if parameters < AUTO_ONE_THREAD_BELOW else 0


def set_threads(setting, model: torch.nn.Module) -> str:
    """Set torch's intra-op threads as hardware.threads says, once `model` (the base model, whose
    size auto goes by) is built. Returns what auto chose and why, for the run's start line ("" unless auto)."""
    if setting != "auto":
        if setting is not None:
            torch.set_num_threads(setting)
        return ""
    parameters = sum(p.numel() for p in model.parameters())
    threads = auto_threads(parameters)
    if threads:
        torch.set_num_threads(threads)
    count = torch.get_num_threads()
    below = "fewer than" if threads else "at least"
    return (f"{count} thread{'s' * (count > 1)}{'' if threads else omp_source(count)}: hardware.threads=auto, "
            f"{parameters / 1e6:.2f}M parameters, {below} {AUTO_ONE_THREAD_BELOW / 1e6:g}M")


def omp_source(count: int) -> str:
    """The start line's " (from OMP_NUM_THREADS=N)" when torch's default thread count, `count`, is the
    one that variable sets (the user's, or a launcher's share of the cores), else ""."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return f" (from OMP_NUM_THREADS={value})" if value.isdigit() and int(value) == count else ""
