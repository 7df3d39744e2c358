"""The device a process computes on (hardware.device), its backends (hardware.tf32) and the precision
of its forward passes (hardware.precision)."""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from rlnotes.core.errors import ConfigError

# hardware.precision=auto: bf16 for a model of at least this many parameters on a device with bf16
# units, else fp32. A small model's pass is many small operations whose casts cost more than its
# matmuls save: on an AMD EPYC with avx512_bf16 the tiny model (0.1M) trained 2-4x slower in bf16,
# SmolLM2-135M 1.7x faster (figures and commands: docs/benchmarks.md). Sizes between were not
# measured; the line is where hardware.threads=auto changes too.
AUTO_BF16_FROM = 20_000_000

# The CPU features whose instructions multiply bf16 matrices (torch.cpu.get_capabilities' names), the
# fastest first: Intel's AMX tiles, AVX-512 BF16 (Intel since Cooper Lake, AMD since Zen 4), Arm's BF16.
CPU_BF16_FEATURES = ("amx_bf16", "avx512_bf16", "sve_bf16", "bf16")


def resolve_device(name: str) -> torch.device:
    """cpu, cuda, or auto (cuda when torch sees a GPU)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware.device=cuda but torch sees no GPU; use hardware=cpu or install a CUDA torch")
    return torch.device(name)


def bf16_units(device: torch.device) -> Optional[str]:
    """What multiplies bf16 matrices on `device` natively: the CPU feature of CPU_BF16_FEATURES it
    has ("avx512_bf16"), "cuda" for a GPU torch says computes bf16, or None (bf16 then runs in
    emulation, several times slower than fp32)."""
    if device.type == "cuda":
        return "cuda" if torch.cuda.is_bf16_supported(including_emulation=False) else None
    if device.type != "cpu":
        return None
    features = torch.cpu.get_capabilities()
    return next((name for name in CPU_BF16_FEATURES if features.get(name)), None)


def _cpu_name() -> str:
    return str(torch.cpu.get_capabilities().get("cpu_name") or "this CPU")


def check_precision(precision: str, device: torch.device) -> None:
    """hardware.precision=bf16 on a CPU without bf16 units is refused before anything loads: every
    matmul would run emulated, several times slower than fp32, which is not what bf16 is asked for."""
    if precision == "bf16" and device.type == "cpu" and bf16_units(device) is None:
        raise ConfigError(f"hardware.precision=bf16: {_cpu_name()} has no bf16 matmul instructions (amx_bf16 or "
                          "avx512_bf16), so bf16 would run several times slower than fp32 here; use "
                          "hardware.precision=fp32, or auto (bf16 only where the hardware has it)")


def choose_precision(precision: str, device: torch.device, parameters: int) -> Tuple[str, str]:
    """(fp32 or bf16, what the run's start line says about it: "" for fp32 asked for) for
    hardware.precision on `device`, for a model of `parameters`; auto: bf16 where the device has
    bf16 units and the model has at least AUTO_BF16_FROM parameters."""
    check_precision(precision, device)
    units = bf16_units(device)
    if precision == "bf16":
        return "bf16", f"bf16 ({units})"
    if precision == "fp32":
        return "fp32", ""
    if units is None:
        where = _cpu_name() if device.type == "cpu" else "the GPU"
        return "fp32", f"fp32: hardware.precision=auto, {where} has no bf16 units"
    if parameters < AUTO_BF16_FROM:
        return "fp32", (f"fp32: hardware.precision=auto, {parameters / 1e6:.2f}M parameters, fewer than "
                        f"{AUTO_BF16_FROM / 1e6:g}M")
    return "bf16", f"bf16 ({units}): hardware.precision=auto, {parameters / 1e6:.2f}M parameters"


def mixed_precision(precision: str, device: torch.device):
    """The context a step's forward passes run in: bfloat16 autocast for hardware.precision=bf16
    (matmuls in bf16, reductions and losses in float32), nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure_backends(hardware, device: torch.device) -> None:
    """TF32 matmuls on CUDA when hardware.tf32 (float32 weights, tensor-core speed); hardware.precision
    checked against the device (check_precision), before anything loads."""
    check_precision(hardware.precision, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(hardware.tf32)
        torch.backends.cudnn.allow_tf32 = bool(hardware.tf32)
