"""Forward passes over [left-padded prompt | completion] rows, and per-token log-probs.

Rows that share a prompt forward it once (completion_states; a prefix every prompt shares, once
more: prompt_levels), each pass computes the real positions only (the Llama family through rlnotes' own
pass, rlnotes.engine.policy.llama; other models through their forward with the MLPs and projections
skipping padding, rlnotes.engine.policy.padding), and the LM head turns hidden states into log-probs a
block at a time (rlnotes.engine.policy.head), so full-vocabulary logits of the whole batch never exist
at once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from rlnotes.engine.hardware import distributed
from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.policy.head import head_logprobs
from rlnotes.engine.policy.kvcache import plain_layers, select_rows
from rlnotes.engine.policy.llama import Level, LlamaLayers
from rlnotes.engine.policy.padding import forward_real


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
            hidden_states: bool = False):
    """One forward pass over [left-padded prompt | completion] rows, with position ids that follow
    the attention mask, logits for the last `logits_to_keep` positions only, and padding skipped by
    the position-wise layers (rlnotes.engine.policy.padding)."""
    return forward_real(model, input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids(attention_mask), use_cache=False, logits_to_keep=logits_to_keep,
                        output_hidden_states=hidden_states)


def states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
           cache: Optional[DynamicCache] = None, logits: bool = False) -> torch.Tensor:
    """One forward pass of `input_ids` [B, T] at `positions`, `attention_mask` [B, K] covering
    `cache`'s columns first (keys and values go into it): the last layer's hidden states after the
    final norm [B, T, H], or with `logits` the next-token logits at each row's last position [B, V].
    Through rlnotes' own pass (rlnotes.engine.policy.llama) where it computes the model's, else the
    model's forward with padding skipped in its position-wise layers."""
    own = LlamaLayers.of(model)
    if own is not None:
        hidden = own.hidden(input_ids, attention_mask, positions, cache)
        return model.get_output_embeddings()(hidden[:, -1]) if logits else hidden
    out = forward_real(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                       use_cache=cache is not None, logits_to_keep=1 if logits else input_ids.new_empty(0),
                       output_hidden_states=not logits)
    return out.logits[:, -1] if logits else out.hidden_states[-1]  # hidden states after the final norm


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Rows that share their prompt: (the first row of each distinct prompt [U], in order, and each
    row's prompt number [B]), or None when every row has a prompt of its own. Prompts compare as
    token ids and padding together, so any rows may share (a group, part of one, or PPO's shuffled
    rows), and rows that share one have the same left-padded ids, positions and keys/values."""
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    if len(unique) == len(key):
        return None
    rows = torch.arange(len(key), device=key.device)
    first = torch.full((len(unique),), len(key), device=key.device).scatter_reduce(0, inverse, rows, "amin")
    order = first.argsort()
    number = torch.empty_like(order)
    number[order] = torch.arange(len(order), device=key.device)
    return first[order], number[inverse]


def own_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Rows whose prompts are all their own but share a prefix worth a pass of its own
    (prefix_to_share): prompt_groups' answer with every row its own group, else None (one plain pass)."""
    if not prefix_to_share(prompt_ids, prompt_mask):
        return None
    rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    return rows, rows


def completion_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                      share_prompts: bool = True) -> torch.Tensor:
    """The last layer's hidden states [B, n, d] at the positions that predict the last n tokens of
    each [left-padded prompt | completion] row (positions P-1 .. P+n-2), after the final norm.

    share_prompts: rows with the same prompt (a GRPO group, a multi-turn episode's G episodes, whose
    tokens after the prompt differ) forward it once: the completions follow their prompt's row
    (tree_states), G(P+n) -> P+Gn tokens; a prefix the distinct prompts share goes once
    (prompt_levels), also when every row has a prompt of its own (an SFT batch behind one system
    prompt and tools block: `own_prompts`). Gradients flow through the shared keys and values into the
    prompt's tokens. The positions are those the whole row would have, so every output equals the
    one-pass forward's. Under FSDP every rank runs the same passes (its gathers go in lock step): the
    plain one wherever the ranks' batches would differ. Every pass skips padding in its position-wise
    layers, so the states at padding positions are unspecified: only real positions are read.
    """
    width = input_ids.shape[1] - n_completion
    positions = position_ids(attention_mask)
    groups = prompt_groups(input_ids[:, :width], attention_mask[:, :width]) if share_prompts and width else None
    sharded = is_sharded(model)
    # No prefix pass under FSDP: its last layer's output goes unused, and FSDP gathers a layer's weights
    # for the backward pass only through its outputs (its keys and values would find them freed).
    if groups is None and share_prompts and width and not sharded:
        groups = own_prompts(input_ids[:, :width], attention_mask[:, :width])
    cache = DynamicCache(config=model.config) if groups is not None else None
    if cache is not None and not plain_layers(cache):
        groups = None
    if sharded and len(set(distributed.gather((groups is not None, n_completion > 1)))) > 1:
        groups = None
    if groups is None:
        return states(model, input_ids, attention_mask, positions)[:, width - 1:-1]
    first, number = groups
    common = 0 if sharded else prefix_to_share(input_ids[first, :width], attention_mask[first, :width])
    levels = prompt_levels(input_ids[first, :width], attention_mask[first, :width], positions[first, :width], common)
    if n_completion > 1:  # each row's completion after its prompt, but the last token (only a target)
        levels.append(Level(input_ids[:, width:-1], attention_mask[:, width:-1], positions[:, width:-1], number))
    hidden = tree_states(model, levels, cache)
    prompts = hidden[-2] if n_completion > 1 else hidden[-1]
    last = prompts[:, -1:][number]  # each prompt's last state predicts its rows' first completion token
    return last if n_completion == 1 else torch.cat([last, hidden[-1]], dim=1)


def tree_states(model, levels: Sequence[Level], cache: DynamicCache) -> list[torch.Tensor]:
    """The last layer's hidden states after the final norm [R, T, H] of each of `levels` (llama.Level:
    rows whose tokens follow a row of the level before): rlnotes' own pass over all levels at once
    where it computes the model's (LlamaLayers.tree), else a pass per level after its ancestors' keys
    and values in `cache` (an empty one of plain_layers: `chain`)."""
    own = LlamaLayers.of(model)
    if own is not None:
        return own.tree(levels)
    return chain(model, levels, cache)[0]


def chain(model, levels: Sequence[Level], cache: DynamicCache, logits: bool = False) -> tuple[list, torch.Tensor]:
    """`levels` forwarded one after another into `cache` (plain_layers), each level's rows after the
    cache's rows of their parents: (the `states` of each level, the last with `logits` if asked; the
    attention mask [R, K] of the K columns now cached)."""
    outs, cached = [], None
    for i, level in enumerate(levels):
        mask = level.mask
        if level.parent is not None:
            select_rows(cache, level.parent)  # by index_select, so the rows' gradients add up in the parent
            mask = torch.cat([cached[level.parent], mask], dim=1)
        outs.append(states(model, level.ids, mask, level.positions, cache, logits and i == len(levels) - 1))
        cached = mask
    return outs, cached


# A prefix the distinct prompts share is forwarded once when that saves at least this many tokens:
# through a KV cache (a model rlnotes' own pass does not compute) the prefix is a pass of its own that
# reads every weight once more, which a few dozen saved tokens do not pay for (`python scripts/bench.py
# --shared-prompt` measures it; figures in docs/benchmarks.md). In the own pass it is a level of the one
# pass (LlamaLayers.tree), whose extra cost is an attention call a layer; the same threshold holds there.
MIN_PREFIX_SAVING = 128


def shared_prefix(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """The number of leading real tokens that every left-padded prompt row has in common (a chat
    template's system prompt), at most the shortest prompt's length less one (so each row keeps a
    token of its own, whose hidden state predicts its completion)."""
    lengths = prompt_mask.sum(1)
    shortest = int(lengths.min()) - 1
    if len(prompt_ids) < 2 or shortest < 1:
        return 0
    starts = prompt_ids.shape[1] - lengths  # each row's first real column
    aligned = prompt_ids.gather(1, starts[:, None] + torch.arange(shortest, device=prompt_ids.device))
    differs = (aligned != aligned[:1]).any(0)
    return int(differs.to(torch.int8).argmax()) if bool(differs.any()) else shortest


def prefix_to_share(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """The shared_prefix of the distinct prompts [U, P] when forwarding it once saves at least
    MIN_PREFIX_SAVING tokens, else 0."""
    common = shared_prefix(ids, mask)
    return common if (len(ids) - 1) * common >= MIN_PREFIX_SAVING else 0


def prompt_levels(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, common: int) -> list[Level]:
    """The distinct left-padded prompts [U, P] as levels of a tree pass: themselves, or with a prefix
    of `common` tokens they all share, that prefix as one row and each prompt's remainder after it
    (left-padded to the longest; the tokens keep their whole-row positions, so every output equals
    the plain pass's)."""
    if not common:
        return [Level(ids, mask, positions)]
    n, width = ids.shape
    lengths = mask.sum(1)
    start = width - int(lengths[0])
    prefix = slice(start, start + common)
    tail = int(lengths.max()) - common  # the longest remainder; shorter ones are left-padded to it
    own = torch.arange(width - tail, width, device=ids.device) >= (width - lengths + common)[:, None]
    return [Level(ids[:1, prefix], mask[:1, prefix], positions[:1, prefix]),
            Level(ids[:, -tail:], own.to(mask.dtype), positions[:, -tail:], ids.new_zeros(n))]


def prompt_pass(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                logits: bool = False, common: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The U distinct left-padded prompts [U, P] forwarded into `cache` (for sampling after them):
    (their `states` after the cached columns: hidden states [U, T, H], or with `logits` each
    prompt's next-token logits [U, V]; the attention mask [U, K] of the K columns now cached). A
    prefix of `common` tokens they all share (default: prefix_to_share) goes once (prompt_levels):
    the cache holds [prefix | left-padded remainders], a layout whose mask has its padding in the
    middle."""
    if common is None:
        common = prefix_to_share(ids, mask) if plain_layers(cache) else 0
    outs, cached = chain(model, prompt_levels(ids, mask, positions, common), cache, logits)
    return outs[-1], cached


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                      temperature: float = 1.0, share_prompts: bool = True) -> torch.Tensor:
    """Log-probs [B, n_completion] of the last `n_completion` tokens of each row.

    Rows are [left-padded prompt | completion]; position ids follow the attention mask so
    padding never shifts positions, and only the completion's real tokens reach the LM head (0
    on its padding).
    """
    hidden = completion_states(model, input_ids, attention_mask, n_completion, share_prompts)
    return head_logprobs(hidden, model.get_output_embeddings(), input_ids[:, -n_completion:], temperature,
                         real=attention_mask[:, -n_completion:].bool())[0]
