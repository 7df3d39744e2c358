"""Fixed (prompt, completion) pairs as model inputs: what the algorithms that learn from a dataset
(DPO, SFT, reward models) and a reward model scoring text feed the model.

A row of the batch is [left-padded prompt | right-padded completion], the layout rollouts have,
so `Policy.logprobs` scores it unchanged. Each completion ends with the tokenizer's EOS: the
model learns where an answer stops, as a sampled completion does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rlnotes.engine.prompts import Prompt, encode_prompts
from rlnotes.engine.rollout import left_pad
from rlnotes.notes import masked_sum


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or its messages' contents one after another."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


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


def summed_logprobs(logprobs: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """log pi(y|x) = sum_t log pi(y_t | x, y_<t) over each completion's real tokens: [N]."""
    return masked_sum(logprobs, seqs.completion_mask, dim=-1)
