"""Sampling and scoring multi-turn episodes: the conversations of a batch run through the shared
rollout engine's episode loop (rlnotes.engine.sampling.episodes), then scored by the reward functions,
which see each whole episode, plus the environment's own reward.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from rlnotes.agents.conversation import Agents, Conversations
from rlnotes.engine.model.loading import context_length
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.episodes import generate_episodes
from rlnotes.rewards.scoring import Rewards


def run_episodes(agents: Agents, model, tokenizer, rows: Sequence[dict], group_size: int, rollout_cfg,
                 chat_template: bool, system_prompt: Optional[str], generator: Optional[torch.Generator] = None,
                 keys: Optional[torch.Tensor] = None, greedy: bool = False,
                 max_new_tokens: Optional[int] = None, engine=None) -> tuple[Conversations, Rollout]:
    """`group_size` episodes per row (each row's next to each other): (their conversations, the
    rollout of their compacted token sequences). rollout_cfg: the rollout section (temperature,
    top_p, max_new_tokens per turn unless `max_new_tokens` is given). `engine`: a vLLM engine that
    samples instead of the model (rollout.engine=vllm; the rollout then carries its log-probs as
    sampler_logprobs, for the trainer to recompute its own)."""
    conversations = Conversations(agents, tokenizer, rows, group_size, chat_template, system_prompt)
    prompts, shared = conversations.prompt_ids()
    max_new_tokens = max_new_tokens or rollout_cfg.max_new_tokens
    conversations.check_fit(prompts, shared, context_length(model), max_new_tokens)
    if engine is not None:
        rollout = engine.generate_episodes(prompts, shared, conversations.respond, agents.max_turns,
                                           agents.max_episode_tokens, keys, next(model.parameters()).device)
    else:
        rollout = generate_episodes(model, tokenizer, prompts, shared, conversations.respond, max_new_tokens,
                                    agents.max_turns, agents.max_episode_tokens, rollout_cfg.temperature,
                                    rollout_cfg.top_p, generator, greedy=greedy, keys=keys,
                                    fast_decode=rollout_cfg.fast_decode)
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
