"""Fixed (prompt, completion) pairs as model inputs: what the algorithms that learn from a dataset
(DPO, SFT, reward models) and a reward model scoring text feed the model.

A row of the batch is [left-padded prompt | right-padded completion], the layout rollouts have,
so `Policy.logprobs` scores it unchanged. Each completion ends with the tokenizer's EOS: the
model learns where an answer stops, as a sampled completion does. A conversation (`pack` of
rlnotes.agents.rendering's tokens) is a row too: its completion is everything after its prompt,
the observations between its assistant turns included, and completion_mask marks those turns.
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
    completion_mask: torch.Tensor   # [N, T] 1.0 on the completion tokens that carry loss, EOS included

    @property
    def n_completion(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def real(self) -> torch.Tensor:
        """[N, T] 1 on every real completion token: those with loss and, in a conversation, its
        observations (completion_mask marks the first alone)."""
        return self.attention_mask[:, -self.n_completion:]

    @property
    def last_index(self) -> torch.Tensor:
        """[N] position of each row's last real token (its EOS)."""
        prompt_width = self.input_ids.shape[1] - self.n_completion
        return prompt_width + self.real.sum(-1).long() - 1

    def tokens(self) -> float:
        return float(self.attention_mask.sum())

    def select(self, idx: torch.Tensor) -> "Sequences":
        return Sequences(self.input_ids[idx], self.attention_mask[idx], self.completion_mask[idx])


def encode(tokenizer, prompts: Sequence[Prompt], completions: Sequence[Prompt], device: torch.device,
           chat_template: bool = True, system_prompt: Optional[str] = None) -> Sequences:
    """Prompts (text or messages) as the rollout engine encodes them, then each completion's tokens
    (text, or assistant messages as text) and EOS."""
    eos = [tokenizer.eos_token_id]
    return pack(encode_prompts(tokenizer, prompts, chat_template, system_prompt),
                [tokenizer(completion_text(c), add_special_tokens=False)["input_ids"] + eos for c in completions],
                tokenizer.pad_token_id, device)


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, device: torch.device,
         loss_masks: Optional[Sequence[Sequence[float]]] = None) -> Sequences:
    """Token id lists as one batch: each prompt left-padded, each completion right-padded after it.
    `loss_masks` (one per completion, 1.0 on a token that carries loss) make completion_mask, which is
    then not the attention mask's completion part (a demonstration's observations are context
    only); None: every completion token carries loss."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    width = max(len(r) for r in completions)
    completion_ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    real, completion_mask = torch.zeros((len(completions), width)), torch.zeros((len(completions), width))
    for i, r in enumerate(completions):
        completion_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        real[i, :len(r)] = 1.0
        completion_mask[i, :len(r)] = 1.0 if loss_masks is None else torch.tensor(loss_masks[i])
    return Sequences(torch.cat([prompt_ids, completion_ids], 1).to(device),
                     torch.cat([prompt_mask, real.long()], 1).to(device), completion_mask.to(device))


def summed_logprobs(logprobs: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """log pi(y|x) = sum_t log pi(y_t | x, y_<t) over each completion's real tokens: [N]."""
    return masked_sum(logprobs, seqs.completion_mask, dim=-1)
