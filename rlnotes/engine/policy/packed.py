"""Sampling through linear layers whose weights are packed for oneDNN's matmul.

torch multiplies float32 matrices on a CPU with MKL's sgemm. oneDNN (torch's mkldnn operators),
given a copy of the weight reordered once into its own blocked layout, multiplies the same matrices
faster on the CPUs measured, most at the few rows of a decoding step, and most of all for a wide LM
head. Each call costs oneDNN a fixed few microseconds more, so a small weight (below MIN_WEIGHTS
elements: a tiny model's, or SmolLM2's 576 x 192 key and value maps) stays with MKL.

While sampling, each such nn.Linear (the merged LoRA layers of rlnotes.engine.policy.merged among them) is
swapped for a PackedLinear holding the reordered copy, made afresh each time (the adapter changes
every step, at the cost of the weights' size again in memory while sampling). The outputs are those
of the plain layers up to float32 rounding (which may tip a sampled token where two are nearly tied).
`rollout.pack_weights=false` keeps MKL; scripts/bench.py times generation (figures: docs/benchmarks.md).

bf16 weights (hardware.precision=bf16) are packed too, where oneDNN multiplies bf16 natively; their
input is rounded to bf16 first, as autocast rounds it for the plain layer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlnotes.engine.policy.merged import MergedLinear, swapped_in

MIN_WEIGHTS = 2**17
ROWS = 32  # the number of rows oneDNN lays the weight out for; as fast as MKL or faster from 1 to 1024 rows


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this torch build has the oneDNN operators PackedLinear calls, working."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 3), 1)
        return bool(torch.ops.mkldnn._linear_pointwise(torch.ones(1, 3), weight, None, "none", [], "")[0, 0] == 3)
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def available_bf16() -> bool:
    """Whether oneDNN multiplies bf16 natively on this CPU, through the operators PackedLinear calls."""
    if not available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 3, dtype=torch.bfloat16), 1)
        x = torch.ones(1, 3, dtype=torch.bfloat16)
        return bool(torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")[0, 0] == 3)
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(torch.nn.Module):
    """y = x W^T + b through oneDNN with W reordered once; with gradients on (the reordered copy has
    none), through the plain weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or (x.dtype != torch.float32 and self.weight.dtype == torch.float32):
            return F.linear(x, self.weight, self.bias)
        x = x.to(self.weight.dtype)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    return (type(module) in (torch.nn.Linear, MergedLinear) and module.weight.device.type == "cpu"
            and (module.weight.dtype == torch.float32 or (module.weight.dtype == torch.bfloat16 and available_bf16()))
            and not isinstance(module.weight, DTensor) and module.weight.numel() >= MIN_WEIGHTS)


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every packable linear layer of `model` (float32, or bf16 where oneDNN has it,
    on the CPU, at least MIN_WEIGHTS weights, not inside a LoRA layer that stays) swapped for its
    PackedLinear; the layers back in place after it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not available():
        yield
        return
    inside_adapters = {id(m) for layer in model.modules() if isinstance(layer, BaseTunerLayer)
                       for m in layer.modules()}
    swapped = [(parent, name, child) for parent in model.modules() if id(parent) not in inside_adapters
               for name, child in parent.named_children() if _packable(child)]
    with swapped_in(swapped, lambda layer: PackedLinear(layer.weight, layer.bias)):
        yield
