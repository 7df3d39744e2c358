"""FSDP2 (hardware.strategy=fsdp): a model's parameters sharded across the ranks, one unit per
transformer block; its weights gathered whole for generation, and its full state gathered on
rank 0 for a save. The optimizer state's shards are rlnotes.engine.hardware.distributed's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch


def _fsdp_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP shards `model`'s parameters."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2: each transformer block (the Hugging Face model's _no_split_modules) is a unit whose
    weights are gathered for its forward and backward and freed after; the whole model is the root
    unit. Gradients are reduce-scattered as sums, since each rank's loss is already its share of
    the global batch's loss."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(model._no_split_modules or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Under FSDP, every weight of `model` whole on every rank for the block, with no collective in
    its forward passes: for generation, where each rank runs as many passes as its own samples need
    (sharded weights are gathered in lock-step, one layer at a time). A no-op otherwise."""
    if not is_sharded(model):  # shard_model shards the root too: without it, no walk over the modules each step
        yield
        return
    units = _fsdp_modules(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            # The root keeps its weights from forward to backward (FSDP's own default for it).
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def full_state(model: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """The full state dict of a sharded `model` on rank 0 (on CPU; empty on other ranks); every rank
    must call it. None when the model is not sharded: it saves itself."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
