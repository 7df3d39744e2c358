"""The optimizer every run builds (rlnotes.training.optimizer.adamw): torch's AdamW with the optim
section's settings, fused where the parameters allow it, the same update as the unfused loop."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from rlnotes.training.optimizer import adamw

OPTIM = OmegaConf.create({"lr": 1e-2, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1})


def parameters(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((16, 24), (24, 16), (5,))]


def test_adamw_is_fused_on_a_cpu_with_the_sections_settings_and_steps_as_the_unfused_loop():
    fused, plain = parameters(), parameters()
    optimizer = adamw(fused, OPTIM)
    reference = torch.optim.AdamW(plain, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    group = optimizer.param_groups[0]
    assert group["fused"] and (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        1e-2, (0.8, 0.95), 1e-6, 0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(fused, plain):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
    for a, b, start in zip(fused, plain, parameters()):
        assert not torch.equal(a, start)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_adamw_falls_back_to_the_loop_where_a_parameter_cannot_be_fused():
    params = parameters() + [torch.nn.Parameter(torch.zeros(3, device="meta"))]
    assert not adamw(params, OPTIM).param_groups[0]["fused"]
