"""How many torch threads a process computes with (hardware.threads): a number given, torch's
default, or auto, which a small model runs fastest with one thread and a larger one with all."""

from __future__ import annotations

import torch

# hardware.threads=auto: one thread for a model of fewer parameters than this, torch's default from
# it up (all cores; under torchrun the launcher's OMP_NUM_THREADS share). Below it a step's matmuls are
# too small to split: threads only add hand-off and wake-up costs. Measured with
# scripts/bench_threads.py (a GRPO step at the default shape, median s after two warm-up steps, 2 cores,
# the tiny model widened to hidden W, MLP 2W; 1 thread / 2 threads):
#   0.09M parameters (W 64, model=tiny): 0.088 / 0.299 s     5.35M (W 512):  0.570 / 0.673 s
#   0.35M (W 128):                       0.175 / 0.290 s    21.18M (W 1024): 1.851 / 1.843 s (even)
#   1.36M (W 256):                       0.257 / 0.330 s
#   SmolLM2-135M (134.52M, one measured step each): 11.52 / 11.01 s
# (2026-12-03, other work on the machine beside it.) Two cores pay little even at SmolLM2's size here;
# more cores or a quieter machine may move the crossover down, never below the sizes measured faster on one.
AUTO_ONE_THREAD_BELOW = 20_000_000


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
    return (f"{count} thread{'s' * (count > 1)}: hardware.threads=auto, {parameters / 1e6:.2f}M parameters, "
            f"{below} {AUTO_ONE_THREAD_BELOW / 1e6:g}M")
