"""A value head V(s_t) on the policy's last hidden state, and the one forward pass that gives
log-probs and values together (PPO; REINFORCE with a learned baseline).

The head is a linear layer hidden_size -> 1 that shares the policy's body (and its LoRA
adapter), so the value loss also trains the adapter, as in InstructGPT-style PPO with a shared
trunk. s_t is the prefix before completion token t: V(s_t) reads the hidden state at the
position whose logits predict token t.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from rlnotes.engine.policy.head import head_logprobs, linear_float32
from rlnotes.engine.policy.passes import completion_states
from rlnotes.notes import masked_mean

if TYPE_CHECKING:
    from rlnotes.engine.policy.policy import Policy


def value_head(hidden_size: int, device: torch.device) -> torch.nn.Linear:
    """Linear hidden -> 1, zero-initialised: V = 0 at the start, so early advantages are returns."""
    head = torch.nn.Linear(hidden_size, 1, device=device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


def logprobs_and_values(policy: Policy, head, input_ids, attention_mask, n_completion: int,
                        temperature: float = 1.0, entropy: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(log pi [B, n], V(s_t) [B, n], entropy H(pi(. | s_t)) [B, n] or None) from ONE forward pass
    of the policy's model.

    Rows are [left-padded prompt | completion], as for passes.sequence_logprobs (rows with the
    same prompt share its pass when the policy shares prompts); only the completion's real tokens
    reach the LM head. The exact entropy needs a full softmax per token, so it is computed only when
    asked for.
    """
    model = policy.model
    hidden = completion_states(model, input_ids, attention_mask, n_completion, policy.share_prompts)
    logp, ent = head_logprobs(hidden, model.get_output_embeddings(), input_ids[:, -n_completion:], temperature,
                              entropy, real=attention_mask[:, -n_completion:].bool())
    return logp, _values(head, hidden), ent


def values(policy: Policy, head, input_ids, attention_mask, n_completion: int) -> torch.Tensor:
    """V(s_t) [B, n] alone: no position reaches the LM head."""
    return _values(head, completion_states(policy.model, input_ids, attention_mask, n_completion,
                                           policy.share_prompts))


def _values(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return linear_float32(head, hidden).squeeze(-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over real tokens: 1 for a perfect critic, 0 for a constant one."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return 1 - var_d / var_r.clamp(min=1e-8)
