"""A batch of samples, as every floor holds it: N = prompts x G completions, each prompt's G next to
each other, prompts left-padded and completions right-padded. The sampler makes them
(rlnotes.engine.sampling), the algorithms train on them, the rewards and the agents read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, P] and mask [N, P] with each row aligned to the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


@dataclass
class Rollout:
    """N = prompts x G completions, each prompt's G completions next to each other."""

    prompt_ids: torch.Tensor          # [N, P] left-padded
    prompt_mask: torch.Tensor         # [N, P]
    completion_ids: torch.Tensor      # [N, T] right-padded
    completion_mask: torch.Tensor     # [N, T] 1.0 on real tokens, EOS included
    logprobs: torch.Tensor            # [N, T] log pi(token) when sampled, 0 on padding
    texts: List[str]                  # decoded completions, special tokens removed
    truncated: torch.Tensor           # [N] bool: hit max_new_tokens without EOS
    # [N, T] log-probs as another sampling engine (vLLM) computed them, when it sampled the rows;
    # `logprobs` then holds the trainer's own, recomputed. None: this engine sampled (they are equal).
    sampler_logprobs: Optional[torch.Tensor] = None
    # [N, T] 1 on every real token of a multi-turn episode: the model's turns and the environment's
    # observations between them (rlnotes.engine.sampling.episodes). `completion_mask` then marks the model's
    # tokens alone, the only ones that carry loss, KL, entropy and length. None: single turn (the same).
    completion_attn: Optional[torch.Tensor] = None

    @property
    def real(self) -> torch.Tensor:
        """[N, T] 1 on every real completion token (the model's and, in an episode, the environment's)."""
        return self.completion_mask if self.completion_attn is None else self.completion_attn

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.real.long()], dim=1)

    def token_lists(self) -> List[List[int]]:
        """Each completion's token ids, EOS included, padding dropped (an episode's observations too)."""
        return [row[mask.bool()].tolist() for row, mask in zip(self.completion_ids, self.real)]

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Rollout":
        """The rows `idx`, with the completion width trimmed to the longest of them."""
        width = max(int(self.real[idx].sum(-1).max()) if len(idx) else 0, 1)
        cut = lambda x: None if x is None else x[idx, :width]  # noqa: E731
        return Rollout(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx, :width],
                       self.completion_mask[idx, :width], self.logprobs[idx, :width],
                       [self.texts[i] for i in idx.tolist()], self.truncated[idx], cut(self.sampler_logprobs),
                       cut(self.completion_attn))


def concat_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """Rollouts stacked row-wise: prompts left-padded and completions right-padded to the widest."""
    p = max(r.prompt_ids.shape[1] for r in parts)
    t = max(r.completion_ids.shape[1] for r in parts)
    left = lambda x, value: F.pad(x, (p - x.shape[1], 0), value=value)  # noqa: E731
    right = lambda x, value: F.pad(x, (0, t - x.shape[1]), value=value)  # noqa: E731
    sampler = None if parts[0].sampler_logprobs is None else torch.cat([right(r.sampler_logprobs, 0.0) for r in parts])
    attn = None if parts[0].completion_attn is None else torch.cat([right(r.completion_attn, 0.0) for r in parts])
    return Rollout(torch.cat([left(r.prompt_ids, pad_id) for r in parts]),
                   torch.cat([left(r.prompt_mask, 0) for r in parts]),
                   torch.cat([right(r.completion_ids, pad_id) for r in parts]),
                   torch.cat([right(r.completion_mask, 0.0) for r in parts]),
                   torch.cat([right(r.logprobs, 0.0) for r in parts]),
                   [text for r in parts for text in r.texts],
                   torch.cat([r.truncated for r in parts]), sampler, attn)
