"""Sampling and scoring a batch: this rank's prompts, G completions each (the policy or vLLM
samples), their rewards, the trainer's log-probs of another engine's samples, the reference
pass of a KL penalty, and the batch's reward and length statistics.
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

import torch

from rlnotes.agents.conversation import Conversations
from rlnotes.agents.rollouts import run_episodes, score_episodes
from rlnotes.data.settings import prompt_format
from rlnotes.data.tasks import Row
from rlnotes.engine.hardware import distributed, fsdp
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.generate import completion_keys, generate
from rlnotes.engine.sampling.settings import SamplingSettings
from rlnotes.notes import informative_groups, kl_penalty
from rlnotes.notes.reinforce import kl_penalized_rewards, terminal_rewards
from rlnotes.notes.tis import truncated_is_weights
from rlnotes.rewards.scoring import TrainerState
from rlnotes.training.batching import rollout_micro_batches
from rlnotes.training.context import Context
from rlnotes.training.evaluation import evaluate
from rlnotes.training.evaluation import write as write_eval


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
    """G completions per prompt (multi-turn: G episodes, rollout.tools / rollout.env) and the reward
    of each: (rollout, rewards [N], reward metrics). `rows` are this rank's part of a batch; `round_`
    numbers the batches sampled within one step (DAPO's extra rounds), which with per-prompt seeds
    keys the draw together with the step."""
    keys = None
    if per_prompt_seed(ctx.cfg):  # prompt i of rank r is prompt r * len(rows) + i of the global batch
        first = distributed.rank() * len(rows)
        keys = completion_keys(ctx.cfg.seed, (ctx.step, round_), torch.arange(first, first + len(rows)), group_size)
    ctx.policy.eval()
    start = time.perf_counter()
    with ctx.timed("generate"), fsdp.gathered(ctx.policy.model):
        rollout, conversations = sample(ctx, rows, group_size, keys)
    tokens = float(rollout.completion_mask.sum())
    metrics = {"perf/tokens": tokens, "perf/gen_tokens_per_s": tokens / (time.perf_counter() - start)}
    if rollout.sampler_logprobs is not None:
        metrics.update(trainer_logprobs(ctx, rollout))
    with ctx.timed("reward"):
        ctx.rewards.state = trainer_state(ctx)
        if conversations is not None:  # whole episodes, and the environment's reward
            rewards, reward_metrics = score_episodes(ctx.rewards, rows, conversations, rollout, group_size)
        else:
            rewards, reward_metrics = ctx.rewards.score_groups(rows, rollout.texts, rollout.token_lists(), group_size)
    # An episode's prompt as the model saw it: with what reset added and the tools' descriptions.
    prompts = conversations.prompts() if conversations is not None else \
        [r["prompt"] for r in rows for _ in range(group_size)]
    ctx.samples = {"prompts": prompts, "completions": list(rollout.texts), "rewards": rewards.tolist(),
                   "extra": ctx.rewards.extra}
    # Each rank scored its own completions: failures add up, per-function means average (the ranks
    # score equally many completions), generation speeds add up (the ranks sample side by side).
    ops = {key: "sum" if key == "reward/failures" else "mean" for key in reward_metrics}
    metrics = distributed.reduce_metrics({**metrics, **reward_metrics}, {**ops, "perf/gen_tokens_per_s": "sum"})
    return rollout, rewards.to(ctx.device), metrics


def sample(ctx: Context, rows: List[Row], group_size: int,
           keys: Optional[torch.Tensor]) -> tuple[Rollout, Optional[Conversations]]:
    """The batch's completions, sampled by the policy or the vLLM engine: one per sample, or with
    rollout.tools / rollout.env whole episodes (then with their conversations; else None)."""
    cfg = ctx.cfg
    sampling = SamplingSettings.of(cfg.rollout)
    if ctx.engine is not None:
        ctx.engine.sync(ctx.policy, ctx.step)
    if ctx.agents is not None:
        with ctx.policy.sampling(cfg.rollout.merge_adapter and ctx.engine is None,
                                 cfg.rollout.pack_weights and ctx.engine is None) as model:
            conversations, rollout = run_episodes(ctx.agents, model, ctx.policy.tokenizer, rows, group_size,
                                                  sampling, prompt_format(cfg), ctx.generator, keys,
                                                  engine=ctx.engine)
        return rollout, conversations
    prompt_ids = prompt_format(cfg).encode(ctx.policy.tokenizer, [r["prompt"] for r in rows])
    if ctx.engine is not None:
        seeds = keys[::group_size].tolist() if keys is not None else None
        return ctx.engine.generate(prompt_ids, group_size, seeds, ctx.device), None
    with ctx.policy.sampling(cfg.rollout.merge_adapter, cfg.rollout.pack_weights) as model:
        return generate(model, ctx.policy.tokenizer, prompt_ids, group_size, sampling, ctx.generator, keys=keys), None


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
                    for i in rollout_micro_batches(ctx, rollout, grad=False)]
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


def reference_logprobs(ctx: Context, rollout: Rollout) -> torch.Tensor:
    """log pi_ref of every sampled token [N, T] (0 on padding), in passes without gradients."""
    n, temperature = rollout.completion_ids.shape[1], ctx.cfg.rollout.temperature
    ids, attn = rollout.input_ids, rollout.attention_mask
    with ctx.timed("reference"):
        return torch.cat([ctx.policy.ref_logprobs(ids[i], attn[i], n, temperature)
                          for i in rollout_micro_batches(ctx, rollout, grad=False)])


def penalized_token_rewards(ctx: Context, rollout: Rollout, rewards: torch.Tensor, beta: float,
                            estimator: str) -> tuple[torch.Tensor, float]:
    """Per-token rewards r_t: the outcome R on the last real token, minus beta * KL(pi || pi_ref)
    on every token (InstructGPT), with the mean KL; the reference pass runs only when beta > 0."""
    mask = rollout.completion_mask
    if beta <= 0:
        return terminal_rewards(rewards, mask), float("nan")
    ref = reference_logprobs(ctx, rollout)
    kl = kl_penalty(rollout.logprobs, ref, estimator)
    return kl_penalized_rewards(rewards, kl, mask, beta), float(distributed.masked_mean_over_ranks(kl, mask))


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
    with fsdp.gathered(ctx.policy.model):
        evaluation = evaluate(ctx.policy, ctx.cfg, ctx.eval_rows, ctx.scorer, ctx.step)
    if distributed.is_main():
        write_eval(evaluation, ctx.run_dir, ctx.step)
    return evaluation.metrics
