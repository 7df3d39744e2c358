"""Frozen linear weights stored in bf16, for hardware.precision=bf16.

Under bf16 autocast every matmul rounds its float32 weight to bf16 afresh, pass after pass: a copy of
each weight per call, which on a CPU costs a good part of what the bf16 matmul saves. A weight that
never changes (the base model under LoRA, the frozen reference copy without it) is stored rounded
once instead: the numbers every matmul sees are the same, in half the memory and with no cast per
pass. What trains stays float32 (LoRA's A and B, every weight of model.lora=null), and so do the
embeddings and norms, which autocast keeps in float32 too: only nn.Linear layers are stored in bf16.

A tied embedding shares its weight with the LM head, so it is stored in bf16 with it; its lookups are
given back in float32 (the values bf16 holds), so the residual stream stays float32 as under
autocast. A bf16 residual stream had about half as much log-prob error again on SmolLM2
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch


def _float32_output(module: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def frozen_linears_to_bf16(model: torch.nn.Module) -> int:
    """Store the weight and bias of every nn.Linear of `model` whose weight does not train in bf16
    (in place: a tied weight stays tied); a float32 input embedding that now shares a bf16 weight
    returns float32 lookups. Returns the number of weights stored in bf16 now (0 when done before)."""
    embed = model.get_input_embeddings()
    embed_was_float32 = embed.weight.dtype == torch.float32
    cast = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.requires_grad:
            continue
        for param in (module.weight, module.bias):
            if param is not None and param.dtype == torch.float32:
                param.data = param.data.to(torch.bfloat16)
                cast += param.numel()
    if embed_was_float32 and embed.weight.dtype == torch.bfloat16:  # tied to a head stored in bf16 just now
        embed.register_forward_hook(_float32_output)
    return cast
