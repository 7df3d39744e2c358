"""A run's setup: seeds, device, policy and reference, data, rewards, optimizer and schedule, made
into the parts of a Context (rlnotes.training.context); and what it prints about the run.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf, open_dict
from rich.console import Console

from rlnotes.agents.multi_turn import MultiTurn
from rlnotes.core.algorithm import Algorithm
from rlnotes.core.schema import preset_name
from rlnotes.data.datasets import load_checked, require_demonstrations
from rlnotes.data.fitting import fit_and_split
from rlnotes.data.sampler import PromptSampler
from rlnotes.data.settings import prompt_format
from rlnotes.engine.hardware import distributed, fsdp
from rlnotes.engine.hardware.devices import choose_precision, configure_backends, resolve_device
from rlnotes.engine.hardware.beside import spare_core
from rlnotes.engine.hardware.threads import set_threads
from rlnotes.engine.model.loading import context_length
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.sampling import vllm_engine
from rlnotes.engine.sampling.generate import stop_ids
from rlnotes.engine.sampling.settings import SamplingSettings
from rlnotes.rewards.scoring import Rewards
from rlnotes.run import restore
from rlnotes.run.diagnostics import Settings, Watcher, batch_arithmetic, describe_batches
from rlnotes.run.logger import MetricsLogger, NullLogger
from rlnotes.run.tracking import open_sinks
from rlnotes.training.context import Batching, Context, Data, Model, Output, Rollouts, Run
from rlnotes.training.evaluation import checker_config
from rlnotes.training.evaluation import eval_rows as held_out_rows
from rlnotes.training.optimizer import adamw, schedule


# The start line's word for model.spare_core.
SPARE = "the reference pass beside the policy's, on a second core"


def setup(cfg, algo: Algorithm, run_dir: Path, console: Console, resume_from: Optional[Path] = None) -> Context:
    """Seeds, device, policy/reference, data, rewards and optimizer; writes nothing (the run's files
    are opened by the train loop once a resumed checkpoint is known to fit: the logger is a NullLogger
    until then). The weights of `resume_from` are loaded before FSDP (hardware.strategy=fsdp) shards them."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = distributed.init(resolve_device(cfg.hardware.device))
    configure_backends(cfg.hardware, device)
    rewards = Rewards(cfg.reward, console) if algo.samples else None
    multi_turn = MultiTurn.of(cfg.rollout, scored=cfg.reward.name == "env")  # loaded (or failed) before the model
    with distributed.main_first():  # caches (a converted model, a downloaded dataset) are written once
        # A data mistake fails before the model loads; evaluations that generate sample its prompts too.
        data = load_checked(cfg.data, algo, rewards.fns if rewards else [],
                            "eval.generate" if cfg.trainer.eval_every and cfg.eval.generate else None,
                            multi_turn.names if multi_turn else ())
        warm_cfg, warm = warmup_data(cfg, data) if cfg.sft_warmup.steps else (None, None)
        policy = Policy.from_config(cfg.model, device, share_prompts=cfg.trainer.shared_prompt)
    threads = set_threads(cfg.hardware.threads, policy.model)
    spare = spare_core(cfg.hardware.threads, policy.model, distributed.world_size(), device)
    precision, said = set_precision(cfg.hardware, device, policy)
    if resume_from is not None:
        restore.load_policy(policy, resume_from)
    if distributed.active() and cfg.hardware.strategy == "fsdp":
        shard_policy(policy)
    train_rows, eval_rows = fit_and_split(data, cfg, policy.tokenizer, context_length(policy.model), console,
                                          samples=algo.samples)
    if cfg.eval.data:
        eval_rows = held_out_rows(cfg, policy.tokenizer, context_length(policy.model), console)
    warm_rows = warmup_rows(warm_cfg, warm, policy.tokenizer, context_length(policy.model), console)
    params = policy.trainable_parameters()
    distributed.broadcast_parameters(params)  # every rank starts from rank 0's weights
    optimizer = adamw(params, cfg.optim)
    lr_factor = schedule(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    n_params = sum(p.numel() for p in params)
    console.print(f"[bold]rlnotes[/] {preset_name(cfg.algo)} on {cfg.model.name_or_path} "
                  f"({n_params:,} trainable parameters, {'LoRA' if policy.uses_lora else 'full'}"
                  f"{''.join('; ' + s for s in (threads, spare and SPARE, said) if s)}) -> {run_dir}")
    if distributed.active():
        world = distributed.world_size()
        console.print(f"{world} processes ({cfg.hardware.strategy}, {distributed.backend()} on {device.type}): each "
                      f"trains on {cfg.trainer.batch_size // world} of the {cfg.trainer.batch_size} "
                      f"{'prompts' if rewards else 'rows'} of a step", highlight=False)
    describe_steps(cfg, algo, len(train_rows), console)
    scorer = Rewards(checker_config(cfg), console) if cfg.trainer.eval_every and generates(cfg, algo) else None
    sampler_engine = rewards is not None and cfg.rollout.engine == "vllm"  # else the policy samples itself
    stops = stop_ids(policy.model, policy.tokenizer)
    engine = vllm_engine.VLLMEngine(cfg, policy.tokenizer, stops) if sampler_engine else None
    r = cfg.rollout
    per_prompt_seed = distributed.world_size() > 1 if r.per_prompt_seed is None else bool(r.per_prompt_seed)
    return Context(
        cfg=cfg,
        run=Run(cfg.seed, cfg.trainer.steps, torch.Generator(device).manual_seed(cfg.seed)),
        model=Model(policy, prompt_format(cfg), device, precision, Batching.of(cfg.trainer), optimizer, scheduler,
                    cfg.optim.lr, lr_factor, cfg.optim.max_grad_norm, spare_core=spare),
        data=Data(PromptSampler(train_rows, cfg.trainer.batch_size, cfg.seed), eval_rows, rewards, scorer,
                  restore.rows_sha256(train_rows), warm_rows),
        rollouts=Rollouts(SamplingSettings.of(r), per_prompt_seed, r.merge_adapter, r.pack_weights, r.tis_cap,
                          engine, multi_turn),
        out=Output(run_dir, NullLogger(), console))


def warmup_config(cfg):
    """The run's config with the SFT warm-up's data: `data` with sft_warmup.data merged over it."""
    other = cfg.copy()
    with open_dict(other):
        other.data = OmegaConf.merge(cfg.data, cfg.sft_warmup.data)
    return other


def warmup_data(cfg, data):
    """(the config of the SFT warm-up's own rows, its demonstrations), checked before the model loads:
    (None, the run's rows `data`), or with sft_warmup.data (warmup_config, the train rows of its data
    section), which the warm-up then learns from instead."""
    w = cfg.sft_warmup
    warm_cfg = warmup_config(cfg) if w.data else None
    if warm_cfg is not None:
        data = load_checked(warm_cfg.data, None)
    require_demonstrations(data.train, w.column, f"sft_warmup.steps={w.steps}")
    return warm_cfg, data


def warmup_rows(warm_cfg, warm, tokenizer, limit: Optional[int], console: Console) -> Optional[list]:
    """The rows of sft_warmup.data's demonstrations (`warm`, from warmup_data, under the config
    `warm_cfg`), fitted to the model as the train rows are; None when the warm-up learns from the
    train rows or there is none (no warm_cfg)."""
    if warm_cfg is None:
        return None
    return fit_and_split(warm, warm_cfg, tokenizer, limit, console, evaluating=False, training=False,
                         label="sft_warmup.data")[0]


def set_precision(hardware, device: torch.device, policy: Policy) -> tuple[str, str]:
    """hardware.precision for this device and model (devices.choose_precision): fp32 or bf16, and what the
    start line says of it. In bf16 the frozen linear weights are stored in bf16, except under FSDP, whose
    shards keep one dtype (there autocast rounds them each pass)."""
    precision, said = choose_precision(hardware.precision, device, sum(p.numel() for p in policy.model.parameters()))
    if precision == "bf16" and not (distributed.active() and hardware.strategy == "fsdp"):
        policy.store_frozen_in_bf16()
    return precision, said


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
        rows = f" of data + sft_warmup.data {OmegaConf.to_container(w.data)}" if w.data else ""
        console.print(f"sft_warmup: first {w.steps} supervised steps on the demonstrations in column {w.column!r}{rows} "
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


def generates(cfg, algo: Algorithm) -> bool:
    """Whether the run's evaluations generate and score completions (eval.generate; null: when the
    algorithm samples, its own evaluation does)."""
    return algo.samples if cfg.eval.generate is None else bool(cfg.eval.generate)
