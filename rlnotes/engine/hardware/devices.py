"""The device a process computes on (hardware.device), its backends (hardware.tf32) and the precision
of its forward passes (hardware.precision)."""

from __future__ import annotations

import contextlib

import torch

from rlnotes.core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """cpu, cuda, or auto (cuda when torch sees a GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware.device=cuda but torch sees no GPU; use hardware=cpu or install a CUDA torch")
    return torch.device(name)


def mixed_precision(precision: str, device: torch.device):
    """The context a step's forward passes run in: bfloat16 autocast for hardware.precision=bf16
    (matmuls in bf16, reductions and losses in float32), nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure_backends(hardware, device: torch.device) -> None:
    """TF32 matmuls on CUDA when hardware.tf32 (float32 weights, tensor-core speed)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(hardware.tf32)
        torch.backends.cudnn.allow_tf32 = bool(hardware.tf32)
