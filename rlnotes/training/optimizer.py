"""The optimizer step every algorithm (and the SFT warm-up) calls once its gradients are in place, the
learning-rate schedule it follows, and the optimizer settings a resumed run changes."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List

import torch
from omegaconf import OmegaConf

from rlnotes.core.errors import TrainingError
from rlnotes.engine.hardware import distributed

if TYPE_CHECKING:
    from rich.console import Console

    from rlnotes.training.context import Model, Run


def adamw(params: List[torch.nn.Parameter], optim) -> torch.optim.AdamW:
    """torch's AdamW with the `optim` section's settings, fused where every parameter is a whole
    float tensor on a CPU or CUDA device (not an FSDP shard): one kernel over all parameters, where
    torch's default on a CPU loops over them in Python, about ten operations each (a LoRA adapter
    of SmolLM2 on q/k/v/o is 240 tensors). The same update up to float rounding."""
    from torch.distributed.tensor import DTensor

    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() and not isinstance(p, DTensor)
                for p in params)
    return torch.optim.AdamW(params, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             weight_decay=optim.weight_decay, fused=fused or None)


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


# The optim settings a resumed run takes from its own config rather than the checkpoint's optimizer
# and scheduler state (which hold the rate, betas, eps and weight decay they were saved with).
RESUMABLE = ("lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "schedule")


def changed_settings(checkpoint: Path, o) -> List[str]:
    """"optim.KEY old -> new" for each RESUMABLE setting of this run's optim section `o` that differs
    from that of the run which saved `checkpoint` (its config.yaml)."""
    saved = OmegaConf.select(OmegaConf.load(Path(checkpoint) / "config.yaml"), "optim", default=None) or {}
    return [f"optim.{key} {saved[key]} -> {o[key]}" for key in RESUMABLE if key in saved and saved[key] != o[key]]


def apply_settings(model: Model, o) -> None:
    """This run's optimizer settings `o` (its optim section) over those restored from a checkpoint, from
    its step on: every parameter group's betas, eps, weight decay and base rate optim.lr, and the
    schedule rebuilt at the step it had reached (so the rate now is optim.lr times this run's schedule
    there); Adam's moments and the schedule's position carry over. A user who changes a setting on
    resume means it; a resume that changes none never calls this, and stays exact."""
    for group in model.optimizer.param_groups:
        group.update(initial_lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    model.scheduler = torch.optim.lr_scheduler.LambdaLR(model.optimizer, model.lr_factor,
                                                        last_epoch=model.scheduler.last_epoch - 1)
