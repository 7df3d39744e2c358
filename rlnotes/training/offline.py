"""Fixed (prompt, completion) rows as model inputs, for the algorithms that learn from a dataset
instead of sampling (DPO, SFT, reward models).

A row of the batch is [left-padded prompt | right-padded completion], the layout rollouts have,
so `Policy.logprobs` scores it unchanged. Each completion ends with the tokenizer's EOS: the
model learns where an answer stops, as a sampled completion does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rlnotes.data.tasks import system_prompt
from rlnotes.engine.rollout import Prompt, encode_prompts, left_pad
from rlnotes.notes import masked_sum
from rlnotes.rewards.scoring import completion_text


@dataclass
class Sequences:
    input_ids: torch.Tensor         # [N, P + T]
    attention_mask: torch.Tensor    # [N, P + T]
    completion_mask: torch.Tensor   # [N, T] 1.0 on real completion tokens, EOS included

    @property
    def n_completion(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def last_index(self) -> torch.Tensor:
        """[N] position of each row's last real token (its EOS)."""
        prompt_width = self.input_ids.shape[1] - self.n_completion
        return prompt_width + self.completion_mask.sum(-1).long() - 1

    def tokens(self) -> float:
        return float(self.attention_mask.sum())

    def select(self, idx: torch.Tensor) -> "Sequences":
        return Sequences(self.input_ids[idx], self.attention_mask[idx], self.completion_mask[idx])


def encode(tokenizer, prompts: Sequence[Prompt], completions: Sequence[Prompt], device: torch.device,
           chat_template: bool = True, system_prompt: Optional[str] = None) -> Sequences:
    """Prompts (text or messages) as the rollout engine encodes them, then each completion's tokens
    (text, or assistant messages as text) and EOS."""
    prompt_ids, prompt_mask = left_pad(encode_prompts(tokenizer, prompts, chat_template, system_prompt),
                                       tokenizer.pad_token_id)
    eos = [tokenizer.eos_token_id]
    completion_rows = [tokenizer(completion_text(c), add_special_tokens=False)["input_ids"] + eos for c in completions]
    width = max(len(r) for r in completion_rows)
    completion_ids = torch.full((len(completion_rows), width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(completion_rows), width))
    for i, r in enumerate(completion_rows):
        completion_ids[i, :len(r)] = torch.tensor(r)
        completion_mask[i, :len(r)] = 1.0
    return Sequences(torch.cat([prompt_ids, completion_ids], 1).to(device),
                     torch.cat([prompt_mask, completion_mask.long()], 1).to(device), completion_mask.to(device))


def encode_rows(ctx, rows, key: Optional[str]) -> Sequences:
    """`encode` of the rows' prompts and their `key` column, with the run's prompt settings
    (key None: the first half of `rows` gives its `chosen` column, the second half `rejected`)."""
    completions = [r[key] for r in rows] if key else \
        [r["chosen"] for r in rows[:len(rows) // 2]] + [r["rejected"] for r in rows[len(rows) // 2:]]
    return encode(ctx.policy.tokenizer, [r["prompt"] for r in rows], completions, ctx.device,
                  ctx.cfg.model.chat_template, system_prompt(ctx.cfg))


def encode_pairs(ctx, rows) -> Sequences:
    """Preference pairs as one batch: chosen completions in the first half, rejected in the second."""
    return encode_rows(ctx, rows + rows, None)


def summed_logprobs(logprobs: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """log pi(y|x) = sum_t log pi(y_t | x, y_<t) over each completion's real tokens: [N]."""
    return masked_sum(logprobs, seqs.completion_mask, dim=-1)

