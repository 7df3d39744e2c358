"""A run's state and its setup: seeds, device, policy and reference, data, rewards, optimizer,
schedule and the metrics log, in one Context that the train loop and the runners share.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from omegaconf import OmegaConf
from rich.console import Console

from rlnotes.agents.conversation import Agents
from rlnotes.core.algorithm import Algorithm
from rlnotes.core.schema import preset_name
from rlnotes.data.datasets import load_checked, require_demonstrations
from rlnotes.data.fitting import fit_and_split
from rlnotes.data.sampler import PromptSampler
from rlnotes.data.tasks import Row
from rlnotes.engine.hardware import distributed, fsdp
from rlnotes.engine.hardware.devices import configure_backends, mixed_precision, resolve_device
from rlnotes.engine.hardware.threads import set_threads
from rlnotes.engine.model.loading import context_length
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.sampling import vllm_engine
from rlnotes.rewards.scoring import Rewards
from rlnotes.run import restore
from rlnotes.run.diagnostics import (
    Settings,
    Watcher,
    batch_arithmetic,
    describe_batches,
)
from rlnotes.run.logger import MetricsLogger, NullLogger
from rlnotes.run.tracking import open_sinks
from rlnotes.training.evaluation import checker_config
from rlnotes.training.evaluation import eval_rows as held_out_rows


@dataclass
class Context:
    """What the train loop and a runner's steps share: the run's settings, policy, optimizer, data,
    rewards and log, and the state kept from one step to the next."""
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
    # strings and tensors, saved in checkpoints (see rlnotes.run.checkpoint.RECOMPUTED for what is not).
    cache: Dict[str, object] = field(default_factory=dict)
    # An optimizer update has run since the last completed step: a stop now cannot go back to that
    # step's state (see signals.StopSignals); set by optimizer_step, cleared by the train loop.
    updating: bool = False
    # Scores trainer.eval_every evaluations (the task's checker); None when evaluation is off.
    scorer: Optional[Rewards] = None
    # The last sampled batch (prompts, completions, rewards: lists of N) for the samples table.
    samples: Optional[Dict[str, list]] = None
    # The vLLM engine that samples when rollout.engine=vllm (rlnotes.engine.sampling.vllm_engine); None: the policy samples.
    engine: Optional[object] = None
    # Multi-turn settings, tools and environment (rollout.tools / rollout.env); None: one turn.
    agents: Optional[Agents] = None
    # The SFT warm-up's order over the train rows (training.warmup), made on its first step.
    warmup_sampler: Optional[PromptSampler] = None
    # The sha256 of the train rows in order (restore.rows_sha256), kept in each checkpoint: a resume on
    # other rows is refused.
    rows_sha256: Optional[str] = None

    def precision(self):
        """The forward passes' precision context (hardware.precision): bf16 autocast or nothing."""
        return mixed_precision(self.cfg.hardware.precision, self.device)

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


def schedule(cfg):
    """The learning-rate factor of each optimizer step: optim.schedule over the steps after the SFT
    warm-up (whose steps set their own rate, sft_warmup.lr), as if the run began after it."""
    o, start = cfg.optim, cfg.sft_warmup.steps
    factor = lr_lambda(o.schedule, o.warmup_steps, cfg.trainer.steps - start)
    return lambda step: factor(max(step - start, 0))


def setup(cfg, algo: Algorithm, run_dir: Path, console: Console, resume_from: Optional[Path] = None) -> Context:
    """Seeds, device, policy/reference, data, rewards and optimizer; writes nothing (the run's files
    are opened by the train loop once a resumed checkpoint is known to fit: ctx.logger is a NullLogger
    until then). The weights of `resume_from` are loaded before FSDP (hardware.strategy=fsdp) shards them."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = distributed.init(resolve_device(cfg.hardware.device))
    configure_backends(cfg.hardware, device)
    rewards = Rewards(cfg.reward, console) if algo.samples else None
    agents = Agents.of(cfg.rollout)  # a user's tools and environment load (or fail) before the model does
    with distributed.main_first():  # caches (a converted model, a downloaded dataset) are written once
        # A data mistake fails before the model loads; evaluations that generate sample its prompts too.
        data = load_checked(cfg.data, algo, rewards.fns if rewards else [],
                            "eval.generate" if cfg.trainer.eval_every and cfg.eval.generate else None)
        if cfg.sft_warmup.steps:
            require_demonstrations(data.train, cfg.sft_warmup.column, f"sft_warmup.steps={cfg.sft_warmup.steps}")
        policy = Policy.from_config(cfg.model, device, share_prompts=cfg.trainer.shared_prompt)
    threads = set_threads(cfg.hardware.threads, policy.model)
    if resume_from is not None:
        restore.load_policy(policy, resume_from)
    if distributed.active() and cfg.hardware.strategy == "fsdp":
        shard_policy(policy)
    train_rows, eval_rows = fit_and_split(data, cfg, policy.tokenizer, context_length(policy.model), console,
                                          samples=algo.samples)
    if cfg.eval.data:
        eval_rows = held_out_rows(cfg, policy.tokenizer, context_length(policy.model), console)
    params = policy.trainable_parameters()
    distributed.broadcast_parameters(params)  # every rank starts from rank 0's weights
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg))
    n_params = sum(p.numel() for p in params)
    console.print(f"[bold]rlnotes[/] {preset_name(cfg.algo)} on {cfg.model.name_or_path} "
                  f"({n_params:,} trainable parameters, {'LoRA' if policy.uses_lora else 'full'}"
                  f"{'; ' + threads if threads else ''}) -> {run_dir}")
    if distributed.active():
        world = distributed.world_size()
        console.print(f"{world} processes ({cfg.hardware.strategy}, {distributed.backend()} on {device.type}): each "
                      f"trains on {cfg.trainer.batch_size // world} of the {cfg.trainer.batch_size} "
                      f"{'prompts' if rewards else 'rows'} of a step", highlight=False)
    describe_steps(cfg, algo, len(train_rows), console)
    scorer = Rewards(checker_config(cfg), console) if cfg.trainer.eval_every and generates(cfg, algo) else None
    sampler_engine = rewards is not None and cfg.rollout.engine == "vllm"  # else the policy samples itself
    engine = vllm_engine.VLLMEngine(cfg, policy.tokenizer) if sampler_engine else None
    return Context(cfg=cfg, run_dir=run_dir, device=device, policy=policy, optimizer=optimizer, scheduler=scheduler,
                   sampler=PromptSampler(train_rows, cfg.trainer.batch_size, cfg.seed), eval_rows=eval_rows,
                   rewards=rewards, logger=NullLogger(), console=console, rows_sha256=restore.rows_sha256(train_rows),
                   generator=torch.Generator(device).manual_seed(cfg.seed), scorer=scorer, engine=engine,
                   agents=agents)


def open_logger(cfg, algo: Algorithm, run_dir: Path, console: Console) -> MetricsLogger:
    """The run's metrics log (metrics.jsonl, the console, the trackers' sinks), opened once the run
    may write its dir (rank 0 only: the others keep setup's NullLogger)."""
    sinks = open_sinks(cfg.logging, run_dir, OmegaConf.to_container(cfg, resolve=True))
    return MetricsLogger.for_run(cfg.logging, cfg.trainer.steps, run_dir, console, sinks=sinks,
                                 watcher=Watcher(Settings.of(cfg, algo)))


def describe_steps(cfg, algo: Algorithm, train_rows: int, console: Console) -> None:
    """The run's batch arithmetic (rlnotes.run.diagnostics) and what an SFT warm-up adds, in a line each."""
    w = cfg.sft_warmup
    console.print(describe_batches(batch_arithmetic(cfg.trainer, algo.shape(cfg), train_rows,
                                                    cfg.trainer.steps - w.steps)), highlight=False, soft_wrap=True)
    if w.steps:
        console.print(f"sft_warmup: first {w.steps} supervised steps on the demonstrations in column {w.column!r} "
                      f"({w.batch_size} rows a step, lr {w.lr:g}), then the {cfg.trainer.steps - w.steps} of "
                      f"algo={cfg.algo.name} above: trainer.steps={cfg.trainer.steps} in all",
                      highlight=False, soft_wrap=True)


def shard_policy(policy: Policy) -> None:
    """FSDP2 over the policy and, without LoRA, its frozen reference copy (with LoRA the reference
    is the policy itself with the adapter off)."""
    fsdp.shard_model(policy.model)
    with policy.reference() as reference:
        if reference is not policy.model:
            fsdp.shard_model(reference)


def add_head(ctx: Context, name: str, head: torch.nn.Module) -> torch.nn.Module:
    """Train `head` from now on: into ctx.heads and the optimizer, with the same learning-rate
    schedule (the scheduler is rebuilt at the step the run has reached, e.g. after an SFT warm-up)."""
    ctx.heads[name] = head
    distributed.broadcast_parameters(head.parameters())  # a random init must be the same on every rank
    ctx.optimizer.add_param_group({"params": list(head.parameters()), "initial_lr": ctx.cfg.optim.lr})
    ctx.scheduler = torch.optim.lr_scheduler.LambdaLR(ctx.optimizer, schedule(ctx.cfg), last_epoch=ctx.step - 1)
    return head


def generates(cfg, algo: Algorithm) -> bool:
    """Whether the run's evaluations generate and score completions (eval.generate; null: when the
    algorithm samples, its own evaluation does)."""
    return algo.samples if cfg.eval.generate is None else bool(cfg.eval.generate)
