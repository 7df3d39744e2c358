"""Linear layers whose weights are packed for oneDNN's matmul: while sampling, and for the frozen
weights of every pass.

torch multiplies float32 matrices on a CPU with MKL's sgemm. oneDNN (torch's mkldnn operators),
given a copy of the weight reordered once into its own blocked layout, multiplies the same matrices
faster on the CPUs measured: most at the few rows of a decoding step and for a wide LM head on a
Zen 3 EPYC, and about 2x at most shapes on a Zen 5 EPYC, where MKL's float32 products ran at half
oneDNN's rate (figures: docs/benchmarks.md). Each call costs oneDNN a fixed few microseconds more, so
a small weight (below MIN_WEIGHTS elements: a tiny model's) stays with MKL; SmolLM2's 576 x 192 key
and value maps, below the bound on a Zen 3 EPYC, gained on the Zen 5 one from being packed. On an
Intel CPU MKL runs float32 at oneDNN's rate, and float32 weights stay with it (float32_packs).

While sampling, each such nn.Linear (the merged LoRA layers of rlnotes.engine.policy.merged among them) is
swapped for a PackedLinear holding the reordered copy, made afresh each time for a weight that
changes (a merged adapter), kept between calls for a frozen one (kept_packing). The outputs are those
of the plain layers up to float32 rounding (which may tip a sampled token where two are nearly tied).
`rollout.pack_weights=false` keeps MKL for sampling's decoding steps; scripts/bench.py times generation.

The training and reference passes (rlnotes.engine.policy.llama) multiply by each large frozen weight W
(the base model's under LoRA) through its kept packed copy, and the backward pass's x-gradient dy W
through a kept packed copy of W^T (frozen_linear); the LM head's blocks of vocabulary likewise
(rlnotes.engine.policy.head). The copies cost the frozen weights' size twice more in memory, made at
the first pass, and save every pass their reordering.

bf16 weights (hardware.precision=bf16) are packed for sampling too, where oneDNN multiplies bf16
natively; their input is rounded to bf16 first, as autocast rounds it for the plain layer. Under bf16
autocast the passes multiply as autocast does.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlnotes.engine.policy.merged import MergedLinear, swapped_in

MIN_WEIGHTS = 2**16
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


@functools.lru_cache(maxsize=None)
def float32_packs(cpu_name: Optional[str] = None) -> bool:
    """Whether float32 products go through oneDNN's packs on the CPU named `cpu_name` (default: this
    one, as torch's CPU capabilities name it): all but Intel's. MKL, torch's float32 product, runs at
    half oneDNN's rate on the AMD EPYCs measured and at its full rate on an Intel Xeon, where the
    packs only cost their memory and calls: a SmolLM2 DPO step in float32 took 1.59 s without them
    against 1.68 s with them (an AMX Xeon, two alternating processes each), and sampling no faster
    with them (docs/benchmarks.md). bf16 weights are packed on every CPU."""
    name = cpu_name if cpu_name is not None else str(torch.cpu.get_capabilities().get("cpu_name") or "")
    return not name.startswith("Intel")


# The packed copies of frozen weights (the base model's under LoRA), kept between passes and steps
# while the weight is unchanged, under (the weight's id, transposed, rows), dropped with the weight:
# (the weight's storage, version and dtype when packed, the packed copy).
_KEPT: dict[tuple, tuple[tuple, torch.Tensor]] = {}


def frozen(weight: torch.Tensor) -> bool:
    """A parameter that does not train (its packed copy can be kept)."""
    return isinstance(weight, torch.nn.Parameter) and not weight.requires_grad


def reordered(weight: torch.Tensor) -> torch.Tensor:
    """A copy of the weight W [out, in] in oneDNN's blocked layout, laid out for ROWS rows
    (packed_product multiplies by it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T + b through oneDNN, for W reordered (reordered, kept_packing)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def kept_packing(weight: torch.Tensor, transposed: bool = False, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The frozen `weight` W [out, in] (or W^T, the weight of the backward pass's x-gradient, dy W),
    or its rows [start, stop) alone (a block of an LM head's vocabulary), reordered for oneDNN: made
    at the first call, kept while W is unchanged."""
    key, stamp = (id(weight), transposed, rows), (weight.data_ptr(), weight._version, weight.dtype)
    kept = _KEPT.get(key)
    if kept is not None and kept[0] == stamp:
        return kept[1]
    w = weight if rows is None else weight[rows[0]:rows[1]]
    packed = reordered(w.t() if transposed else w)
    if key not in _KEPT:
        weakref.finalize(weight, _KEPT.pop, key, None)
    _KEPT[key] = (stamp, packed)
    return packed


class PackedLinear(torch.nn.Module):
    """y = x W^T + b through oneDNN with W reordered once (a frozen W's copy kept between calls:
    kept_packing); with gradients on (the reordered copy has none), through the plain weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = kept_packing(weight) if frozen(weight) else reordered(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or (x.dtype != torch.float32 and self.weight.dtype == torch.float32):
            return F.linear(x, self.weight, self.bias)
        x = x.to(self.weight.dtype)
        bias = None if self.bias is None else self.bias.detach()
        return packed_product(x, self.packed, bias)


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b and, for the backward pass, dx = dy W, both through oneDNN's packed copies (of W
    and of W^T); W and b are frozen, so they get no gradient."""

    @staticmethod
    def forward(ctx, x, packed, packed_t, bias):
        ctx.packed_t = packed_t
        return packed_product(x, packed, bias)

    @staticmethod
    def backward(ctx, dy):
        return packed_product(dy.contiguous(), ctx.packed_t), None, None, None


def packed_frozen(weight: torch.Tensor) -> bool:
    """Whether products with `weight` go through kept oneDNN packs (kept_packing): a frozen float32
    weight of at least MIN_WEIGHTS entries on the CPU, oneDNN working, outside autocast."""
    return (frozen(weight) and weight.dtype == torch.float32 and weight.device.type == "cpu" and available()
            and not isinstance(weight, DTensor) and weight.numel() >= MIN_WEIGHTS
            and not torch.is_autocast_enabled("cpu") and float32_packs())


def frozen_linear(module: torch.nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """x -> module(x) for the forward passes of training and the reference: through oneDNN with the
    kept packed copies of the weight (kept_packing), the x-gradient too, for an nn.Linear whose weight
    and bias are frozen float32 on the CPU with at least MIN_WEIGHTS entries; else None. Under bf16
    autocast or for an input of another dtype, the plain layer's F.linear."""
    weight, bias = module.weight, module.bias
    if not (type(module) is torch.nn.Linear and packed_frozen(weight) and (bias is None or frozen(bias))):
        return None

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, weight, bias)
        b = None if bias is None else bias.detach()
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenLinear.apply(x, kept_packing(weight), kept_packing(weight, True), b)
        return packed_product(x, kept_packing(weight), b)
    return forward


def _packable(module: torch.nn.Module) -> bool:
    return (type(module) in (torch.nn.Linear, MergedLinear) and module.weight.device.type == "cpu"
            and ((module.weight.dtype == torch.float32 and float32_packs())
                 or (module.weight.dtype == torch.bfloat16 and available_bf16()))
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
