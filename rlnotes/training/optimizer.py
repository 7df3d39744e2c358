"""The optimizer step every algorithm (and the SFT warm-up) calls once its gradients are in place, and
the learning-rate schedule it follows."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Callable, Dict

import torch

from rlnotes.core.errors import TrainingError
from rlnotes.engine.hardware import distributed

if TYPE_CHECKING:
    from rich.console import Console

    from rlnotes.training.context import Model, Run


def optimizer_step(model: Model, run: Run, console: Console) -> Dict[str, float]:
    """Clip, step and schedule; a non-finite gradient skips the update (three in a row stop the run)."""
    run.updating = True
    params = model.trainable_parameters()
    distributed.sum_gradients(params)  # each rank's loss is its share of the global batch's: their sum is the batch's
    grad_norm = distributed.clip_grad_norm(params, model.max_grad_norm)
    lr = model.scheduler.get_last_lr()[0]
    if torch.isfinite(grad_norm):
        model.optimizer.step()
        run.bad_steps = 0
    else:
        run.bad_steps += 1
        console.print(f"[yellow]non-finite gradient (norm {float(grad_norm)}); update skipped[/]")
        if run.bad_steps >= 3:
            raise TrainingError("the loss gave non-finite gradients 3 steps in a row; lower optim.lr, "
                                "check the reward for huge values, or set optim.max_grad_norm")
    model.optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still uses up its step of the schedule
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        model.scheduler.step()
    run.step += 1
    return {"optim/grad_norm": float(grad_norm), "optim/lr": lr, "optim/skipped": float(run.bad_steps > 0)}


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(total - warmup, 1)
        if schedule == "linear":
            return max(1.0 - frac, 0.0)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0
    return factor


def schedule(cfg) -> Callable[[int], float]:
    """The learning-rate factor of each optimizer step: optim.schedule over the steps after the SFT
    warm-up (whose steps set their own rate, sft_warmup.lr), as if the run began after it."""
    o, start = cfg.optim, cfg.sft_warmup.steps
    factor = lr_lambda(o.schedule, o.warmup_steps, cfg.trainer.steps - start)
    return lambda step: factor(max(step - start, 0))
