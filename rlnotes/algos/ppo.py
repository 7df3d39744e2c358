"""PPO (Schulman et al. 2017) for language models, as in the notes: reward -> V(s_t) -> GAE ->
A_t -> clipped update, with InstructGPT's (Ouyang et al. 2022) KL penalty inside the reward.

For each batch of prompts:
  1. sample G completions per prompt from pi_old and score them: R_i;
  2. no-grad passes, once per batch: log pi_ref (adapter off; only when beta > 0) and V_old(s_t);
  3. per-token rewards: R_i on the last real token, minus beta KL(pi_old || pi_ref) on every token;
  4. GAE: A_t and the value targets R_t = A_t + V_old(s_t); advantages whitened over the batch;
  5. K epochs over the batch in shuffled minibatches, one optimizer step each, on
     aggregate(-min(rho A, clip(rho) A)) + c1 * value loss - c2 * entropy; log-probs and values
     come from one forward pass. An epoch whose approximate KL to pi_old exceeds target_kl ends
     the batch.

log pi_old is the log-prob recorded while sampling, so it needs no pass of its own.

With several processes each rank shuffles its own completions and gives minibatch_size / N of
them to each minibatch, so every rank takes the same number of optimizer steps; advantage
whitening, the explained variance and the early stop on target_kl use the global batch.
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
from rlnotes.engine.policy.critic import (
    explained_variance,
    logprobs_and_values,
    value_head,
    values,
)
from rlnotes.notes import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    gae,
    masked_whiten,
    ppo_loss,
)
from rlnotes.notes.ppo import PPOLoss
from rlnotes.training.batching import batch_totals, micro_batch_weight, rollout_micro_batches
from rlnotes.training.context import Context, Model
from rlnotes.training.optimizer import optimizer_step
from rlnotes.training.sampling import (
    next_rows,
    penalized_token_rewards,
    rollout_metrics,
    sample_and_score,
    tis_weights,
)


@dataclass
class PPOConfig(AlgoConfig):
    name: str = "ppo"
    # Completions sampled per prompt, G. InstructGPT samples 1; any G works, and 4 keeps the batch
    # shape of the other algorithms: 32 completions per batch by default.
    group_size: int = 4
    # The weight of the KL penalty; 0 turns it off. PPO's is a per-token KL(pi || pi_ref) penalty in
    # the reward (InstructGPT: 0.02); at 0 the reference pass is skipped.
    beta: float = 0.05
    # Per-token KL estimator of that penalty. InstructGPT uses k1 = log pi - log pi_ref; k3 is
    # never negative and has far less variance, which a small model's reward cannot absorb
    # (k1's noise at this beta can drown a 0/1 reward's signal).
    kl_estimator: str = "k3"
    # The discount of future rewards, gamma. RLHF PPO uses 1.0.
    gamma: float = 1.0
    # GAE's lambda. Schulman et al. 2015; RLHF PPO uses 0.95.
    lam: float = 0.95
    # The clip range of the ratio pi / pi_old, to [1 - eps, 1 + eps]. The PPO paper uses 0.2.
    clip_eps: float = 0.2
    # The clip range of V around V_old in the value loss; null = plain MSE. OpenAI baselines use 0.2.
    value_clip_eps: Optional[float] = 0.2
    # The weight of the value loss, c1. The PPO paper uses 0.5 or 1.
    vf_coef: float = 0.5
    # The weight of the entropy bonus, c2; 0 skips computing it. The bonus is the exact entropy from
    # full logits; the PPO paper uses 0.01.
    entropy_coef: float = 0.0
    # Passes over each sampled batch, K. The PPO paper uses 3-10; 2 x 2 minibatches = 4 optimizer
    # steps per batch, so a default 60-step run samples 15 batches: more epochs or minibatches
    # per batch leave a short run too few fresh samples to learn from.
    epochs: int = 2
    # Completions per optimizer step; must divide trainer.batch_size * group_size.
    minibatch_size: int = 16
    # Normalise advantages over the batch's real tokens (mean 0, std 1).
    whiten_advantages: bool = True
    # The KL(pi_old || pi) that stops a batch's epochs early; null = never. An epoch's mean k3
    # estimate is compared with it; Spinning Up uses 0.01-0.05.
    target_kl: Optional[float] = None
    # How per-token losses become one number (see rlnotes.notes.AGGREGATIONS).
    aggregation: str = "token-mean"


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """masked_whiten with the mean and variance of the global batch's real tokens."""
    if not distributed.active():
        return masked_whiten(values, mask)
    mean = distributed.masked_mean_over_ranks(values, mask)
    var = distributed.masked_mean_over_ranks((values - mean) ** 2, mask)
    return torch.where(mask.bool(), (values - mean) * torch.rsqrt(var + 1e-8), 0.0)


def batch_explained_variance(old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """explained_variance over the global batch's real tokens."""
    if not distributed.active():
        return float(explained_variance(old_values, returns, mask))
    mean = distributed.masked_mean_over_ranks
    var_r = mean((returns - mean(returns, mask)) ** 2, mask)
    diff = returns - old_values
    var_d = mean((diff - mean(diff, mask)) ** 2, mask)
    return float(1 - var_d / var_r.clamp(min=1e-8))


def add_shares(sums: Dict[str, float], out: PPOLoss, weight: float, share: float) -> None:
    """Add a micro-batch's part of its minibatch's logged means to `sums`: its loss weight for the
    aggregated losses, its `share` of the tokens for the token means, so no cut changes the log."""
    for key, value, part in (("loss", out.loss.detach(), weight), ("value/loss", out.value_loss, weight),
                             ("policy/clip_frac", out.clip_frac, share), ("policy/approx_kl", out.approx_kl, share)):
        sums[key] += float(value) * part


def minibatch_loss(model: Model, algo, b, adv, returns, old_values, temperature: float,
                   tis_cap: Optional[float], max_len: int) -> PPOLoss:
    """PPO's loss (the `algo` section's) on the rollout rows `b` (trimmed to width w), with its parts
    for the log: one pass of the policy and its value head."""
    w = b.completion_ids.shape[1]
    logp, v, entropy = logprobs_and_values(model.policy, model.heads["value_head"], b.input_ids, b.attention_mask,
                                           w, temperature, entropy=algo.entropy_coef > 0)
    tis = tis_weights(tis_cap, b)  # rollout.tis_cap: tokens vLLM sampled weigh min(pi_old / pi_vllm, C)
    return ppo_loss(logp, b.logprobs, adv if tis is None else adv * tis, v, old_values, returns, b.completion_mask,
                    clip_eps=algo.clip_eps, value_clip_eps=algo.value_clip_eps, vf_coef=algo.vf_coef,
                    entropy=entropy, entropy_coef=algo.entropy_coef, aggregation=algo.aggregation, max_len=max_len)


def train_step(ctx: Context) -> Dict[str, float]:
    cfg, algo, model, run = ctx.cfg, ctx.cfg.algo, ctx.model, ctx.run
    policy, temperature, max_len = model.policy, ctx.rollouts.sampling.temperature, model_token_limit(cfg.rollout)
    if "value_head" not in model.heads:
        model.add_head("value_head", value_head(policy.model.config.hidden_size, model.device), run.step)
    head = model.heads["value_head"]

    # 1. Sample G completions per prompt and score them.
    rows = next_rows(ctx.data.sampler)
    rollout, rewards, metrics = sample_and_score(ctx.rollouts, model, ctx.data, run, rows, algo.group_size)
    metrics.update(rollout_metrics(rollout, rewards, algo.group_size))
    mask, n = rollout.completion_mask, rollout.completion_ids.shape[1]
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask
    chunks = rollout_micro_batches(model, rollout, grad=False)  # the value pass

    # 2. The batch's fixed quantities: log pi_ref and V_old, one no-grad pass each.
    policy.eval()
    # 3. Per-token rewards: the outcome at the end, the KL penalty on every token.
    token_rewards, metrics["kl/ref"] = penalized_token_rewards(model, run, rollout, rewards, algo.beta,
                                                               algo.kl_estimator, temperature)
    with run.timed("values"), torch.no_grad():
        old_values = torch.cat([values(policy, head, input_ids[i], attention_mask[i], n) for i in chunks])

    # 4. Generalized advantage estimation.
    adv, returns = gae(token_rewards, old_values, mask, algo.gamma, algo.lam)
    metrics["value/explained_variance"] = batch_explained_variance(old_values, returns, mask)
    if algo.whiten_advantages:
        adv = whiten(adv, mask)

    # 5. K epochs of shuffled minibatches, one optimizer step per minibatch.
    policy.train()
    sums = {"loss": 0.0, "value/loss": 0.0, "policy/clip_frac": 0.0, "policy/approx_kl": 0.0}
    updates, n_global = 0, batch_totals(mask).rows
    with run.timed("policy"):
        for _ in range(algo.epochs):
            epoch_kl, order = 0.0, torch.randperm(len(rollout), generator=run.generator, device=model.device)
            for mb in order.split(algo.minibatch_size // distributed.world_size()):
                totals = batch_totals(mask[mb])  # the minibatch's tokens and sequences on every rank
                for part in rollout_micro_batches(model, rollout, mb):
                    idx = mb[part]
                    b = rollout.select(idx)
                    w = b.completion_ids.shape[1]
                    out = minibatch_loss(model, algo, b, adv[idx, :w], returns[idx, :w], old_values[idx, :w],
                                         temperature, ctx.rollouts.tis_cap, max_len)
                    weight = micro_batch_weight(algo.aggregation, b.completion_mask, totals, max_len)
                    (out.loss * weight).backward()
                    share = float(b.completion_mask.sum()) / max(totals.tokens, 1.0)  # of the minibatch's tokens
                    add_shares(sums, out, weight, share)
                    epoch_kl += float(out.approx_kl) * share * totals.rows / n_global
                metrics.update(optimizer_step(model, run, ctx.out.console))
                updates += 1
                if run.step >= cfg.trainer.steps:
                    break
            epoch_kl = distributed.sum_over_ranks([epoch_kl])[0]  # every rank stops after the same epoch
            if run.step >= cfg.trainer.steps or (algo.target_kl is not None and epoch_kl > algo.target_kl):
                break
    metrics.update({key: value / updates for key, value in distributed.sum_shares(sums).items()})
    metrics["policy/updates"] = float(updates)
    return metrics


def check(cfg) -> None:
    n = cfg.trainer.batch_size * cfg.algo.group_size
    if n % cfg.algo.minibatch_size:
        raise ConfigError(f"algo.minibatch_size={cfg.algo.minibatch_size} must divide trainer.batch_size * "
                          f"algo.group_size = {n} completions")
    world = planned_world_size(cfg.hardware)
    if world > 1 and cfg.algo.minibatch_size % world:
        raise ConfigError(f"algo.minibatch_size={cfg.algo.minibatch_size} does not split evenly over {world} "
                          f"processes; use a multiple of {world}")


def shape(cfg) -> Shape:
    n, algo = cfg.trainer.batch_size * cfg.algo.group_size, cfg.algo
    minibatches = n // algo.minibatch_size
    return Shape("prompts", n, algo.minibatch_size, "completions of one PPO update (algo.minibatch_size)",
                 minibatches=minibatches, updates=algo.epochs * minibatches, max_new_tokens=model_token_limit(cfg.rollout))


ALGORITHM = Algorithm(name="ppo", schema=PPOConfig, train_step=train_step, samples=True, default_task="letters",
                      shape=shape, check=check, objective="eval/accuracy",
                      train_objective="reward/mean",
                      choices={"algo.aggregation": AGGREGATIONS, "algo.kl_estimator": KL_ESTIMATORS},
                      ranges={"algo.group_size": ">= 1", "algo.beta": ">= 0", "algo.gamma": "[0, 1]",
                              "algo.lam": "[0, 1]", "algo.clip_eps": "(0, 1)", "algo.value_clip_eps": "> 0",
                              "algo.vf_coef": ">= 0", "algo.entropy_coef": ">= 0", "algo.epochs": ">= 1",
                              "algo.minibatch_size": ">= 1", "algo.target_kl": "> 0"})
