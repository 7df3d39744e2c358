"""Sampling through merged LoRA weights.

A LoRA layer computes W x + s B (A x): three matmuls, and on a CPU about as much time again in
peft's Python around them. Generation runs one token at a time, where that overhead is most of a
small layer's cost, so while sampling each adapted layer is swapped for a plain one with the
adapter folded into a copy of its weight,

    W' = W + s B A        (s = alpha / r),

which computes the same function (up to float rounding) in one matmul. The base weights are never
written, so the reference (adapter off) and training see exactly what they saw before.

Only float32 weights are merged: in bfloat16 the small update s B A would be lost to W's rounding
(an entry of W + s B A rounds back to W's bf16 value wherever |s B A| is below half of W's rounding
step, as it is early in training). A layer whose base weight is bf16 (hardware.precision=bf16) is
swapped for a LowRankLinear instead, which adds the update to the output,

    y = x W^T + b + s (x A^T) B^T,

the LoRA layer's own sum without peft's Python around it. The update is computed in float32, the
adapter's dtype, outside autocast, then added into the base's bf16 output (add_update), as rlnotes'
own training and reference passes compute it (rlnotes.engine.policy.llama): a product with 16
columns gains nothing from bf16 and, at a decoding step's few rows, ran 3-10x slower in it on an
AMX Xeon than in float32.
Layers with a LoRA variant (DoRA and others), a LoRA bias, or sharded (FSDP) weights stay as they are.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Tuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class MergedLinear(torch.nn.Module):
    """y = x W'^T + b with W' = W + s B A computed once: a LoRA layer as one plain linear map."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def add_update(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
               dropout: float = 0.0) -> torch.Tensor:
    """y + s (dropout(x) A^T) B^T in y's dtype, the update computed in A's dtype (float32), outside
    autocast where it is on (whose bf16 would round x, A and B first); in place without gradients."""
    def update() -> torch.Tensor:
        h = x.to(a.dtype)
        return F.linear(F.linear(F.dropout(h, dropout) if dropout else h, a), b) * scale
    if not torch.is_autocast_enabled(x.device.type):
        return (y + update()).to(y.dtype)
    with torch.autocast(x.device.type, enabled=False):
        u = update()
    return (y + u).to(y.dtype) if torch.is_grad_enabled() else y.add_(u)


class LowRankLinear(torch.nn.Module):
    """y = base(x) + sum over the adapters of s (x A^T) B^T (add_update): a LoRA layer over a bf16
    base weight as plain modules. `base` is the LoRA layer's own linear layer (packed for sampling
    in its turn: rlnotes.engine.policy.packed); `terms` holds (A, B, s) of each active adapter."""

    def __init__(self, base: torch.nn.Module, terms: List[Tuple[torch.Tensor, torch.Tensor, float]]):
        super().__init__()
        self.base, self.terms = base, terms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for a, b, scale in self.terms:
            y = add_update(y, x, a, b, scale)
        return y


Slot = Tuple[torch.nn.Module, str, torch.nn.Module]  # (parent, attribute name, LoRA layer)


def lora_slots(model: torch.nn.Module) -> List[Slot]:
    """Every peft LoRA linear layer of `model`, with where it hangs in the module tree."""
    from peft.tuners.lora import Linear as LoraLinear

    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, LoraLinear)]


def _adapters(layer) -> List[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _plain(layer, dtype: torch.dtype) -> bool:
    """A LoRA layer computing W x + b + s B A x alone, adapter on, over a whole `dtype` weight."""
    base = layer.base_layer
    return (type(base) is torch.nn.Linear and base.weight.dtype == dtype
            and not isinstance(base.weight, DTensor) and not layer.merged and not layer.disable_adapters
            and all(a not in layer.lora_variant and not layer.lora_bias[a] for a in _adapters(layer)))


def _sampling_layer(layer) -> torch.nn.Module:
    """The layer sampling goes through in place of the LoRA layer `layer`: merged over a float32
    weight, low-rank over a bf16 one (the caller checked it is one of those)."""
    if layer.base_layer.weight.dtype == torch.float32:
        return MergedLinear(merged_weight(layer), layer.base_layer.bias)
    return LowRankLinear(layer.base_layer, [(layer.lora_A[a].weight, layer.lora_B[a].weight, layer.scaling[a])
                                            for a in _adapters(layer)])


def merged_weight(layer) -> torch.Tensor:
    """W + sum over the active adapters of s B A, for a peft LoRA linear layer (a new tensor)."""
    weight = layer.base_layer.weight.detach().clone()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight += layer.get_delta_weight(adapter).detach()
    return weight


@contextlib.contextmanager
def merged_adapters(slots: List[Slot]) -> Iterator[None]:
    """Within the block, each plain LoRA layer of `slots` replaced by its MergedLinear (a float32
    weight) or LowRankLinear (a bf16 one); the LoRA layers (and their weights, untouched) back in
    place after it."""
    swapped = [(parent, name, layer) for parent, name, layer in slots
               if _plain(layer, torch.float32) or _plain(layer, torch.bfloat16)]
    with swapped_in(swapped, _sampling_layer):
        yield


@contextlib.contextmanager
def swapped_in(slots: List[Slot], make: Callable[[torch.nn.Module], torch.nn.Module]) -> Iterator[None]:
    """Within the block, each layer of `slots` replaced in its parent by make(layer), built without
    gradients; every layer back in place after it, also after an error."""
    try:
        with torch.no_grad():
            for parent, name, layer in slots:
                setattr(parent, name, make(layer))
        yield
    finally:
        for parent, name, layer in slots:
            setattr(parent, name, layer)
