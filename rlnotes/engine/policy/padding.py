"""Position-wise layers that skip padding.

A batch of rows is a rectangle: prompts padded on the left, completions on the right. Attention needs
the rectangle (each row's keys and values in their columns), but the rest of a decoder layer acts on
each position alone: the MLP and the attention's input and output projections, almost all of a
layer's matmuls. Their outputs at padding positions reach no real position (the attention mask
hides padding columns), so within `skip_padding` these layers run on the real positions only,
gathered into one [N, d] matrix, and scatter their outputs back with 0 at padding:

    y[real] = f(x[real]),    y[padding] = 0

The outputs at real positions and every gradient are those of the whole rectangle; scripts/bench.py
times the passes (figures: docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, List

import torch

from rlnotes.engine.policy.merged import LowRankLinear, MergedLinear

# Gathering a module's real positions and scattering its output back costs tens of microseconds
# whatever the module, so the padding's work in it must be well above that: padding positions x its
# weights, on average over the modules, at least MIN_SAVING multiply-adds. A tiny Llama's modules save
# about a million each at the bench shape and its passes ran slower skipping; SmolLM2-135M's save
# about a hundred times that.
MIN_SAVING = 4_000_000


def worth_gathering(padding: int, weights: int, modules: int) -> bool:
    """Whether `padding` positions are worth gathering the real ones out of, for `modules` weight
    matrices of `weights` entries in all: at least MIN_SAVING multiply-adds saved a module on average
    (also the rule of rlnotes' own pass, rlnotes.engine.policy.llama.Slots)."""
    return padding > 0 and padding * weights >= MIN_SAVING * modules

_LAYERS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def _decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(attention, MLP) of each decoder layer of `model`, found once per model."""
    if model not in _LAYERS:
        pairs = ((getattr(m, "self_attn", None) or getattr(m, "attn", None), getattr(m, "mlp", None))
                 for m in model.modules())
        _LAYERS[model] = [(a, b) for a, b in pairs if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module)]
    return _LAYERS[model]


def _projection(module: torch.nn.Module) -> bool:
    """A linear map applied to each position: a plain, LoRA-wrapped, merged, low-rank or GPT-2 style
    linear layer."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (torch.nn.Linear, BaseTunerLayer, MergedLinear, LowRankLinear, Conv1D))


def position_wise(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of `model` that act on each position alone: every decoder layer's MLP (a module
    whose class name ends in MLP: not a mixture of experts, whose forward returns more) and the
    linear layers directly under its attention module. Read from the module tree at each call, so
    layers swapped in for sampling (rlnotes.engine.policy.merged) count."""
    found = []
    for attention, mlp in _decoder_layers(model):
        if type(mlp).__name__.endswith("MLP"):
            found.append(mlp)
        found.extend(child for child in attention.children() if _projection(child))
    return found


class _Positions:
    """The real positions of a pass, `index` among `size`, and the last input gathered at them, so
    the projections that take the same input (q, k and v) gather it once."""

    def __init__(self, index: torch.Tensor, size: int):
        self.index, self.size, self.last = index, size, None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.last is None or self.last[0] is not x or self.last[1] != x._version:
            self.last = x, x._version, x.reshape(self.size, x.shape[-1]).index_select(0, self.index)
        return self.last[2]


class _RealPositions:
    """A module's forward run on the real positions of its input's [size, d] positions, the output
    scattered back into zeros; an input with another number of positions goes through whole."""

    def __init__(self, forward, positions: _Positions):
        self.forward, self.positions = forward, positions

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        size, index = self.positions.size, self.positions.index
        if x.shape[:-1].numel() != size:
            return self.forward(x, *args, **kwargs)
        y = self.forward(self.positions.gather(x), *args, **kwargs)
        whole = y.new_zeros(size, y.shape[-1]).index_copy_(0, index, y)
        return whole.reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def skip_padding(model: torch.nn.Module, real: torch.Tensor) -> Iterator[None]:
    """Within the block, `model`'s position-wise layers run on the positions where `real` [B, T] (the
    attention mask of the tokens a forward pass takes in) is nonzero, when that saves at least
    MIN_SAVING multiply-adds a module (padding positions x its weights); else nothing changes."""
    flat = real.reshape(-1).bool()
    padding = flat.numel() - int(flat.sum())
    modules = position_wise(model) if padding else []
    weights = sum(p.numel() for m in modules for p in m.parameters())
    if not modules or not worth_gathering(padding, weights, len(modules)):
        yield
        return
    positions = _Positions(flat.nonzero().squeeze(-1), flat.numel())
    own = [m.__dict__.get("forward") for m in modules]  # a forward set on the instance, kept
    for module in modules:
        module.forward = _RealPositions(module.forward, positions)
    try:
        yield
    finally:
        for module, forward in zip(modules, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def forward_real(model: torch.nn.Module, **inputs):
    """model(**inputs) with its position-wise layers skipping the padding among `input_ids`: the
    columns of `attention_mask` (which may cover a KV cache's positions first) that they fill."""
    real = inputs["attention_mask"][:, -inputs["input_ids"].shape[1]:]
    with skip_padding(model, real):
        return model(**inputs)
