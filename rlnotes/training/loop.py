"""Mechanics every runner shares: setup, sampling and scoring a batch, micro-batches, the
optimizer step, and finishing a run. The algorithms themselves live in the runner files.
"""

from __future__ import annotations

import errno
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

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.errors import SaveFailed, TrainingError
from rlnotes.core.schema import preset_name
from rlnotes.data.datasets import load_checked
from rlnotes.data.fitting import fit_and_split, max_positions
from rlnotes.data.sampler import PromptSampler
from rlnotes.data.settings import system_prompt
from rlnotes.data.tasks import Row
from rlnotes.engine import distributed
from rlnotes.engine.models import configure_backends, mixed_precision, resolve_device
from rlnotes.engine.policy import Policy
from rlnotes.engine.rollout import Rollout, completion_keys, encode_prompts, generate
from rlnotes.notes import kl_penalty, masked_mean
from rlnotes.notes.reinforce import terminal_rewards
from rlnotes.notes.tis import truncated_is_weights
from rlnotes.rewards.scoring import Rewards, TrainerState
from rlnotes.run import checkpoint, restore, rundir, signals, steplogs
from rlnotes.run.diagnostics import Settings, Watcher, batch_arithmetic, describe_batches
from rlnotes.run.logger import MetricsLogger, NullLogger, passed_multiple
from rlnotes.run.tracking import open_sinks
from rlnotes.training.evaluation import checker_config, evaluate
from rlnotes.training.evaluation import eval_rows as held_out_rows
from rlnotes.training.evaluation import write as write_eval


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
    # strings and tensors, saved in checkpoints (see rlnotes.run.checkpoint.RECOMPUTED for what is not).
    cache: Dict[str, object] = field(default_factory=dict)
    # An optimizer update has run since the last completed step: a stop now cannot go back to that
    # step's state (see signals.StopSignals); set by optimizer_step, cleared by the train loop.
    updating: bool = False
    # Scores trainer.eval_every evaluations (the task's checker); None when evaluation is off.
    scorer: Optional[Rewards] = None
    # The last sampled batch (prompts, completions, rewards: lists of N) for the samples table.
    samples: Optional[Dict[str, list]] = None
    # The vLLM engine that samples when rollout.engine=vllm (rlnotes.engine.vllm_engine); None: the policy samples.
    engine: Optional[object] = None

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


def setup(cfg, algo: Algorithm, run_dir: Path, console: Console, resume_from: Optional[Path] = None) -> Context:
    """Seeds, device, policy/reference, data, rewards, optimizer and the metrics log. The weights of
    `resume_from` are loaded before FSDP (hardware.strategy=fsdp) shards them."""
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = distributed.init(resolve_device(cfg.hardware.device))
    configure_backends(cfg.hardware, device)
    rewards = Rewards(cfg.reward, console) if algo.samples else None
    with distributed.main_first():  # caches (a converted model, a downloaded dataset) are written once
        # A data mistake fails before the model loads; evaluations that generate sample its prompts too.
        data = load_checked(cfg.data, algo, rewards.fns if rewards else [],
                            "eval.generate" if cfg.trainer.eval_every and cfg.eval.generate else None)
        policy = Policy.from_config(cfg.model, device)
    policy.share_prompts = cfg.trainer.shared_prompt
    if resume_from is not None:
        restore.load_policy(policy, resume_from)
    if distributed.active() and cfg.hardware.strategy == "fsdp":
        shard_policy(policy)
    train_rows, eval_rows = fit_and_split(data, cfg, policy.tokenizer, max_positions(policy.model), console,
                                          samples=algo.samples)
    if cfg.eval.data:
        eval_rows = held_out_rows(cfg, policy.tokenizer, max_positions(policy.model), console)
    params = policy.trainable_parameters()
    distributed.broadcast_parameters(params)  # every rank starts from rank 0's weights
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o.schedule, o.warmup_steps, cfg.trainer.steps))
    run_dir.mkdir(parents=True, exist_ok=True)
    main = distributed.is_main()  # rank 0 writes the run's files; with one process, this process
    if main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    n_params = sum(p.numel() for p in params)
    console.print(f"[bold]rlnotes[/] {preset_name(cfg.algo)} on {cfg.model.name_or_path} "
                  f"({n_params:,} trainable parameters, {'LoRA' if policy.uses_lora else 'full'}) -> {run_dir}")
    if distributed.active():
        world = distributed.world_size()
        console.print(f"{world} processes ({cfg.hardware.strategy}, {distributed.backend()} on {device.type}): each "
                      f"trains on {cfg.trainer.batch_size // world} of the {cfg.trainer.batch_size} "
                      f"{'prompts' if rewards else 'rows'} of a step", highlight=False)
    console.print(describe_batches(batch_arithmetic(cfg.trainer, algo.shape(cfg), len(train_rows))), highlight=False,
                  soft_wrap=True)
    scorer = Rewards(checker_config(cfg), console) if cfg.trainer.eval_every and generates(cfg, algo) else None
    logger = (MetricsLogger.for_run(cfg.logging, cfg.trainer.steps, run_dir, console,
                                    sinks=open_sinks(cfg.logging, run_dir, OmegaConf.to_container(cfg, resolve=True)),
                                    watcher=Watcher(Settings.of(cfg, algo))) if main else NullLogger())
    engine = None
    if rewards is not None and cfg.rollout.engine == "vllm":
        from rlnotes.engine.vllm_engine import VLLMEngine

        engine = VLLMEngine(cfg, policy.tokenizer)
    return Context(cfg=cfg, run_dir=run_dir, device=device, policy=policy, optimizer=optimizer, scheduler=scheduler,
                   sampler=PromptSampler(train_rows, cfg.trainer.batch_size, cfg.seed), eval_rows=eval_rows,
                   rewards=rewards, logger=logger, console=console,
                   generator=torch.Generator(device).manual_seed(cfg.seed), scorer=scorer, engine=engine)


def shard_policy(policy: Policy) -> None:
    """FSDP2 over the policy and, without LoRA, its frozen reference copy (with LoRA the reference
    is the policy itself with the adapter off)."""
    distributed.shard_model(policy.model)
    with policy.reference() as reference:
        if reference is not policy.model:
            distributed.shard_model(reference)


def next_rows(ctx: Context) -> List[Row]:
    """This process's part of the next batch (all of it with one process). Every rank draws the
    same global batch from the same sampler and keeps its own slice, so the data position is one
    state for all ranks and the global batch is trainer.batch_size whatever their number."""
    return distributed.shard(ctx.sampler.next_batch())


def per_prompt_seed(cfg) -> bool:
    """rollout.per_prompt_seed, with null meaning: on when several processes train."""
    on = cfg.rollout.per_prompt_seed
    return distributed.world_size() > 1 if on is None else bool(on)


def sample_and_score(ctx: Context, rows: List[Row], group_size: int,
                     round_: int = 0) -> tuple[Rollout, torch.Tensor, Dict[str, float]]:
    """G completions per prompt and the reward of each: (rollout, rewards [N], reward metrics).
    `rows` are this rank's part of a batch; `round_` numbers the batches sampled within one step
    (DAPO's extra rounds), which with per-prompt seeds keys the draw together with the step."""
    cfg = ctx.cfg
    prompt_ids = encode_prompts(ctx.policy.tokenizer, [r["prompt"] for r in rows], cfg.model.chat_template,
                                system_prompt(cfg))
    keys = None
    if per_prompt_seed(cfg):  # prompt i of rank r is prompt r * len(rows) + i of the global batch
        first = distributed.rank() * len(rows)
        keys = completion_keys(cfg.seed, (ctx.step, round_), torch.arange(first, first + len(rows)), group_size)
    ctx.policy.model.eval()
    start = time.perf_counter()
    with ctx.timed("generate"), distributed.gathered(ctx.policy.model):
        if ctx.engine is not None:
            ctx.engine.sync(ctx.policy, ctx.step)
            seeds = keys[::group_size].tolist() if keys is not None else None
            rollout = ctx.engine.generate(prompt_ids, group_size, seeds, ctx.device)
        else:
            rollout = generate(ctx.policy.model, ctx.policy.tokenizer, prompt_ids, group_size,
                               cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, ctx.generator,
                               keys=keys)
    tokens = float(rollout.completion_mask.sum())
    metrics = {"perf/tokens": tokens, "perf/gen_tokens_per_s": tokens / (time.perf_counter() - start)}
    if rollout.sampler_logprobs is not None:
        metrics.update(trainer_logprobs(ctx, rollout))
    with ctx.timed("reward"):
        ctx.rewards.state = trainer_state(ctx)
        rewards, reward_metrics = ctx.rewards.score_groups(rows, rollout.texts, rollout.token_lists(), group_size)
    ctx.samples = {"prompts": [r["prompt"] for r in rows for _ in range(group_size)],
                   "completions": list(rollout.texts), "rewards": rewards.tolist(), "extra": ctx.rewards.extra}
    # Each rank scored its own completions: failures add up, per-function means average (the ranks
    # score equally many completions), generation speeds add up (the ranks sample side by side).
    ops = {key: "sum" if key == "reward/failures" else "mean" for key in reward_metrics}
    metrics = distributed.reduce_metrics({**metrics, **reward_metrics}, {**ops, "perf/gen_tokens_per_s": "sum"})
    return rollout, rewards.to(ctx.device), metrics


def trainer_state(ctx: Context) -> TrainerState:
    """The `trainer_state` reward functions get: steps taken, trainer.steps, epochs of rows drawn."""
    sampler = ctx.sampler
    return TrainerState(ctx.step, ctx.cfg.trainer.steps, sampler.epoch + sampler.pos / max(len(sampler.rows), 1))


@torch.no_grad()
def trainer_logprobs(ctx: Context, rollout: Rollout) -> Dict[str, float]:
    """Put the trainer's own log-probs of another engine's samples into rollout.logprobs (one
    no-grad pass) and measure how far the sampler's were from them, over the global batch:
    sampler/logprob_vllm and sampler/logprob_trainer (mean per token), sampler/mismatch (mean
    |log pi_trainer - log pi_vllm|) and, with rollout.tis_cap, sampler/tis_clip_frac (tokens whose
    weight was capped)."""
    cfg = ctx.cfg
    ids, attn, n = rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1]
    with ctx.timed("old_logprobs"):
        logprobs = [ctx.policy.logprobs(ids[i], attn[i], n, cfg.rollout.temperature)
                    for i in micro_batches(len(rollout), cfg.trainer.micro_batch_size)]
    mask, mean = rollout.completion_mask, distributed.masked_mean_over_ranks
    rollout.logprobs = torch.cat(logprobs) * mask  # 0 on padding, as sampled log-probs are
    diff = rollout.logprobs - rollout.sampler_logprobs
    metrics = {"sampler/logprob_vllm": float(mean(rollout.sampler_logprobs, mask)),
               "sampler/logprob_trainer": float(mean(rollout.logprobs, mask)),
               "sampler/mismatch": float(mean(diff.abs(), mask))}
    if cfg.rollout.tis_cap is not None:
        metrics["sampler/tis_clip_frac"] = float(mean((diff > math.log(cfg.rollout.tis_cap)).float(), mask))
    return metrics


def tis_weights(ctx: Context, rows: Rollout) -> Optional[torch.Tensor]:
    """rollout.tis_cap's per-token weights min(pi_trainer / pi_sampler, C) [n, T] of `rows`, or None
    (no cap, or the policy sampled them itself)."""
    if ctx.cfg.rollout.tis_cap is None or rows.sampler_logprobs is None:
        return None
    return truncated_is_weights(rows.logprobs, rows.sampler_logprobs, ctx.cfg.rollout.tis_cap)


def micro_batches(n: int, size: int | None) -> List[torch.Tensor]:
    """Index chunks of at most `size` (null: all n at once); none when n is 0 (a rank left without rows)."""
    return list(torch.arange(n).split(size or n)) if n else []


@dataclass(frozen=True)
class Totals:
    """A batch's real tokens and rows summed over every rank: what token means and sequence means
    divide by, so that each rank's loss is its share of the global batch's loss."""
    tokens: float
    rows: float


def batch_totals(mask: torch.Tensor) -> Totals:
    """The Totals of the batch whose part on this rank has completion mask `mask` [N, T]."""
    tokens, rows = distributed.sum_over_ranks([float(mask.sum()), mask.shape[0]])
    return Totals(tokens, rows)


def micro_batch_weight(aggregation: str, chunk_mask: torch.Tensor, totals: Totals) -> float:
    """Factor that turns a micro-batch's aggregated loss into its share of the global batch's loss,
    so that accumulating over micro-batches (and summing over ranks) gives one pass's gradient."""
    if aggregation == "token-mean":
        return float(chunk_mask.sum()) / max(totals.tokens, 1.0)
    return chunk_mask.shape[0] / totals.rows


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


def add_head(ctx: Context, name: str, head: torch.nn.Module) -> torch.nn.Module:
    """Train `head` from now on: into ctx.heads and the optimizer, with the same learning-rate
    schedule (the scheduler is rebuilt, which is exact only before the first step)."""
    ctx.heads[name] = head
    distributed.broadcast_parameters(head.parameters())  # a random init must be the same on every rank
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
    if not distributed.active():
        return token_rewards - beta * kl, float(masked_mean(kl, mask))
    total, count = distributed.sum_over_ranks([float((kl * mask).sum()), float(mask.sum())])
    return token_rewards - beta * kl, total / max(count, 1.0)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N / G] bool: True for the groups whose rewards are not all equal (they carry a GRPO signal)."""
    groups = rewards.view(-1, group_size)
    return groups.max(-1).values != groups.min(-1).values


def rollout_metrics(rollout: Rollout, rewards: torch.Tensor, group_size: int) -> Dict[str, float]:
    """Reward, length and entropy statistics of the global batch (every rank's rows gathered)."""
    mask = rollout.completion_mask
    per_row = torch.stack([rewards.detach().float().cpu(), mask.sum(-1).cpu(), rollout.truncated.float().cpu(),
                           -(rollout.logprobs * mask).sum(-1).cpu()], dim=1)
    rewards, lengths, truncated, neg_logp = distributed.gather_rows(per_row).unbind(1)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/zero_std_frac": float((~informative_groups(rewards, group_size)).float().mean()),
        "completion/len_mean": float(lengths.mean()),
        "completion/truncated_frac": float(truncated.mean()),
        # Mean -log pi of the sampled tokens: a Monte-Carlo estimate of the policy's entropy.
        "policy/entropy": float(neg_logp.sum() / lengths.sum().clamp(min=1)),
    }


def eval_metrics(ctx: Context) -> Dict[str, float]:
    """Evaluate the current policy on the eval split (trainer.eval_every); samples go to eval/step_N.jsonl."""
    # Every rank evaluates the same rows (same numbers, same passes, nothing to wait for); rank 0 writes.
    ctx.scorer.state = trainer_state(ctx)
    with distributed.gathered(ctx.policy.model):
        evaluation = evaluate(ctx.policy, ctx.cfg, ctx.eval_rows, ctx.scorer, ctx.step)
    if distributed.is_main():
        write_eval(evaluation, ctx.run_dir, ctx.step)
    return evaluation.metrics


def eval_due(previous: int, step: int, every: Optional[int], total: int) -> bool:
    """trainer.eval_every: after a step that passed a multiple of N (PPO's steps jump several at a
    time) and after the last; the train loop also evaluates before the first step."""
    return bool(every) and (passed_multiple(previous, step, every) or step == total)


def finish(ctx: Context, interrupted: bool = False) -> Path:
    """Save the policy (adapter or full model) and close the log; rank 0 writes (every rank must
    call this: FSDP gathers the weights first)."""
    ctx.logger.close()
    if ctx.engine is not None:
        ctx.engine.close()
    out = ctx.run_dir / ("interrupted" if interrupted else "final")
    state = distributed.full_state(ctx.policy.model)
    if distributed.is_main():
        checkpoint.save_whole(ctx.policy, ctx.heads, out, state)  # a dir called final/ is a finished run's
    return out


def save_checkpoint(ctx: Context, boundary: checkpoint.Boundary) -> Optional[Path]:
    """checkpoint.save on rank 0, which holds the state of every rank (under FSDP gathered from
    them first: every rank must call this); None on the others. A full disk is one line: the
    failed save left nothing behind and the previous checkpoints are kept."""
    shards = checkpoint.Shards(distributed.full_state(ctx.policy.model), distributed.optimizer_shards(ctx.optimizer),
                               distributed.world_size())
    if not distributed.is_main():
        return None
    try:
        return checkpoint.save(ctx, boundary, ctx.cfg.trainer.keep_last, shards)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        target = checkpoint.checkpoint_dir(ctx.run_dir, boundary.step)
        kept = checkpoint.checkpoints(ctx.run_dir)
        raise SaveFailed(f"no space left on device while saving checkpoint {target.name} to {target.parent}; "
                            + (f"the previous checkpoints are kept (the latest: {kept[-1].name})" if kept else
                               "there is no earlier checkpoint") + ": free space and resume with: "
                            + signals.resume_command(ctx.run_dir)) from None


def start_point(cfg, run_dir: Path, console: Console) -> Optional[Path]:
    """The checkpoint trainer.resume names, with the run's step logs cut back to its step; None to
    start fresh. Runs before any model loads, so a bad path fails at once. Rank 0 decides and
    rewrites the logs; every rank resumes from the checkpoint it names."""
    return distributed.broadcast(_start_point(cfg, run_dir, console) if distributed.is_main() else None)


def _start_point(cfg, run_dir: Path, console: Console) -> Optional[Path]:
    from rich.markup import escape

    rundir.own(run_dir)  # the only process in this dir until train ends (the CLI may have taken it already)
    rundir.check_run_dir(run_dir, cfg.trainer.resume, cfg.trainer.steps)
    notes: List[str] = []
    path = restore.locate(cfg.trainer.resume, run_dir, notes)
    if path is None:
        if cfg.trainer.resume == "auto":
            console.print(f"trainer.resume=auto: no checkpoint in {escape(str(run_dir / checkpoint.CHECKPOINTS))}; "
                          "starting at step 0 (to resume a run, pass its dir: hydra.run.dir=RUN_DIR)", highlight=False)
            notes += steplogs.carry_logs(None, run_dir, -1)  # rows of an attempt that saved nothing
        for note in notes:
            console.print(f"[yellow]{escape(note)}[/]", highlight=False)
        return None
    step = checkpoint.read_manifest(path)["step"]
    changed = restore.check_config(path, cfg)
    notes += steplogs.carry_logs(path.parent.parent, run_dir, step)
    for note in notes:
        console.print(f"[yellow]{escape(note)}[/]", highlight=False)
    dropped = restore.drop_later(run_dir, step)
    console.print(f"resuming from {escape(str(path))} at step {step}"
                  + (f"; later checkpoints dropped: {', '.join(p.name for p in dropped)}" if dropped else ""),
                  highlight=False)
    if changed:
        console.print(f"[yellow]settings differ from the checkpoint's run:[/] {escape('; '.join(changed))}",
                      highlight=False)
    return path


def resume(ctx: Context, path: Path) -> None:
    """Load a checkpoint into a context set up from it (setup loaded the policy's weights): heads
    first (they join the optimizer), then optimizer, scheduler, RNG, data position and runner state."""
    manifest = checkpoint.read_manifest(path)
    for name, head in restore.load_heads(path, manifest, ctx.device).items():
        add_head(ctx, name, head)
    restore.load(ctx, path, manifest)


def _latest_checkpoint(run_dir: Path) -> str:
    from rich.markup import escape

    found = checkpoint.checkpoints(run_dir)
    return f"the latest checkpoint is {escape(str(found[-1]))}" if found else "there is no checkpoint yet"


def stopped(ctx: Context, boundary: checkpoint.Boundary, stop: signals.StopSignals) -> None:
    """After Ctrl-C or SIGTERM: a checkpoint of the last completed step; stopped in the middle of a
    step's updates (a second signal), the policy as it is goes to interrupted/ instead. A save the
    user abandoned (see signals.StopSignals) is not tried again. The caller says how to resume."""
    from rich.markup import escape

    say = lambda text: ctx.console.print(f"[yellow]{text}[/]", soft_wrap=True, highlight=False)  # noqa: E731
    if ctx.updating:
        with stop.saving(f"the policy of step {boundary.step + 1}, stopped in its updates, to interrupted/"):
            out = finish(ctx, interrupted=True)
        say(f"{stop.name} during the updates of the step after {boundary.step}: that policy is in "
            f"{escape(str(out))}, but cannot be resumed; {_latest_checkpoint(ctx.run_dir)}")
        return
    ctx.logger.close()
    if boundary.step == 0:
        say(f"{stop.name} before the first step; nothing saved")
        return
    if not stop.abandoned:
        target = checkpoint.checkpoint_dir(ctx.run_dir, boundary.step)
        try:
            with stop.saving(f"the checkpoint of step {boundary.step} to {target}"):
                path = save_checkpoint(ctx, boundary)
            if path is not None:
                say(f"{stop.name} at step {boundary.step}: checkpoint saved to {escape(str(path))}")
            return
        except KeyboardInterrupt:  # the user abandoned it
            pass
    say(f"{stop.name}: the checkpoint of step {boundary.step} was abandoned; {_latest_checkpoint(ctx.run_dir)}")


def rescue(ctx: Context, boundary: checkpoint.Boundary, error: Exception) -> None:
    """After an error that stops the run (a reward function failing on every sample, non-finite
    losses, a bug): the checkpoint of the last completed step, so that the steps done are not lost,
    when no update has moved the weights since it (else the last saved checkpoint stands). With
    several processes only the failing rank knows, and a save needs them all: nothing is saved."""
    ctx.logger.close()
    if ctx.updating or boundary.step == 0 or distributed.active() or isinstance(error, SaveFailed):
        return
    try:
        path = save_checkpoint(ctx, boundary)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return
    ctx.console.print(f"[yellow]{type(error).__name__} after step {boundary.step}: the checkpoint of that step is "
                      f"in {path}[/]", soft_wrap=True, highlight=False)


def train(cfg, algo: Algorithm, run_dir: Path, console: Console) -> Dict[str, float]:
    """`_train` as the owner of `run_dir` (start_point takes its lock on rank 0; see rundir.own),
    which it gives up when the run ends, however it ends."""
    try:
        return _train(cfg, algo, run_dir, console)
    finally:
        rundir.release(run_dir)


def generates(cfg, algo: Algorithm) -> bool:
    """Whether the run's evaluations generate and score completions (eval.generate; null: when the
    algorithm samples, its own evaluation does)."""
    return algo.samples if cfg.eval.generate is None else bool(cfg.eval.generate)


def held_out(ctx: Context, algo: Algorithm) -> Dict[str, float]:
    """The algorithm's held-out metrics and, with eval.generate, those of generated completions
    (an algorithm that samples evaluates that way itself), timed as time/eval_s."""
    start = time.perf_counter()
    with ctx.precision():
        metrics = algo.evaluate(ctx)
        if not algo.samples and ctx.scorer is not None:
            metrics.update(eval_metrics(ctx))
    return {"time/eval_s": time.perf_counter() - start, **metrics}


def _train(cfg, algo: Algorithm, run_dir: Path, console: Console) -> Dict[str, float]:
    """Run the algorithm's train_step until `trainer.steps` optimizer steps; save the policy.

    A checkpoint every trainer.save_every steps and at the end; trainer.resume starts from one.
    Ctrl-C or SIGTERM saves a checkpoint of the last completed step, then raises
    config.Interrupted (a KeyboardInterrupt; see signals.StopSignals).
    """
    resume_from = start_point(cfg, run_dir, console)
    ctx = setup(cfg, algo, run_dir, console, resume_from)
    if resume_from is not None:
        resume(ctx, resume_from)
    ctx.logger.begin(ctx.step)  # the progress bar, speed and schedules start here
    boundary = checkpoint.capture(ctx)  # the state a stop goes back to: the end of the last logged step
    stop = signals.StopSignals(ctx)
    last: Dict[str, float] = {}
    with stop:
        try:
            if ctx.step == 0 and cfg.trainer.eval_every:
                ctx.logger.log(0, held_out(ctx, algo))  # the starting point of every eval curve
            while ctx.step < cfg.trainer.steps:
                ctx.timers = {}
                start = time.perf_counter()
                with ctx.precision():
                    metrics = algo.train_step(ctx)
                metrics.update(ctx.timers, **{"time/step_s": time.perf_counter() - start})
                # Ranks wait for the slowest; their tokens add up (all else is already the batch's).
                metrics = distributed.reduce_metrics(metrics, {**{k: "max" for k in metrics if k.startswith("time/")},
                                                               "perf/tokens": "sum"})
                metrics["perf/tokens_per_s"] = metrics.pop("perf/tokens") / metrics["time/step_s"]
                if eval_due(boundary.step, ctx.step, cfg.trainer.eval_every, cfg.trainer.steps):
                    metrics.update(held_out(ctx, algo))  # after time/step_s: the step's time excludes it
                ctx.logger.observe(ctx.step, metrics, ctx.samples)  # progress, warnings, samples table
                if (ctx.step % cfg.trainer.log_every == 0 or ctx.step >= cfg.trainer.steps
                        or any(key.startswith("eval/") for key in metrics)):
                    ctx.logger.log(ctx.step, metrics)
                last = metrics
                previous, boundary, ctx.updating = boundary.step, checkpoint.capture(ctx), False
                if passed_multiple(previous, ctx.step, cfg.trainer.save_every):
                    with stop.saving(f"the checkpoint of step {ctx.step}"):
                        save_checkpoint(ctx, boundary)
                stop.check()
            with stop.saving(f"the checkpoint of step {ctx.step}"):
                save_checkpoint(ctx, boundary)
        except KeyboardInterrupt:
            stopped(ctx, boundary, stop)
            raise
        except Exception as error:
            rescue(ctx, boundary, error)
            raise
        except BaseException:
            ctx.logger.close()
            raise
    out = finish(ctx)
    ctx.logger.summary(out)
    return last
