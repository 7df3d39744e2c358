"""Sampling and scoring a batch: this rank's prompts, G completions each (the policy or vLLM
samples), their rewards, the trainer's log-probs of another engine's samples, the reference
pass of a KL penalty, and the batch's reward and length statistics.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import torch

from rlnotes.engine.hardware import distributed, fsdp
from rlnotes.engine.hardware.beside import Answer
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.generate import completion_seeds, generate
from rlnotes.notes import informative_groups, kl_penalty
from rlnotes.notes.reinforce import kl_penalized_rewards, terminal_rewards
from rlnotes.notes.tis import truncated_is_weights
from rlnotes.training.batching import rollout_micro_batches

if TYPE_CHECKING:
    from rlnotes.agents.multi_turn import Conversations
    from rlnotes.data.sampler import PromptSampler
    from rlnotes.data.tasks import Row
    from rlnotes.training.context import Data, Model, Rollouts, Run


def next_rows(sampler: PromptSampler) -> List[Row]:
    """This process's part of the next batch (all of it with one process). Every rank draws the
    same global batch from the same sampler and keeps its own slice, so the data position is one
    state for all ranks and the global batch is trainer.batch_size whatever their number."""
    return distributed.shard(sampler.next_batch())


def sample_and_score(rollouts: Rollouts, model: Model, data: Data, run: Run, rows: List[Row], group_size: int,
                     round_: int = 0) -> tuple[Rollout, torch.Tensor, Dict[str, float]]:
    """G completions per prompt (multi-turn: G episodes, rollout.tools / rollout.env) and the reward
    of each from data.rewards: (rollout, rewards [N], reward metrics); the batch goes to run.samples
    for the samples table. `rows` are this rank's part of a batch; `round_` numbers the batches
    sampled within one step (DAPO's extra rounds), which with per-prompt seeds enters each
    completion's seed together with the step."""
    seeds = None
    if rollouts.per_prompt_seed:  # prompt i of rank r is prompt r * len(rows) + i of the global batch
        first = distributed.rank() * len(rows)
        seeds = completion_seeds(run.seed, (run.step, round_), torch.arange(first, first + len(rows)), group_size)
    model.policy.eval()
    start = time.perf_counter()
    with run.timed("generate"), fsdp.gathered(model.policy.model):
        rollout, conversations = sample(rollouts, model, run, rows, group_size, seeds)
    tokens = float(rollout.completion_mask.sum())
    metrics = {"perf/tokens": tokens, "perf/gen_tokens_per_s": tokens / (time.perf_counter() - start)}
    if rollout.sampler_logprobs is not None:
        metrics.update(trainer_logprobs(model, run, rollout, rollouts))
    scorer = data.rewards
    with run.timed("reward"):
        scorer.at_step(run.step, run.steps, data.sampler.epochs_drawn())
        if conversations is not None:  # whole episodes, and the environment's reward
            rewards, reward_metrics = conversations.score(scorer, rows, rollout)
        else:
            rewards, reward_metrics = scorer.score_groups(rows, rollout.texts, rollout.token_lists(), group_size)
    # An episode's prompt as the model saw it: with what reset added and the tools' descriptions.
    prompts = conversations.prompts() if conversations is not None else \
        [r["prompt"] for r in rows for _ in range(group_size)]
    extra = scorer.extra
    if conversations is not None and conversations.multi_turn.names:  # which environment each episode ran in
        extra = {"environment": conversations.env_names, **extra}
    run.samples = {"prompts": prompts, "completions": list(rollout.texts), "rewards": rewards.tolist(),
                   "extra": extra}
    # Each rank scored its own completions: failures add up, per-function means average (the ranks
    # score equally many completions), generation speeds add up (the ranks sample side by side).
    ops = {key: "sum" if key == "reward/failures" else "mean" for key in reward_metrics}
    metrics = distributed.reduce_metrics({**metrics, **reward_metrics}, {**ops, "perf/gen_tokens_per_s": "sum"})
    if conversations is not None:  # each environment's own, with several (env/NAME/...)
        metrics.update(conversations.environment_metrics(rollout, rewards))
    return rollout, rewards.to(model.device), metrics


def sample(rollouts: Rollouts, model: Model, run: Run, rows: List[Row], group_size: int,
           seeds: Optional[torch.Tensor]) -> tuple[Rollout, Optional[Conversations]]:
    """The batch's completions, sampled by the policy or the vLLM engine: one per sample, or with
    rollout.tools / rollout.env whole episodes (then with their conversations; else None)."""
    policy, engine, settings = model.policy, rollouts.engine, rollouts.sampling
    if engine is not None:
        engine.sync(policy, run.step)
    if rollouts.multi_turn is not None:
        with policy.sampling(rollouts.merge_adapter and engine is None,
                             rollouts.pack_weights and engine is None) as sampled:
            conversations, rollout = rollouts.multi_turn.run_episodes(sampled, policy.tokenizer, rows, group_size,
                                                                      settings, model.prompt_format, run.generator,
                                                                      seeds, engine=engine)
        return rollout, conversations
    prompt_ids = model.prompt_format.encode(policy.tokenizer, [r["prompt"] for r in rows])
    if engine is not None:
        prompt_seeds = seeds[::group_size].tolist() if seeds is not None else None
        return engine.generate(prompt_ids, group_size, prompt_seeds, model.device), None
    with policy.sampling(rollouts.merge_adapter, rollouts.pack_weights) as sampled:
        return generate(sampled, policy.tokenizer, prompt_ids, group_size, settings, run.generator, seeds=seeds), None


@torch.no_grad()
def trainer_logprobs(model: Model, run: Run, rollout: Rollout, rollouts: Rollouts) -> Dict[str, float]:
    """Put the trainer's own log-probs of another engine's samples into rollout.logprobs (one
    no-grad pass) and measure how far the sampler's were from them, over the global batch:
    sampler/logprob_vllm and sampler/logprob_trainer (mean per token), sampler/mismatch (mean
    |log pi_trainer - log pi_vllm|) and, with rollout.tis_cap, sampler/tis_clip_frac (tokens whose
    weight was capped)."""
    ids, attn, n = rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1]
    with run.timed("old_logprobs"):
        logprobs = [model.policy.logprobs(ids[i], attn[i], n, rollouts.sampling.temperature)
                    for i in rollout_micro_batches(model, rollout, grad=False)]
    mask, mean = rollout.completion_mask, distributed.masked_mean_over_ranks
    rollout.logprobs = torch.cat(logprobs) * mask  # 0 on padding, as sampled log-probs are
    diff = rollout.logprobs - rollout.sampler_logprobs
    metrics = {"sampler/logprob_vllm": float(mean(rollout.sampler_logprobs, mask)),
               "sampler/logprob_trainer": float(mean(rollout.logprobs, mask)),
               "sampler/mismatch": float(mean(diff.abs(), mask))}
    if rollouts.tis_cap is not None:
        metrics["sampler/tis_clip_frac"] = float(mean((diff > math.log(rollouts.tis_cap)).float(), mask))
    return metrics


def tis_weights(tis_cap: Optional[float], rows: Rollout) -> Optional[torch.Tensor]:
    """rollout.tis_cap's per-token weights min(pi_trainer / pi_sampler, C) [n, T] of `rows`, or None
    (no cap, or the policy sampled them itself)."""
    if tis_cap is None or rows.sampler_logprobs is None:
        return None
    return truncated_is_weights(rows.logprobs, rows.sampler_logprobs, tis_cap)


def reference_passes(model: Model, rollout: Rollout) -> List[tuple[torch.Tensor, torch.Tensor]]:
    """The token ids and attention mask of each pass of the reference over `rollout`'s rows: passes
    without gradients, as large as the budget allows."""
    ids, attn = rollout.input_ids, rollout.attention_mask
    return [(ids[i], attn[i]) for i in rollout_micro_batches(model, rollout, grad=False)]


def reference_logprobs(model: Model, run: Run, rollout: Rollout, temperature: float) -> torch.Tensor:
    """log pi_ref of every sampled token [N, T] (0 on padding), in passes without gradients."""
    n = rollout.completion_ids.shape[1]
    with run.timed("reference"):
        return torch.cat([model.policy.ref_logprobs(ids, attn, n, temperature)
                          for ids, attn in reference_passes(model, rollout)])


def reference_beside(model: Model, run: Run, rollout: Rollout,
                     temperature: float) -> Callable[[], torch.Tensor]:
    """reference_logprobs, started in the spare core's process beside what the caller does next (the
    policy's passes; model.reference_process), else computed now: the function that gives them."""
    process = model.reference_process()
    if process is None:
        ref = reference_logprobs(model, run, rollout, temperature)
        return lambda: ref
    answer = process.submit(reference_passes(model, rollout), rollout.completion_ids.shape[1], temperature)
    return functools.cache(lambda: answered(run, answer))


def answered(run: Run, answer: Callable[[], Answer]) -> torch.Tensor:
    """The reference process's log-probs, waited for: time/reference_s is the pass's time in it (beside
    the policy's), time/reference_wait_s what the step waited for them (what the overlap did not hide)."""
    logprobs, seconds, waited = answer()
    run.add_time("reference", seconds)
    run.add_time("reference_wait", waited)
    return logprobs


def penalized_token_rewards(model: Model, run: Run, rollout: Rollout, rewards: torch.Tensor, beta: float,
                            estimator: str, temperature: float) -> tuple[torch.Tensor, float]:
    """Per-token rewards r_t: the outcome R on the last real token, minus beta * KL(pi || pi_ref)
    on every token (InstructGPT), with the mean KL; the reference pass runs only when beta > 0."""
    mask = rollout.completion_mask
    if beta <= 0:
        return terminal_rewards(rewards, mask), float("nan")
    ref = reference_logprobs(model, run, rollout, temperature)
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
