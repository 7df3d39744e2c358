"""Multi-turn episodes, batched: the model's turns and the environment's observations between them.

An episode starts from its prompt and alternates: the model samples a turn (until its EOS, the
per-turn token limit or the episode's budget), then `respond` gets the turn and gives the token
ids of the observation that follows it (tool results or the environment's reply, rendered as the
chat template renders them, ending with the cue of the next assistant turn), or None when the
episode is over. All episodes of a batch run side by side, whatever turn each has reached:

- A round is one model turn of every episode still running. A row that ends its turn leaves the
  decode batch at once, its rows of the KV cache parked, so no compute goes to finished turns.
- Between rounds, the parked caches of the episodes that go on are stacked again (right-padded
  to the longest), and each observation is prefilled in one batched pass behind its episode's
  cache, left-padded, so every row's last column is real. Nothing is encoded twice: the turn's
  last sampled token and the observation are the only new tokens of that pass.
- Padding inside the cache is masked out and skipped by the position ids, so the positions and
  keys are those of the compacted sequence [prompt | turn 1 | observation 1 | turn 2 | ...] that
  training forwards again: the log-probs sampled here are the ones training recomputes.

The result is a Rollout whose completion is the compacted episode: `completion_mask` marks the
model's tokens (the only ones with loss, KL, entropy and length), `completion_attn` every real one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlnotes.engine.model.loading import context_length
from rlnotes.engine.policy.kvcache import plain_layers
from rlnotes.engine.rollout import Rollout, left_pad
from rlnotes.engine.sampling.decoder import Step, decoding_step
from rlnotes.engine.sampling.generate import draw_tokens, prefill, stop_ids
from rlnotes.engine.sampling.settings import EpisodeLimits, SamplingSettings

# respond(rows, turns, last) -> one observation per row: token ids to prefill, or None (the episode
# ends). `turns` are the token ids of the turn each row's model just took (EOS included); `last`
# says the episode ends whatever the answer (its turn was cut, or it took rollout.max_turns), so the
# environment can score that turn without producing an observation.
Respond = Callable[[List[int], List[List[int]], List[bool]], List[Optional[List[int]]]]


@dataclass
class EpisodeTokens:
    """One episode's tokens so far, after its prompt."""
    ids: List[int] = field(default_factory=list)
    model_mask: List[float] = field(default_factory=list)    # 1.0 on the model's tokens, 0.0 on observations
    logps: List[float] = field(default_factory=list)
    turns: int = 0
    truncated: bool = False


@dataclass
class _Parked:
    """Rows that ended their turn this round: their KV cache, attention mask and the token each
    sampled last (not yet in the cache), until the round ends."""
    rows: List[int]
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    attn: torch.Tensor
    last: torch.Tensor
    pos: torch.Tensor    # the position of each row's last token


class _Batch:
    """The rows that are sampling a turn: their KV cache, attention mask and next positions."""

    def __init__(self, rows: torch.Tensor, cache: DynamicCache, attn: torch.Tensor, next_pos: torch.Tensor):
        self.rows, self.cache, self.attn, self.next_pos = rows, cache, attn, next_pos

    def park(self, done: torch.Tensor, tokens: torch.Tensor) -> _Parked:
        """Take the rows where `done` out of the batch (and its cache), keeping what they had."""
        idx = done.nonzero().squeeze(-1)
        parked = _Parked(self.rows[idx].tolist(), [layer.keys[idx] for layer in self.cache.layers],
                         [layer.values[idx] for layer in self.cache.layers], self.attn[idx], tokens[idx],
                         self.next_pos[idx])
        keep = (~done).nonzero().squeeze(-1)
        self.cache.batch_select_indices(keep)
        self.rows, self.attn, self.next_pos = self.rows[keep], self.attn[keep], self.next_pos[keep]
        return parked


def _unpark(model, parked: List[_Parked], going: Dict[int, List[int]], pad_id: int) -> tuple[_Batch, torch.Tensor]:
    """The rows in `going` (row -> its observation's ids) back in one batch: their parked caches
    right-padded to the longest, then [last sampled token | observation] of each, left-padded,
    prefilled in one pass. Returns the batch and the logits of each row's next token."""
    widest = max(p.attn.shape[1] for p in parked)
    rows, attn, keys, values, blocks, start = [], [], None, None, [], []
    for p in parked:
        sel = [j for j, r in enumerate(p.rows) if r in going]
        if not sel:
            continue
        pad = widest - p.attn.shape[1]
        rows += [p.rows[j] for j in sel]
        attn.append(F.pad(p.attn[sel], (0, pad)))
        k = [F.pad(x[sel], (0, 0, 0, pad)) for x in p.keys]
        v = [F.pad(x[sel], (0, 0, 0, pad)) for x in p.values]
        keys = k if keys is None else [torch.cat([a, b]) for a, b in zip(keys, k)]
        values = v if values is None else [torch.cat([a, b]) for a, b in zip(values, v)]
        blocks += [[int(p.last[j])] + going[p.rows[j]] for j in sel]
        start.append(p.pos[sel])
    device = attn[0].device
    cache = DynamicCache(config=model.config)
    for layer, k, v in zip(cache.layers, keys, values):
        layer.update(k, v)
    block, block_mask = (t.to(device) for t in left_pad(blocks, pad_id))
    row_ids = torch.tensor(rows, device=device)
    start = torch.cat(start)                                # the position of each row's last sampled token
    lengths = block_mask.sum(-1)
    pos = (start + lengths)[:, None] - block.shape[1] + torch.arange(block.shape[1], device=device)[None]
    pos = torch.where(block_mask.bool(), pos, 0)
    attn = torch.cat([torch.cat(attn), block_mask], dim=1)
    logits = model(input_ids=block, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    return _Batch(row_ids, cache, attn, start + lengths), logits


@torch.no_grad()
def generate_episodes(model, tokenizer, prompts: Sequence[Sequence[int]], group_size: int, respond: Respond,
                      sampling: SamplingSettings, limits: EpisodeLimits,
                      generator: Optional[torch.Generator] = None, eos_ids: Optional[Sequence[int]] = None,
                      seeds: Optional[torch.Tensor] = None) -> Rollout:
    """`group_size` episodes per prompt (token id lists), each of at most `limits.max_turns` model
    turns of at most `sampling.max_new_tokens` tokens and `limits.max_episode_tokens` tokens after
    its prompt (the model's and the observations'), and within the model's context
    (context_length): a turn or an observation that would pass it ends the episode, truncated.
    Sampling as rlnotes.engine.sampling.generate.generate (`seeds` count each episode's own model
    tokens). Returns the compacted episodes (module docstring)."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    eos = torch.tensor(eos_ids if eos_ids is not None else stop_ids(model, tokenizer), device=device)
    budget = budgets(prompts, group_size, limits.max_episode_tokens, context_length(model))
    prompt_ids, prompt_mask, cache, cache_mask, logits, next_pos = prefill(model, prompts, pad_id, group_size,
                                                                           device)
    if not plain_layers(cache):
        raise ValueError("multi-turn episodes need a model whose KV cache is one plain layer per layer "
                         "(no sliding windows); this model's is not")
    n = prompt_ids.shape[0]
    episodes = [EpisodeTokens() for _ in range(n)]
    batch = _Batch(torch.arange(n, device=device), cache, cache_mask, next_pos)
    draw = _Draw(sampling, eos, budget, seeds.to(device) if seeds is not None else None,
                 torch.zeros(n, dtype=torch.long, device=device), generator)
    step = decoding_step(model, sampling.fast_decode)

    while len(batch.rows):
        parked, logits = _sample_turn(step, batch, logits, episodes, draw)
        going = between_turns(episodes, [r for p in parked for r in p.rows], respond, limits.max_turns, budget)
        if not going:
            break
        batch, logits = _unpark(model, parked, going, pad_id)
    return episode_rollout(tokenizer, prompt_ids, prompt_mask, episodes, device)


def budgets(prompts: Sequence[Sequence[int]], group_size: int, max_episode_tokens: Optional[int],
            context: Optional[int]) -> List[float]:
    """Tokens each episode (group_size per prompt, next to each other) may have after its prompt:
    max_episode_tokens, and what the `context` leaves after the prompt (None: no bound)."""
    most = max_episode_tokens if max_episode_tokens is not None else float("inf")
    room = [most if context is None else min(most, context - len(p)) for p in prompts]
    return [r for r in room for _ in range(group_size)]


def between_turns(episodes: List[EpisodeTokens], rows: List[int], respond: Respond, max_turns: int,
                  budget: Sequence[float]) -> Dict[int, List[int]]:
    """After `rows` ended a turn: ask `respond` for their observations and add each to its episode
    (no loss, no log-prob). Returns the rows that go on, with their observation's ids; an episode
    ends at its environment's word, at max_turns, after a cut turn, or when the observation and
    one more token would not fit its budget (`budget[row]`; then it counts as truncated)."""
    turns = [episodes[r].ids[-_turn_length(episodes[r]):] for r in rows]
    last = [episodes[r].truncated or episodes[r].turns >= max_turns for r in rows]
    going = {}
    for r, stop, obs in zip(rows, last, respond(rows, turns, last)):
        ep = episodes[r]
        if stop or obs is None:
            continue
        if len(ep.ids) + len(obs) + 1 > budget[r]:
            ep.truncated = True
            continue
        going[r] = list(obs)
        ep.ids += obs
        ep.model_mask += [0.0] * len(obs)
        ep.logps += [0.0] * len(obs)
    return going


def _turn_length(ep: EpisodeTokens) -> int:
    """Tokens of the episode's last model turn: the model's tokens after the last observation."""
    k = 0
    for m in reversed(ep.model_mask):
        if not m:
            break
        k += 1
    return k


@dataclass
class _Draw:
    """What every turn of a batch's episodes draws its tokens with: the settings, the EOS ids, each
    episode's token budget (`budgets`), its seed (or None: from `generator`) and its model tokens so
    far, the seed's clock."""
    sampling: SamplingSettings
    eos: torch.Tensor
    budget: Sequence[float]
    seeds: Optional[torch.Tensor]
    counts: torch.Tensor
    generator: Optional[torch.Generator]


def _sample_turn(step: Step, batch: _Batch, logits, episodes: List[EpisodeTokens], draw: _Draw):
    """One turn of every row in `batch`: tokens until each row's EOS, max_new_tokens or its budget;
    a finished row is parked at once. Returns the parked rows (every row, when the turn ends)."""
    s, eos, budget, seeds, counts = draw.sampling, draw.eos, draw.budget, draw.seeds, draw.counts
    max_new_tokens = s.max_new_tokens
    parked: List[_Parked] = []
    for r in batch.rows.tolist():
        episodes[r].turns += 1
    for t in range(max_new_tokens):
        tok, logp = draw_tokens(logits, s, seeds[batch.rows] if seeds is not None else None, counts[batch.rows],
                                draw.generator)
        counts[batch.rows] += 1
        ended = torch.isin(tok, eos)
        for r, token, lp, end in zip(batch.rows.tolist(), tok.tolist(), logp.tolist(), ended.tolist()):
            ep = episodes[r]
            ep.ids.append(token)
            ep.model_mask.append(1.0)
            ep.logps.append(lp)
            if not end and (t == max_new_tokens - 1 or len(ep.ids) >= budget[r]):
                ep.truncated = True
        cut = torch.tensor([episodes[r].truncated for r in batch.rows.tolist()], device=tok.device)
        done = ended | cut
        if bool(done.any()):
            parked.append(batch.park(done, tok))
            tok = tok[~done]
        if not len(batch.rows):
            break
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((batch.attn.shape[0], 1))], dim=1)
        logits = step(tok, batch.attn, batch.next_pos, batch.cache)
        batch.next_pos = batch.next_pos + 1
    return parked, logits


def episode_rollout(tokenizer, prompt_ids, prompt_mask, episodes: List[EpisodeTokens], device) -> Rollout:
    """The compacted episodes as a Rollout (completion = everything after the prompt); prompt_ids
    and prompt_mask: [N, P], one left-padded row per episode."""
    pad_id = tokenizer.pad_token_id
    width = max(max(len(ep.ids) for ep in episodes), 1)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    model_mask, logps, attn = (torch.zeros((len(episodes), width)) for _ in range(3))
    for i, ep in enumerate(episodes):
        k = len(ep.ids)
        ids[i, :k] = torch.tensor(ep.ids, dtype=torch.long)
        model_mask[i, :k] = torch.tensor(ep.model_mask)
        logps[i, :k] = torch.tensor(ep.logps)
        attn[i, :k] = 1.0
    texts = tokenizer.batch_decode([ep.ids for ep in episodes], skip_special_tokens=True)
    truncated = torch.tensor([ep.truncated for ep in episodes])
    return Rollout(prompt_ids, prompt_mask, ids.to(device), model_mask.to(device), logps.to(device), texts,
                   truncated.to(device), completion_attn=attn.to(device))
