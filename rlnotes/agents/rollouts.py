"""Sampling and scoring multi-turn episodes: the conversations of a batch run through the shared
rollout engine's episode loop (rlnotes.engine.sampling.episodes), then scored by the reward functions,
which see each whole episode, plus the environment's own reward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence

import torch

from rlnotes.agents.conversation import Agents, Conversations
from rlnotes.engine.model.loading import context_length
from rlnotes.engine.prompts import PromptFormat
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.episodes import generate_episodes
from rlnotes.rewards.scoring import Rewards

if TYPE_CHECKING:
    from rlnotes.engine.sampling.settings import SamplingSettings


def run_episodes(agents: Agents, model, tokenizer, rows: Sequence[dict], group_size: int,
                 sampling: SamplingSettings, prompt_format: PromptFormat,
                 generator: Optional[torch.Generator] = None, keys: Optional[torch.Tensor] = None,
                 engine=None) -> tuple[Conversations, Rollout]:
    """`group_size` episodes per row (each row's next to each other), each turn sampled as `sampling`
    says and the episode as long as agents.limits allow: (their conversations, the rollout of their
    compacted token sequences). `engine`: a vLLM engine that samples instead of the model
    (rollout.engine=vllm; the rollout then carries its log-probs as sampler_logprobs, for the
    trainer to recompute its own)."""
    conversations = Conversations(agents, tokenizer, rows, group_size, prompt_format)
    prompts, shared = conversations.prompt_ids()
    conversations.check_fit(prompts, shared, context_length(model), sampling.max_new_tokens)
    if engine is not None:
        rollout = engine.generate_episodes(prompts, shared, conversations.respond, agents.limits, keys,
                                           next(model.parameters()).device)
    else:
        rollout = generate_episodes(model, tokenizer, prompts, shared, conversations.respond, sampling,
                                    agents.limits, generator, keys=keys)
    rollout.texts = conversations.texts()
    return conversations, rollout


def score_episodes(rewards: Rewards, rows: Sequence[dict], conversations: Conversations, rollout: Rollout,
                   group_size: int) -> tuple[torch.Tensor, Dict[str, float]]:
    """Each episode's reward: the reward functions' weighted sum over its messages after the
    prompt (TRL's `completions` of a multi-turn rollout, with `environments`), plus the environment's
    reward (weight 1, logged as reward/env; a NaN or inf one gets reward.fallback and counts in
    reward/failures, as a function's does). Metrics: the rewards', and the episodes' own."""
    totals, metrics = rewards.score_groups(rows, conversations.completions(), rollout.token_lists(), group_size,
                                           environments=conversations.environments())
    env = conversations.env_rewards()
    if env is not None:
        env, failed = rewards.fallback_for(f"environment {conversations.env_name()}", env)
        totals = totals + env
        metrics["reward/env"] = float(env.mean())
        metrics["reward/failures"] += failed
    return totals, {**metrics, **conversations.metrics(rollout)}
