"""The settings the sampler takes, in two bundles: how each token is drawn (SamplingSettings, for a
completion or a turn) and how long an episode may run (EpisodeLimits). Both come from the rollout
section of the config (an evaluation's own: greedy, eval.max_new_tokens); nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn: at most `max_new_tokens` per completion (per turn, in an episode), from
    softmax(z / temperature) cut to its top_p mass, or the most likely token (`greedy`; the log-probs
    are still those of softmax(z / temperature)). `fast_decode`: decode with rlnotes' own step where
    the model is one it computes (rlnotes.engine.sampling.decoder)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    fast_decode: bool = True

    @classmethod
    def of(cls, rollout, greedy: bool = False, max_new_tokens: Optional[int] = None) -> "SamplingSettings":
        """The settings of the rollout section (rollout.max_new_tokens unless `max_new_tokens` is given)."""
        return cls(max_new_tokens or rollout.max_new_tokens, rollout.temperature, rollout.top_p, greedy,
                   rollout.fast_decode)


@dataclass(frozen=True)
class EpisodeLimits:
    """How long a multi-turn episode may run: at most `max_turns` model turns, and at most
    `max_episode_tokens` tokens after its prompt (the model's and the observations'; None: no bound
    but the turns and the model's context)."""
    max_turns: int
    max_episode_tokens: Optional[int] = None

    @classmethod
    def of(cls, rollout) -> "EpisodeLimits":
        return cls(rollout.max_turns, rollout.max_episode_tokens)
