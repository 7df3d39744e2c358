"""REINFORCE (Williams 1992) with a baseline, as in the notes; algo=rloo is baseline=group.

For each batch of prompts:
  1. sample G completions per prompt from pi and score them: R_i;
  2. per-token rewards: R_i on the last real token, minus beta KL(pi || pi_ref) on every token
     when beta > 0 (the only use of the reference pass);
  3. returns-to-go G_t = sum_l gamma^l r_{t+l};
  4. a baseline b: none (0), mean (running mean of the returns G_0 of earlier batches), group
     (the mean G_0 of the prompt's other G-1 completions: RLOO) or value (a learned V(s_t));
  5. one step on L = aggregate(-(G_t - b) log pi(a_t | s_t)) (+ vf_coef * value loss).

The baselines average the sequence return G_0 (R minus its KL penalty): with beta = 0 that is
the reward R itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from rlnotes.core.algorithm import Algorithm, Shape
from rlnotes.core.checks import model_token_limit
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import AlgoConfig
from rlnotes.engine.hardware import distributed
from rlnotes.engine.policy.critic import explained_variance, logprobs_and_values, value_head
from rlnotes.notes import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    aggregate,
    policy_gradient_loss,
    returns_to_go,
    value_loss,
)
from rlnotes.notes.reinforce import leave_one_out_baseline
from rlnotes.training.batching import batch_totals, micro_batch_weight, rollout_micro_batches
from rlnotes.training.context import Context
from rlnotes.training.optimizer import optimizer_step
from rlnotes.training.sampling import (
    next_rows,
    penalized_token_rewards,
    rollout_metrics,
    sample_and_score,
    tis_weights,
)

# Baselines b subtracted from the return G_t in REINFORCE (algo.baseline).
REINFORCE_BASELINES = ("none", "mean", "group", "value")


@dataclass
class ReinforceConfig(AlgoConfig):
    name: str = "reinforce"
    # Completions sampled per prompt, G. RLOO (Ahmadian et al. 2024) uses 2-4.
    group_size: int = 4
    # The weight of the KL penalty; 0 turns it off. Here a per-token KL(pi || pi_ref) penalty
    # subtracted from the reward; 0 by default: the notes' REINFORCE has none, and 0 skips the
    # reference pass (RLOO's paper uses ~0.05).
    beta: float = 0.0
    # Per-token KL estimator of the penalty: k1 = log pi - log pi_ref, the InstructGPT reward term.
    kl_estimator: str = "k1"
    # The discount of future rewards, gamma, in the returns-to-go. 1.0: the whole completion is one
    # episode.
    gamma: float = 1.0
    # The baseline b: none (b = 0), mean (running mean of sequence returns), group (mean of the other
    # G-1 completions of the prompt: RLOO), value (a learned V(s_t), trained toward G_t).
    baseline: str = "mean"
    # The weight of the previous running mean in baseline=mean: b <- m b + (1 - m) mean(G_0).
    baseline_momentum: float = 0.9
    # The weight of the value loss, with baseline=value.
    vf_coef: float = 0.5
    # How per-token losses become one number (see rlnotes.notes.AGGREGATIONS); token-mean weighs
    # every token alike, like the notes' E[sum_t ...] up to a constant.
    aggregation: str = "token-mean"


def mean_baseline(state: dict, returns: torch.Tensor, momentum: float) -> torch.Tensor:
    """b = running mean of earlier batches' mean return (this batch's own mean on the first
    batch, when there is none); then b <- momentum b + (1 - momentum) mean(returns).
    mean(returns) is over the global batch (the ranks hold equally many completions)."""
    batch_mean = distributed.mean_over_ranks(float(returns.mean()))
    b = state.get("reinforce/mean_return", batch_mean)
    state["reinforce/mean_return"] = momentum * b + (1 - momentum) * batch_mean
    return torch.full_like(returns, b)


# algo.baseline -> b per completion [N] from the algo section, the algorithm's state kept across steps
# and the returns G_0 [N]; "value" subtracts V(s_t) per token on top of a zero here, from the same
# forward pass as the log-probs.
BASELINES = {
    "none": lambda algo, state, g0: torch.zeros_like(g0),
    "mean": lambda algo, state, g0: mean_baseline(state, g0, algo.baseline_momentum),
    "group": lambda algo, state, g0: leave_one_out_baseline(g0, algo.group_size),
    "value": lambda algo, state, g0: torch.zeros_like(g0),
}


def train_step(ctx: Context) -> Dict[str, float]:
    algo, model, run = ctx.cfg.algo, ctx.model, ctx.run
    policy, temperature, tis_cap = model.policy, ctx.rollouts.sampling.temperature, ctx.rollouts.tis_cap
    use_value = algo.baseline == "value"
    if use_value and "value_head" not in model.heads:
        model.add_head("value_head", value_head(policy.model.config.hidden_size, model.device), run.step)

    # 1. Sample G completions per prompt and score them.
    rows = next_rows(ctx.data.sampler)
    rollout, rewards, metrics = sample_and_score(ctx.rollouts, model, ctx.data, run, rows, algo.group_size)
    metrics.update(rollout_metrics(rollout, rewards, algo.group_size))
    mask = rollout.completion_mask
    chunks = rollout_micro_batches(model, rollout)

    # 2. Per-token rewards; the KL uses the sampled log-probs (pi itself: one step per batch).
    token_rewards, metrics["kl/ref"] = penalized_token_rewards(model, run, rollout, rewards, algo.beta,
                                                               algo.kl_estimator, temperature)

    # 3-4. Returns-to-go and the baseline of each completion.
    returns = returns_to_go(token_rewards, mask, algo.gamma)
    baseline = BASELINES[algo.baseline](algo, run.cache, returns[:, 0])
    if not use_value:
        metrics["reward/baseline"] = distributed.mean_over_ranks(float(baseline.mean()))

    # 5. One policy-gradient step, micro-batch by micro-batch.
    policy.train()
    totals = batch_totals(mask)  # the global batch's tokens and sequences
    sums = {"loss": 0.0, "value/loss": 0.0, "value/explained_variance": 0.0}
    with run.timed("policy"):
        for idx in chunks:
            b = rollout.select(idx)
            w, m = b.completion_ids.shape[1], b.completion_mask
            g = returns[idx, :w]
            adv = g - baseline[idx, None]
            if use_value:
                logp, v, _ = logprobs_and_values(policy, model.heads["value_head"], b.input_ids, b.attention_mask,
                                                 w, temperature)
                adv = adv - v.detach()
            else:
                logp = policy.logprobs(b.input_ids, b.attention_mask, w, temperature)
            tis = tis_weights(tis_cap, b)  # rollout.tis_cap: tokens vLLM sampled weigh min(pi / pi_vllm, C)
            loss = policy_gradient_loss(logp, adv if tis is None else adv * tis, m, algo.aggregation)
            if use_value:
                v_loss = aggregate(value_loss(v, None, g), m, algo.aggregation)
                loss = loss + algo.vf_coef * v_loss
            weight = micro_batch_weight(algo.aggregation, m, totals)
            (loss * weight).backward()
            sums["loss"] += float(loss.detach()) * weight
            if use_value:
                share = len(idx) / totals.rows
                sums["value/loss"] += float(v_loss.detach()) * weight
                sums["value/explained_variance"] += float(explained_variance(v.detach(), g, m)) * share
        metrics.update(optimizer_step(model, run, ctx.out.console))
    if not use_value:
        del sums["value/loss"], sums["value/explained_variance"]
    metrics.update(distributed.sum_shares(sums))
    return metrics


def check(cfg) -> None:
    if cfg.algo.baseline == "group" and cfg.algo.group_size < 2:
        raise ConfigError(f"algo.group_size={cfg.algo.group_size}: baseline=group (RLOO) needs at least 2 "
                          "completions per prompt to average the others")


def shape(cfg) -> Shape:
    b, g = cfg.trainer.batch_size, cfg.algo.group_size
    return Shape("prompts", b * g, b * g, f"completions of a step (trainer.batch_size={b} x algo.group_size={g})",
                 max_new_tokens=model_token_limit(cfg.rollout))


ALGORITHM = Algorithm(name="reinforce", schema=ReinforceConfig, train_step=train_step, samples=True,
                      default_task="letters", shape=shape, check=check, objective="eval/accuracy",
                      train_objective="reward/mean",
                      group_relative=lambda algo: algo.baseline == "group",
                      choices={"algo.aggregation": AGGREGATIONS, "algo.kl_estimator": KL_ESTIMATORS,
                               "algo.baseline": REINFORCE_BASELINES},
                      ranges={"algo.group_size": ">= 1", "algo.beta": ">= 0", "algo.gamma": "[0, 1]",
                              "algo.baseline_momentum": "[0, 1)", "algo.vf_coef": ">= 0"})
