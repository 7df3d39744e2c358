"""A value head V(s_t) on the policy's last hidden state, and the one forward pass that gives
log-probs and values together (PPO; REINFORCE with a learned baseline).

The head is a linear layer hidden_size -> 1 that shares the policy's body (and its LoRA
adapter), so the value loss also trains the adapter, as in InstructGPT-style PPO with a shared
trunk. s_t is the prefix before completion token t: V(s_t) reads the hidden state at the
position whose logits predict token t.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rlnotes.notes import masked_mean
from rlnotes.policy import forward, token_logprobs


def value_head(hidden_size: int, device: torch.device) -> torch.nn.Linear:
    """Linear hidden -> 1, zero-initialised: V = 0 at the start, so early advantages are returns."""
    head = torch.nn.Linear(hidden_size, 1, device=device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk: int = 8) -> torch.Tensor:
    """H(pi(. | s_t)) = -sum_a pi(a) log pi(a) per position, logits [B, T, V] -> [B, T]."""
    out = []
    for lg in logits.split(chunk):
        logp = F.log_softmax(lg.float() / temperature, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


def _values(head: torch.nn.Module, out, n_completion: int) -> torch.Tensor:
    # hidden_states[-1] is after the final norm: the LM head's input.
    hidden = out.hidden_states[-1][:, -(n_completion + 1):-1]
    return head(hidden.to(head.weight.dtype)).squeeze(-1)


def logprobs_and_values(model, head, input_ids, attention_mask, n_completion: int, temperature: float = 1.0,
                        entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(log pi [B, n], V(s_t) [B, n], entropy [B, n] or None) from ONE forward pass.

    Rows are [left-padded prompt | completion], as for policy.sequence_logprobs; only the
    completion positions reach the LM head. The exact entropy needs a full softmax per token,
    so it is computed only when asked for.
    """
    out = forward(model, input_ids, attention_mask, n_completion + 1, hidden_states=True)
    logits = out.logits[:, :-1]
    logp = token_logprobs(logits, input_ids[:, -n_completion:], temperature)
    ent = token_entropy(logits, temperature) if entropy else None
    return logp, _values(head, out, n_completion), ent


def values(model, head, input_ids, attention_mask, n_completion: int) -> torch.Tensor:
    """V(s_t) [B, n] alone: the LM head sees one position only."""
    return _values(head, forward(model, input_ids, attention_mask, 1, hidden_states=True), n_completion)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over real tokens: 1 for a perfect critic, 0 for a constant one."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return 1 - var_d / var_r.clamp(min=1e-8)
