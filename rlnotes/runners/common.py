"""Mechanics every runner shares: setup, sampling and scoring a batch, micro-batches, the
optimizer step, and finishing a run. The algorithms themselves live in the runner files.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from omegaconf import OmegaConf
from rich.console import Console
from safetensors.torch import save_file

from rlnotes.data import PromptSampler, Row, load_task
from rlnotes.logger import MetricsLogger
from rlnotes.models import resolve_device
from rlnotes.notes import kl_penalty, masked_mean
from rlnotes.notes.reinforce import terminal_rewards
from rlnotes.policy import Policy
from rlnotes.rewards import Rewards
from rlnotes.rollout import Rollout, encode_prompts, generate


class TrainingError(RuntimeError):
    """A run that cannot go on; its message says what to try."""


@dataclass
class Context:
    cfg: object
    run_dir: Path
    device: torch.device
    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    eval_rows: List[Row]
    rewards: Optional[Rewards]     # None for algorithms that do not sample (DPO, SFT, RM)
    logger: MetricsLogger
    console: Console
    generator: torch.Generator
    timers: Dict[str, float] = field(default_factory=dict)
    step: int = 0          # optimizer steps taken
    bad_steps: int = 0     # consecutive skipped updates
    # Modules a runner trains beside the policy (a reward model's scalar head), made on its first
    # step and added with add_head: clipped with the policy, saved next to it as <name>.safetensors.
    heads: Dict[str, torch.nn.Module] = field(default_factory=dict)
    # A runner's own state kept across steps (e.g. DPO's precomputed reference log-probs).
    cache: Dict[str, object] = field(default_factory=dict)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the block's wall time to `time/<name>_s` of the current step."""
        start = time.perf_counter()
        yield
        self.timers[f"time/{name}_s"] = self.timers.get(f"time/{name}_s", 0.0) + time.perf_counter() - start


def lr_lambda(schedule: str, warmup: int, total: int):
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


def setup(cfg, run_dir: Path, console: Console) -> Context:
    """Seeds, device, policy/reference, data, rewards, optimizer and the metrics log."""
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.hardware.device)
    from rlnotes.config import ALGO_SCHEMAS

    rewards = Rewards(cfg.reward, console) if ALGO_SCHEMAS[cfg.algo.name].samples else None
    train_rows, eval_rows = load_task(cfg.data)
    policy = Policy.from_config(cfg.model, device)
    params = policy.trainable_parameters()
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o.schedule, o.warmup_steps, cfg.trainer.steps))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    n_params = sum(p.numel() for p in params)
    console.print(f"[bold]rlnotes[/] {cfg.algo.name} on {cfg.model.name_or_path} "
                  f"({n_params:,} trainable parameters, {'LoRA' if policy.uses_lora else 'full'}) -> {run_dir}")
    return Context(cfg=cfg, run_dir=run_dir, device=device, policy=policy, optimizer=optimizer, scheduler=scheduler,
                   sampler=PromptSampler(train_rows, cfg.trainer.batch_size, cfg.seed), eval_rows=eval_rows,
                   rewards=rewards, logger=MetricsLogger(run_dir, cfg.trainer.steps, console, cfg.logging.progress),
                   console=console, generator=torch.Generator(device).manual_seed(cfg.seed))


def columns_of(rows: List[Row], repeat: int) -> Dict[str, list]:
    """Each row's non-prompt fields as lists, every row repeated `repeat` times."""
    keys = [k for k in rows[0] if k != "prompt"]
    return {k: [r[k] for r in rows for _ in range(repeat)] for k in keys}


def sample_and_score(ctx: Context, rows: List[Row], group_size: int) -> tuple[Rollout, torch.Tensor, Dict[str, float]]:
    """G completions per prompt and the reward of each: (rollout, rewards [N], reward metrics)."""
    cfg = ctx.cfg
    prompt_ids = encode_prompts(ctx.policy.tokenizer, [r["prompt"] for r in rows], cfg.model.chat_template,
                                cfg.model.system_prompt)
    ctx.policy.model.eval()
    start = time.perf_counter()
    with ctx.timed("generate"):
        rollout = generate(ctx.policy.model, ctx.policy.tokenizer, prompt_ids, group_size, cfg.rollout.max_new_tokens,
                           cfg.rollout.temperature, cfg.rollout.top_p, ctx.generator)
    tokens = float(rollout.completion_mask.sum())
    metrics = {"perf/tokens": tokens, "perf/gen_tokens_per_s": tokens / (time.perf_counter() - start)}
    prompts = [r["prompt"] for r in rows for _ in range(group_size)]
    with ctx.timed("reward"):
        rewards, reward_metrics = ctx.rewards(prompts, rollout.texts, columns_of(rows, group_size))
    return rollout, rewards.to(ctx.device), {**metrics, **reward_metrics}


def micro_batches(n: int, size: int | None) -> List[torch.Tensor]:
    idx = torch.arange(n)
    return list(idx.split(size or n))


def micro_batch_weight(aggregation: str, chunk_mask: torch.Tensor, full_mask: torch.Tensor) -> float:
    """Factor that turns a micro-batch's aggregated loss into its share of the full batch's loss,
    so that accumulating over micro-batches gives the same gradient as one pass."""
    if aggregation == "token-mean":
        return float(chunk_mask.sum() / full_mask.sum().clamp(min=1))
    return chunk_mask.shape[0] / full_mask.shape[0]


def optimizer_step(ctx: Context) -> Dict[str, float]:
    """Clip, step and schedule; a non-finite gradient skips the update (three in a row stop the run)."""
    params = ctx.policy.trainable_parameters() + [p for head in ctx.heads.values() for p in head.parameters()]
    max_norm = ctx.cfg.optim.max_grad_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
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


def add_head(ctx: Context, name: str, head: torch.nn.Module) -> torch.nn.Module:
    """Train `head` from now on: into ctx.heads and the optimizer, with the same learning-rate
    schedule (the scheduler is rebuilt, which is exact only before the first step)."""
    ctx.heads[name] = head
    ctx.optimizer.add_param_group({"params": list(head.parameters())})
    o = ctx.cfg.optim
    ctx.scheduler = torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, lr_lambda(o.schedule, o.warmup_steps,
                                                                               ctx.cfg.trainer.steps))
    return head


def penalized_token_rewards(ctx: Context, rollout: Rollout, rewards: torch.Tensor, beta: float,
                            estimator: str) -> tuple[torch.Tensor, float]:
    """Per-token rewards r_t: the outcome R on the last real token, minus beta * KL(pi || pi_ref)
    on every token (InstructGPT), with the mean KL; the reference pass runs only when beta > 0."""
    mask = rollout.completion_mask
    token_rewards = terminal_rewards(rewards, mask)
    if beta <= 0:
        return token_rewards, float("nan")
    n, temperature = rollout.completion_ids.shape[1], ctx.cfg.rollout.temperature
    ids, attn = rollout.input_ids, rollout.attention_mask
    with ctx.timed("reference"):
        ref = torch.cat([ctx.policy.ref_logprobs(ids[i], attn[i], n, temperature)
                         for i in micro_batches(len(rollout), ctx.cfg.trainer.micro_batch_size)])
    kl = kl_penalty(rollout.logprobs, ref, estimator)
    return token_rewards - beta * kl, float(masked_mean(kl, mask))


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N / G] bool: True for the groups whose rewards are not all equal (they carry a GRPO signal)."""
    groups = rewards.view(-1, group_size)
    return groups.max(-1).values != groups.min(-1).values


def rollout_metrics(rollout: Rollout, rewards: torch.Tensor, group_size: int) -> Dict[str, float]:
    mask = rollout.completion_mask
    lengths = mask.sum(-1)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/zero_std_frac": float((~informative_groups(rewards, group_size)).float().mean()),
        "completion/len_mean": float(lengths.mean()),
        "completion/truncated_frac": float(rollout.truncated.float().mean()),
        # Mean -log pi of the sampled tokens: a Monte-Carlo estimate of the policy's entropy.
        "policy/entropy": float(-(rollout.logprobs * mask).sum() / mask.sum().clamp(min=1)),
    }


def finish(ctx: Context, interrupted: bool = False) -> Path:
    """Save the policy (adapter or full model) and close the log."""
    ctx.logger.close()
    out = ctx.run_dir / ("interrupted" if interrupted else "final")
    ctx.policy.save(out)
    for name, head in ctx.heads.items():
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / f"{name}.safetensors"))
    return out


def train(cfg, run_dir: Path, console: Console) -> Dict[str, float]:
    """Run `cfg.algo.name`'s train_step until `trainer.steps` optimizer steps; save the policy.

    Ctrl-C saves the policy to `interrupted/` before leaving.
    """
    from rlnotes.runners import get_runner

    train_step = get_runner(cfg.algo.name)
    ctx = setup(cfg, run_dir, console)
    last: Dict[str, float] = {}
    try:
        while ctx.step < cfg.trainer.steps:
            ctx.timers = {}
            start = time.perf_counter()
            metrics = train_step(ctx)
            seconds = time.perf_counter() - start
            metrics.update(ctx.timers, **{"time/step_s": seconds,
                                          "perf/tokens_per_s": metrics.pop("perf/tokens") / seconds})
            if ctx.step % cfg.trainer.log_every == 0 or ctx.step >= cfg.trainer.steps:
                ctx.logger.log(ctx.step, metrics)
            last = metrics
    except KeyboardInterrupt:
        out = finish(ctx, interrupted=True)
        console.print(f"[yellow]interrupted at step {ctx.step}; policy saved to {out}[/]")
        raise
    except BaseException:
        ctx.logger.close()
        raise
    out = finish(ctx)
    shown = "  ".join(f"{k} {last[k]:.3f}" for k in ("reward/mean", "loss") if last.get(k) is not None)
    console.print(f"done: {ctx.step} steps in {ctx.logger.elapsed():.1f} s, {shown}; policy saved to {out}")
    return last
