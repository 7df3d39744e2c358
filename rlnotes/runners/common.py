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

from rlnotes import checkpoint
from rlnotes.data import PromptSampler, Row, system_prompt
from rlnotes.datasets import fit_and_split, load_checked, max_positions
from rlnotes.evaluate import checker_config, evaluate
from rlnotes.evaluate import eval_rows as held_out_rows
from rlnotes.evaluate import write as write_eval
from rlnotes.diagnostics import batch_arithmetic, describe_batches
from rlnotes.logger import MetricsLogger
from rlnotes.tracking import open_sinks
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
    # A runner's own state kept across steps (e.g. REINFORCE's running-mean baseline): plain numbers,
    # strings and tensors, saved in checkpoints (see rlnotes.checkpoint.RECOMPUTED for what is not).
    cache: Dict[str, object] = field(default_factory=dict)
    # An optimizer update has run since the last completed step: a stop now cannot go back to that
    # step's state (see checkpoint.StopSignals); set by optimizer_step, cleared by the train loop.
    updating: bool = False
    # Scores trainer.eval_every evaluations (the task's checker); None when evaluation is off.
    scorer: Optional[Rewards] = None
    # The last sampled batch (prompts, completions, rewards: lists of N) for the samples table.
    samples: Optional[Dict[str, list]] = None

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
    data = load_checked(cfg, rewards.fns if rewards else [])  # a data mistake fails before the model loads
    policy = Policy.from_config(cfg.model, device)
    train_rows, eval_rows = fit_and_split(data, cfg, policy.tokenizer, max_positions(policy.model), console)
    if cfg.eval.data:
        eval_rows = held_out_rows(cfg, policy.tokenizer, max_positions(policy.model), console)
    params = policy.trainable_parameters()
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o.schedule, o.warmup_steps, cfg.trainer.steps))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    n_params = sum(p.numel() for p in params)
    console.print(f"[bold]rlnotes[/] {cfg.algo.name} on {cfg.model.name_or_path} "
                  f"({n_params:,} trainable parameters, {'LoRA' if policy.uses_lora else 'full'}) -> {run_dir}")
    console.print(describe_batches(batch_arithmetic(cfg, len(train_rows))), highlight=False, soft_wrap=True)
    scorer = Rewards(checker_config(cfg), console) if cfg.trainer.eval_every else None
    return Context(cfg=cfg, run_dir=run_dir, device=device, policy=policy, optimizer=optimizer, scheduler=scheduler,
                   sampler=PromptSampler(train_rows, cfg.trainer.batch_size, cfg.seed), eval_rows=eval_rows,
                   rewards=rewards, logger=MetricsLogger.for_run(cfg, run_dir, console, sinks=open_sinks(cfg, run_dir)),
                   console=console, generator=torch.Generator(device).manual_seed(cfg.seed), scorer=scorer)


def columns_of(rows: List[Row], repeat: int) -> Dict[str, list]:
    """Each row's non-prompt fields as lists, every row repeated `repeat` times."""
    keys = [k for k in rows[0] if k != "prompt"]
    return {k: [r[k] for r in rows for _ in range(repeat)] for k in keys}


def sample_and_score(ctx: Context, rows: List[Row], group_size: int) -> tuple[Rollout, torch.Tensor, Dict[str, float]]:
    """G completions per prompt and the reward of each: (rollout, rewards [N], reward metrics)."""
    cfg = ctx.cfg
    prompt_ids = encode_prompts(ctx.policy.tokenizer, [r["prompt"] for r in rows], cfg.model.chat_template,
                                system_prompt(cfg))
    ctx.policy.model.eval()
    start = time.perf_counter()
    with ctx.timed("generate"):
        rollout = generate(ctx.policy.model, ctx.policy.tokenizer, prompt_ids, group_size, cfg.rollout.max_new_tokens,
                           cfg.rollout.temperature, cfg.rollout.top_p, ctx.generator)
    tokens = float(rollout.completion_mask.sum())
    metrics = {"perf/tokens": tokens, "perf/gen_tokens_per_s": tokens / (time.perf_counter() - start)}
    prompts = [r["prompt"] for r in rows for _ in range(group_size)]
    with ctx.timed("reward"):
        ids = [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]
        rewards, reward_metrics = ctx.rewards(prompts, rollout.texts, columns_of(rows, group_size), completion_ids=ids)
    ctx.samples = {"prompts": prompts, "completions": list(rollout.texts), "rewards": rewards.tolist()}
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
    ctx.updating = True
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


def eval_metrics(ctx: Context) -> Dict[str, float]:
    """Evaluate the current policy on the eval split (trainer.eval_every); samples go to eval/step_N.jsonl."""
    start = time.perf_counter()
    evaluation = evaluate(ctx.policy, ctx.cfg, ctx.eval_rows, ctx.scorer, ctx.step)
    write_eval(evaluation, ctx.run_dir, ctx.step)
    return {**evaluation.metrics, "time/eval_s": time.perf_counter() - start}


def eval_due(step: int, every: Optional[int], total: int) -> bool:
    """trainer.eval_every: before the first step, every N steps and after the last."""
    return bool(every) and (step % every == 0 or step == total)


def finish(ctx: Context, interrupted: bool = False) -> Path:
    """Save the policy (adapter or full model) and close the log."""
    ctx.logger.close()
    out = ctx.run_dir / ("interrupted" if interrupted else "final")
    ctx.policy.save(out)
    for name, head in ctx.heads.items():
        save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / f"{name}.safetensors"))
    return out


def start_point(cfg, run_dir: Path, console: Console) -> Optional[Path]:
    """The checkpoint trainer.resume names, with the run's step logs cut back to its step; None to
    start fresh. Runs before any model loads, so a bad path fails at once."""
    from rich.markup import escape

    path = checkpoint.locate(cfg.trainer.resume, run_dir)
    if path is None:
        if cfg.trainer.resume == "auto":
            console.print(f"trainer.resume=auto: no checkpoint in {escape(str(run_dir / checkpoint.CHECKPOINTS))}; "
                          "starting at step 0 (to resume a run, pass its dir: hydra.run.dir=RUN_DIR)", highlight=False)
            checkpoint.carry_logs(None, run_dir, -1)  # rows of an attempt that saved nothing
        return None
    step = checkpoint.read_manifest(path)["step"]
    changed = checkpoint.check_config(path, cfg)
    checkpoint.carry_logs(path.parent.parent, run_dir, step)
    dropped = checkpoint.drop_later(run_dir, step)
    console.print(f"resuming from {escape(str(path))} at step {step}"
                  + (f"; later checkpoints dropped: {', '.join(p.name for p in dropped)}" if dropped else ""),
                  highlight=False)
    if changed:
        console.print(f"[yellow]settings differ from the checkpoint's run:[/] {escape('; '.join(changed))}",
                      highlight=False)
    return path


def resume(ctx: Context, path: Path) -> None:
    """Load a checkpoint into a freshly set-up context: heads first (they join the optimizer),
    then weights, optimizer, scheduler, RNG, data position and runner state."""
    manifest = checkpoint.read_manifest(path)
    for name, head in checkpoint.load_heads(path, manifest, ctx.device).items():
        add_head(ctx, name, head)
    checkpoint.load(ctx, path, manifest)


def stopped(ctx: Context, boundary: checkpoint.Boundary, cause: str) -> None:
    """After Ctrl-C or SIGTERM: a checkpoint of the last completed step; stopped in the middle of a
    step's updates (a second signal), the policy as it is goes to interrupted/ instead."""
    from rich.markup import escape

    hint = escape(checkpoint.resume_command(ctx.run_dir))
    if ctx.updating:
        out = finish(ctx, interrupted=True)
        latest = checkpoint.checkpoints(ctx.run_dir)
        ctx.console.print(f"[yellow]{cause} during the updates of the step after {boundary.step}: that policy is in "
                          f"{escape(str(out))}, but cannot be resumed; "
                          + (f"the latest checkpoint is {escape(str(latest[-1]))}; resume with:[/]\n  {hint}" if latest
                             else "there is no checkpoint to resume from[/]"), soft_wrap=True, highlight=False)
        return
    ctx.logger.close()
    if boundary.step == 0:
        ctx.console.print(f"[yellow]{cause} before the first step; nothing saved[/]")
        return
    path = checkpoint.save(ctx, boundary, ctx.cfg.trainer.keep_last)
    ctx.console.print(f"[yellow]{cause} at step {boundary.step}: checkpoint saved to {escape(str(path))}; resume "
                      f"with:[/]\n  {hint}", soft_wrap=True, highlight=False)


def train(cfg, run_dir: Path, console: Console) -> Dict[str, float]:
    """Run `cfg.algo.name`'s train_step until `trainer.steps` optimizer steps; save the policy.

    A checkpoint every trainer.save_every steps and at the end; trainer.resume starts from one.
    Ctrl-C or SIGTERM saves a checkpoint of the last completed step, then raises KeyboardInterrupt.
    """
    from rlnotes.runners import get_runner

    train_step = get_runner(cfg.algo.name)
    resume_from = start_point(cfg, run_dir, console)
    ctx = setup(cfg, run_dir, console)
    if resume_from is not None:
        resume(ctx, resume_from)
    ctx.logger.begin(ctx.step)  # the progress bar, speed and schedules start here
    boundary = checkpoint.capture(ctx)  # the state a stop goes back to: the end of the last logged step
    stop = checkpoint.StopSignals(ctx)
    last: Dict[str, float] = {}
    try:
        with stop:
            if ctx.step == 0 and eval_due(0, cfg.trainer.eval_every, cfg.trainer.steps):
                ctx.logger.log(0, eval_metrics(ctx))  # the starting point of every eval curve
            while ctx.step < cfg.trainer.steps:
                ctx.timers = {}
                start = time.perf_counter()
                metrics = train_step(ctx)
                seconds = time.perf_counter() - start
                metrics.update(ctx.timers, **{"time/step_s": seconds,
                                              "perf/tokens_per_s": metrics.pop("perf/tokens") / seconds})
                if eval_due(ctx.step, cfg.trainer.eval_every, cfg.trainer.steps):
                    metrics.update(eval_metrics(ctx))  # after time/step_s: the step's time excludes evaluation
                ctx.logger.observe(ctx.step, metrics, ctx.samples)  # progress, warnings, samples table
                if (ctx.step % cfg.trainer.log_every == 0 or ctx.step >= cfg.trainer.steps
                        or "eval/accuracy" in metrics):
                    ctx.logger.log(ctx.step, metrics)
                last = metrics
                previous, boundary, ctx.updating = boundary.step, checkpoint.capture(ctx), False
                if checkpoint.due(previous, ctx.step, cfg.trainer.save_every):
                    checkpoint.save(ctx, boundary, cfg.trainer.keep_last)
                stop.check()
            checkpoint.save(ctx, boundary, cfg.trainer.keep_last)
    except KeyboardInterrupt:
        stopped(ctx, boundary, stop.name)
        raise
    except BaseException:
        ctx.logger.close()
        raise
    out = finish(ctx)
    ctx.logger.summary(out)
    return last
