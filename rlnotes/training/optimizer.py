"""The optimizer step every runner (and the SFT warm-up) calls once its gradients are in place."""

from __future__ import annotations

import warnings
from typing import Dict

import torch

from rlnotes.core.errors import TrainingError
from rlnotes.engine.hardware import distributed
from rlnotes.training.context import Context


def optimizer_step(ctx: Context) -> Dict[str, float]:
    """Clip, step and schedule; a non-finite gradient skips the update (three in a row stop the run)."""
    ctx.updating = True
    params = ctx.policy.trainable_parameters() + [p for head in ctx.heads.values() for p in head.parameters()]
    distributed.sum_gradients(params)  # each rank's loss is its share of the global batch's: their sum is the batch's
    grad_norm = distributed.clip_grad_norm(params, ctx.cfg.optim.max_grad_norm)
    lr = ctx.scheduler.get_last_lr()[0]
    if torch.isfinite(grad_norm):
        ctx.optimizer.step()
        ctx.bad_steps = 0
    else:
        ctx.bad_steps += 1
        ctx.console.print(f"[yellow]non-finite gradient (norm {float(grad_norm)}); update skipped[/]")
        if ctx.bad_steps >= 3:
            raise TrainingError("the loss gave non-finite gradients 3 steps in a row; lower optim.lr, "
                                "check the reward for huge values, or set optim.max_grad_norm")
    ctx.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still uses up its step of the schedule
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        ctx.scheduler.step()
    ctx.step += 1
    return {"optim/grad_norm": float(grad_norm), "optim/lr": lr, "optim/skipped": float(ctx.bad_steps > 0)}
