"""GRPO (Shao et al. 2024, DeepSeekMath section 4.1), as in the notes.

For each batch of prompts:
  1. sample G completions o_1..o_G per prompt from pi_old (the current policy);
  2. score them: R_i;
  3. A_i = (R_i - mean(R)) / std(R) within the group, the same for every token of o_i;
  4. log pi_ref of the sampled tokens (adapter off), when beta > 0;
  5. mu times: minimise 1/G sum_i 1/|o_i| sum_t -[min(rho A, clip(rho, 1-eps, 1+eps) A) - beta KL],
     rho = pi / pi_old.

DAPO's dynamic sampling (algo.dynamic_sampling) replaces steps 1-2: groups whose rewards are all
equal (A = 0, no gradient) are dropped and more prompts sampled until the batch is full.

With several processes each samples and scores its own prompts, so a group and its advantages
live on one rank; the loss normalisers (tokens, sequences) are the global batch's.

pi_old needs no pass of its own: with mu = 1 it is the current policy (rho = 1 in value, its
gradient is the policy gradient), and with mu > 1 it is the log-prob recorded while sampling.

Nor does a completion with A_i = 0 when beta = 0 (a group whose rewards are all equal): every term
of its loss is min(rho 0, clip(rho) 0) = 0, so its gradient is exactly zero and step 5 does not
forward it; the normalisers stay the whole batch's, so the update is the same. `perf/trained_frac`
is the share of completions step 5 forwarded (policy/clip_frac counts the clipped tokens among theirs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from rlnotes.core.algorithm import Algorithm, Shape
from rlnotes.core.checks import model_token_limit, planned_world_size
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import AlgoConfig
from rlnotes.engine.hardware import distributed
from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.rollout import Rollout, concat_rollouts
from rlnotes.notes import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    group_advantages,
    grpo_loss,
    informative_groups,
)
from rlnotes.training.batching import batch_totals, micro_batch_weight, rollout_micro_batches
from rlnotes.training.context import Context
from rlnotes.training.optimizer import optimizer_step
from rlnotes.training.sampling import next_rows, reference_beside, rollout_metrics, sample_and_score, tis_weights


@dataclass
class GRPOConfig(AlgoConfig):
    name: str = "grpo"
    # Completions sampled per prompt, G. DeepSeekMath uses 64; small runs use 4-16.
    group_size: int = 4
    # The weight of the KL penalty; 0 turns it off. GRPO's is a KL(pi || pi_ref) term inside the loss
    # (DeepSeekMath: 0.04); at 0 the reference forward pass is skipped entirely, and so is the training
    # pass of each completion whose advantage is 0 (its gradient is exactly zero).
    beta: float = 0.04
    # The clip range of the ratio pi / pi_old, to [1 - eps, 1 + eps]. DeepSeekMath uses 0.2.
    clip_eps: float = 0.2
    # The upper clip range of the ratio, to 1 + eps_high; null = clip_eps. DAPO's "clip-higher" uses 0.28.
    clip_eps_high: Optional[float] = None
    # Per-token KL estimator: k1, k2 or k3 (DeepSeekMath uses k3).
    kl_estimator: str = "k3"
    # How per-token losses become one number: seq-mean-token-mean is the paper's
    # 1/G sum_i 1/|o_i| sum_t; token-mean (DAPO), seq-mean-token-sum-norm (Dr. GRPO).
    aggregation: str = "seq-mean-token-mean"
    # Divide group-centred rewards by the group's std (false = Dr. GRPO).
    scale_by_std: bool = True
    # Passes over each sampled batch, mu: policy updates per batch. DeepSeekMath uses 1.
    epochs: int = 1
    # DAPO dynamic sampling (Yu et al. 2025, Sec. 3.2): drop groups whose rewards are all equal
    # (A = 0, no signal) and sample more prompts until trainer.batch_size groups carry signal.
    dynamic_sampling: bool = False
    # Extra sampling rounds at most per step with dynamic_sampling; the step then trains on the
    # informative groups it has (all of the last round's if none).
    max_resample_rounds: int = 4


def kept_groups(flags: torch.Tensor, start: int, wanted: int) -> torch.Tensor:
    """Which of this rank's groups to keep: the first `wanted` informative groups of the global
    batch (`flags` [groups], every rank's, in batch order) that fall in this rank's part, which
    begins at group `start`; as indices into that part."""
    chosen = flags.nonzero().squeeze(-1)[:wanted]
    return chosen[(chosen >= start) & (chosen < start + len(flags) // distributed.world_size())] - start


def sample_informative(ctx: Context, group_size: int,
                       max_rounds: int) -> tuple[Rollout, torch.Tensor, Dict[str, float]]:
    """DAPO dynamic sampling (Yu et al. 2025, Sec. 3.2): up to 1 + max_rounds batches of prompts,
    keeping the informative groups until trainer.batch_size of them are found. The reward metrics
    are the first batch's, as sampled; with no informative group at all, the last batch is used.
    The groups kept are those one process would keep, so a rank may end up with few or none."""
    want, kept, kept_rewards, metrics, have = ctx.cfg.trainer.batch_size, [], [], {}, 0
    for round_ in range(max_rounds + 1):
        rows = next_rows(ctx.data.sampler)
        rollout, rewards, round_metrics = sample_and_score(ctx.rollouts, ctx.model, ctx.data, ctx.run, rows,
                                                           group_size, round_)
        if not metrics:
            metrics = {**round_metrics, **rollout_metrics(rollout, rewards, group_size)}
        else:
            metrics["perf/tokens"] += round_metrics["perf/tokens"]
        flags = distributed.gather_rows(informative_groups(rewards, group_size))
        groups = kept_groups(flags, distributed.rank() * (len(rewards) // group_size), want - have)
        rows = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)
        if len(rows):
            kept.append(rollout.select(rows.cpu()))
            kept_rewards.append(rewards[rows])
        have += min(int(flags.sum()), want - have)
        if have >= want:
            break
    metrics["reward/resample_rounds"] = float(round_)
    if not have:
        return rollout, rewards, metrics
    if not kept:  # other ranks hold every group kept
        return rollout.select(torch.arange(0)), rewards[:0], metrics
    return concat_rollouts(kept, ctx.model.policy.tokenizer.pad_token_id), torch.cat(kept_rewards), metrics


def rows_with_gradient(advantages: torch.Tensor, beta: float, sharded: bool) -> torch.Tensor:
    """The completions whose loss has a gradient: with beta = 0 those with A_i != 0 (a completion
    with A_i = 0 adds exactly zero), else all; all under FSDP too, whose passes go in lock step."""
    if beta > 0 or sharded:
        return torch.arange(len(advantages))
    return (advantages != 0).nonzero().squeeze(-1).cpu()


def train_step(ctx: Context) -> Dict[str, float]:
    cfg, algo, model, run = ctx.cfg, ctx.cfg.algo, ctx.model, ctx.run
    policy, temperature, tis_cap = model.policy, ctx.rollouts.sampling.temperature, ctx.rollouts.tis_cap

    # 1-2. Sample G completions per prompt and score them (DAPO: only groups with a signal).
    if algo.dynamic_sampling:
        rollout, rewards, metrics = sample_informative(ctx, algo.group_size, algo.max_resample_rounds)
    else:
        rows = next_rows(ctx.data.sampler)
        rollout, rewards, metrics = sample_and_score(ctx.rollouts, model, ctx.data, run, rows, algo.group_size)
        metrics.update(rollout_metrics(rollout, rewards, algo.group_size))

    # 3. Group-normalised advantage, one per completion (none on a rank dynamic sampling left empty).
    advantages = group_advantages(rewards, algo.group_size, scale_by_std=algo.scale_by_std) if len(rewards) else rewards

    # 4. Reference log-probs of the sampled tokens (no gradients: passes as large as the budget allows),
    #    on a spare core beside step 5's first pass where there is one.
    trained = rows_with_gradient(advantages, algo.beta, is_sharded(policy.model))
    chunks = [trained[c] for c in rollout_micro_batches(model, rollout, trained)]
    batches = [rollout.select(idx) for idx in chunks]
    ref_all = reference_beside(model, run, rollout, temperature) if algo.beta > 0 else None

    # 5. mu policy updates on this batch; one optimizer step per pass.
    policy.train()
    totals = batch_totals(rollout.completion_mask)  # the global batch's tokens and sequences
    sums: Dict[str, float] = {"loss": 0.0, "kl/ref": 0.0, "policy/clip_frac": 0.0}
    with run.timed("policy"):
        for epoch in range(algo.epochs):
            for idx, b in zip(chunks, batches):
                logp = policy.logprobs(b.input_ids, b.attention_mask, b.completion_ids.shape[1], temperature)
                ref_logp = None if ref_all is None else ref_all()[idx, :b.completion_ids.shape[1]]
                old = logp.detach() if algo.epochs == 1 else b.logprobs
                mask, adv = b.completion_mask, advantages[idx]
                tis = tis_weights(tis_cap, b)  # rollout.tis_cap: tokens vLLM sampled weigh min(pi_old / pi_vllm, C)
                if tis is not None:
                    adv = adv[:, None] * tis
                out = grpo_loss(logp, old, ref_logp, adv, mask, clip_eps=algo.clip_eps, beta=algo.beta,
                                clip_eps_high=algo.clip_eps_high, kl_estimator=algo.kl_estimator,
                                aggregation=algo.aggregation, max_len=model_token_limit(cfg.rollout))
                weight = micro_batch_weight(algo.aggregation, mask, totals, model_token_limit(cfg.rollout))
                (out.loss * weight).backward()
                if epoch == 0:  # report the batch as sampled, before any update moved the policy
                    share = float(mask.sum()) / totals.tokens  # token means over the global batch
                    sums["loss"] += float(out.loss.detach()) * weight
                    sums["policy/clip_frac"] += float(out.clip_frac) * share
                    if ref_logp is not None:
                        sums["kl/ref"] += float(out.kl) * share
            if not chunks:  # every advantage 0: the zero gradient the skipped passes would have given
                for p in model.trainable_parameters():
                    p.grad = torch.zeros_like(p)
            metrics.update(optimizer_step(model, run, ctx.out.console))
    sums = distributed.sum_shares(sums)
    if algo.beta == 0:
        sums["kl/ref"] = float("nan")  # no reference pass was made
    metrics.update(sums)
    metrics["perf/trained_frac"] = len(trained) / max(len(rollout), 1)
    return metrics


def check(cfg) -> None:
    if cfg.algo.group_size < 2:
        raise ConfigError(f"algo.group_size={cfg.algo.group_size}: GRPO needs at least 2 completions per prompt "
                          "to normalise rewards within a group")
    if cfg.trainer.steps % cfg.algo.epochs:
        raise ConfigError(f"trainer.steps={cfg.trainer.steps} counts optimizer steps and must be a multiple of "
                          f"algo.epochs={cfg.algo.epochs} (one step per pass over a batch)")
    if cfg.algo.dynamic_sampling and cfg.algo.max_resample_rounds < 0:
        raise ConfigError(f"algo.max_resample_rounds={cfg.algo.max_resample_rounds} counts extra sampling rounds "
                          "per step with algo.dynamic_sampling and must be at least 0")
    if cfg.algo.dynamic_sampling and cfg.hardware.strategy == "fsdp" and planned_world_size(cfg.hardware) > 1:
        raise ConfigError("algo.dynamic_sampling keeps a different number of groups on each process, which FSDP's "
                          "lock-step passes cannot follow; use hardware.strategy=ddp")


def shape(cfg) -> Shape:
    b, g, algo = cfg.trainer.batch_size, cfg.algo.group_size, cfg.algo
    return Shape("prompts", b * g, b * g, f"completions of a step (trainer.batch_size={b} x algo.group_size={g})",
                 updates=algo.epochs, rounds=1 + algo.max_resample_rounds if algo.dynamic_sampling else 1,
                 max_new_tokens=model_token_limit(cfg.rollout))


ALGORITHM = Algorithm(name="grpo", schema=GRPOConfig, train_step=train_step, samples=True, default_task="letters",
                      shape=shape, check=check, objective="eval/accuracy",
                      train_objective="reward/mean", group_relative=lambda algo: True,
                      choices={"algo.aggregation": AGGREGATIONS, "algo.kl_estimator": KL_ESTIMATORS},
                      ranges={"algo.group_size": ">= 1", "algo.beta": ">= 0", "algo.clip_eps": "(0, 1)",
                              "algo.clip_eps_high": "> 0", "algo.epochs": ">= 1"})
