"""The sampler shared by every algorithm that samples: G completions of each prompt.

G completions per prompt, batched with left-padded prompts and a KV cache. Each prompt is
encoded once and its cache copied G times; a finished sequence leaves the batch, so no
compute goes to padding after EOS. The log-prob of every sampled token, log softmax(z/T),
comes out of the same pass that sampled it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from transformers import DynamicCache

from rlnotes.engine.policy.kvcache import GrowingLayer, plain_layers
from rlnotes.engine.policy.passes import position_ids, prompt_pass
from rlnotes.engine.rollout import Rollout, left_pad
from rlnotes.engine.sampling.decoder import decoding_step
from rlnotes.engine.sampling.settings import SamplingSettings


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with everything outside the smallest set of mass >= top_p set to -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum - sorted_logits.softmax(-1) >= top_p   # mass before this token already reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


# ---------------------------------------------------------------------------------------------
# Seeded sampling (rollout.per_prompt_seed): the random number behind a completion's t-th token is
# a hash of (the completion's seed, t), so a completion is the same whichever other rows share its
# batch, its process or its device. Integer hashing in int64 tensors gives the same bits on CPU and
# GPU; no product exceeds 2^49, so nothing overflows.

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for uint32 values held in int64, in two 16-bit halves."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32): nearby inputs give unrelated outputs."""
    x = x & _M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def completion_seeds(seed: int, draw: Sequence[int], prompt_index: torch.Tensor, group_size: int) -> torch.Tensor:
    """One seed per completion, [P * G] prompt by prompt: a hash of the run's seed, the draw (e.g.
    (step, round): which batch this is), the prompt's index in the global batch and the sample's
    number within its group."""
    h = mix32(torch.tensor(seed & _M32, dtype=torch.long))
    for d in draw:
        h = mix32(h ^ (d & _M32))
    h = mix32(h ^ prompt_index.long())
    return mix32(h.repeat_interleave(group_size) ^ torch.arange(group_size).repeat(len(prompt_index)))


def seeded_uniform(seeds: torch.Tensor, t: Union[int, torch.Tensor]) -> torch.Tensor:
    """A uniform number in (0, 1) per seed for token position t (float64); t an int, or one per seed
    (an episode's rows count their own tokens)."""
    offset = mix32(torch.as_tensor(t, dtype=torch.long, device=seeds.device) + 0x9E3779B9)
    return (mix32(seeds ^ offset).double() + 0.5) / 2.0**32


# sample_inverse_cdf's blocks: the vocabulary's cumulative sum goes a block of entries at a time, and
# the draws of a row at most DRAW_CHUNK at a time (their blocks' entries: DRAW_CHUNK x CDF_BLOCK floats).
CDF_BLOCK = 256
DRAW_CHUNK = 4096


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: token i of a row where its cumulative probability first reaches a
    uniform number times the row's total. probs [N, V] (rows need not sum to 1), uniform [N] in
    (0, 1) -> [N], or uniform [N, k] -> [N, k] (k draws from each row). One number per draw:
    torch.multinomial draws one per vocabulary entry (a tenth of a step's generation time at a 49k
    vocabulary on a CPU). The sums are float64: in float32 the steps of a 49k-token cumulative sum
    near 1 are about 6e-8, the size of a tail token's probability.

    The cumulative sum goes in two levels, to the same token up to float64 rounding: the sums of
    blocks of CDF_BLOCK entries, cumulated, find the block where the target u * total falls, then
    that block's own entries, cumulated from the mass before it, find the token. A float64 cumulative
    sum over a whole row runs element by element on a CPU: 9 ms for 32 rows of SmolLM2's 49,152
    entries on a 2-core EPYC, against 0.4 ms by blocks (SmolLM2's generation at the bench shape 1.97 ->
    1.79 s, the same tokens; docs/benchmarks.md)."""
    u = uniform.to(probs.device, torch.float64)
    draws = u if u.dim() == 2 else u[:, None]                            # [N, k]
    n, vocab = probs.shape
    if vocab <= CDF_BLOCK:  # one block: the row's own cumulative sum, at a fraction of the operations
        cdf = probs.double().cumsum(-1)
        tokens = torch.searchsorted(cdf, draws * cdf[:, -1:]).clamp(max=vocab - 1)
        return tokens if u.dim() == 2 else tokens.squeeze(-1)
    pad = -vocab % CDF_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).reshape(n, -1, CDF_BLOCK)
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)                # [N, blocks]: the mass up to each block's end
    target = draws * ends[:, -1:]
    block = torch.searchsorted(ends, target).clamp(max=ends.shape[1] - 1)
    before = ends.gather(1, (block - 1).clamp(min=0)).masked_fill(block == 0, 0.0)
    rows = torch.arange(n, device=probs.device)[:, None]
    tokens = torch.empty_like(block)
    for first in range(0, draws.shape[1], DRAW_CHUNK):
        part = slice(first, first + DRAW_CHUNK)
        inner = blocks[rows, block[:, part]].double().cumsum(-1)         # [N, chunk, CDF_BLOCK]
        # at most the block's own total: rounding must not carry a draw past its last token of mass
        rest = torch.minimum(target[:, part] - before[:, part], inner[..., -1])
        tokens[:, part] = block[:, part] * CDF_BLOCK + torch.searchsorted(inner, rest[..., None]).squeeze(-1)
    tokens = tokens.clamp(max=vocab - 1)
    return tokens if u.dim() == 2 else tokens.squeeze(-1)


def sample_seeded(probs: torch.Tensor, seeds: torch.Tensor, t: Union[int, torch.Tensor]) -> torch.Tensor:
    """sample_inverse_cdf with each row's uniform number hashed from its seed and t: probs [N, V],
    seeds [N] -> [N]."""
    return sample_inverse_cdf(probs, seeded_uniform(seeds, t))


def uniforms(n: int, seeds: Optional[torch.Tensor], t: Union[int, torch.Tensor],
             generator: Optional[torch.Generator], device) -> torch.Tensor:
    """The uniform numbers behind n draws (float64, [n]): hashed from `seeds` [n] and t
    (seeded_uniform), else the next n of `generator`'s stream."""
    if seeds is not None:
        return seeded_uniform(seeds, t)
    device = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=device, dtype=torch.float64)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T in float32 (z itself at T = 1: no pass over the vocabulary)."""
    return logits.float() if temperature == 1.0 else logits.float() / temperature


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """p = softmax(z / T) cut to its top-p nucleus (top_p_filter) and renormalised, in float32:
    [N, V] -> [N, V]."""
    return top_p_filter(tempered(logits, temperature), top_p).softmax(-1)


def draw_tokens(logits: torch.Tensor, sampling: SamplingSettings, seeds: Optional[torch.Tensor],
                t: Union[int, torch.Tensor], generator: Optional[torch.Generator],
                uniform: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t of each row from its logits z [N, V], and its log-prob log softmax(z / T) [N]: the
    most likely token (sampling.greedy), or a draw by sample_inverse_cdf with the uniform numbers of
    `seeds` [N] or `generator` (uniforms; `uniform` [N]: those numbers, made beforehand) from
    p = exp(z / T - m), m = max z / T, left unnormalised
    (the inverse CDF scales by each row's total), or from sampling_probs where top-p cuts the
    vocabulary. One pass of exp over the row gives both the draw and the log-prob,

        log softmax(z / T)_i = z_i / T - m - log sum_j exp(z_j / T - m),

    where a log_softmax and a softmax of the same row would take two."""
    z = tempered(logits, sampling.temperature)
    top = z.amax(-1, keepdim=True)
    weights = (z - top).exp_()                                          # [N, V]: p up to each row's total
    if sampling.greedy:
        tokens = z.argmax(-1)
    else:
        probs = weights if sampling.top_p >= 1.0 else sampling_probs(z, 1.0, sampling.top_p)
        if uniform is None:
            uniform = uniforms(len(probs), seeds, t, generator, probs.device)
        tokens = sample_inverse_cdf(probs, uniform)
    return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - top.squeeze(-1) - weights.sum(-1).log()


def stop_ids(model, tokenizer) -> List[int]:
    """The ids that end a completion: the tokenizer's EOS and each EOS id of the model's generation
    config, which some chat models list beside it (an end of turn and an end of text: <|im_end|>
    and <|endoftext|>). transformers' generate stops at the config's ids; TRL 1.16's GRPOTrainer
    and vLLM at both."""
    config = model.generation_config
    listed = config.eos_token_id if config is not None else None
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed]))


def prefill(model, prompts: Sequence[Sequence[int]], pad_id: int, group_size: int, device, room: int = 0):
    """Each prompt (token id lists) forwarded once (a prefix they all share once: passes.prompt_pass),
    its KV cache and last logits then copied for its `group_size` samples: (prompt ids [N, P], mask
    [N, P], the cache, the mask of the cache's columns [N, K], the logits of each row's first token
    [N, V], the position of each row's next token [N]), N = prompts x group_size. `room`: the cache's
    layers keep buffers with that many positions to spare for decoding (GrowingLayer), where every
    layer is a plain one."""
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    cache = DynamicCache(config=model.config)
    if room and plain_layers(cache):
        cache.layers = [GrowingLayer(room) for _ in cache.layers]
    positions = position_ids(prompt_mask)
    logits, cache_mask = prompt_pass(model, prompt_ids, prompt_mask, positions, cache, logits=True)
    if group_size > 1:
        cache.batch_repeat_interleave(group_size)
        logits = logits.repeat_interleave(group_size, dim=0)
        prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        cache_mask = cache_mask.repeat_interleave(group_size, dim=0)
    return prompt_ids, prompt_mask, cache, cache_mask, logits, positions[:, -1].repeat_interleave(group_size) + 1


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Sequence[int]], group_size: int, sampling: SamplingSettings,
             generator: Optional[torch.Generator] = None, eos_ids: Optional[Sequence[int]] = None,
             seeds: Optional[torch.Tensor] = None) -> Rollout:
    """Sample `group_size` completions for each prompt (token id lists) as `sampling` says (greedy:
    the most likely token; draw_tokens), each ending at one of `eos_ids` (default: stop_ids). With
    `seeds` (one per completion, from completion_seeds) each token's uniform number is hashed from
    its seed (seeded_uniform) instead of drawn from `generator`, so a completion does not depend on
    the rest of the batch."""
    max_new_tokens = sampling.max_new_tokens
    device = next(model.parameters()).device
    step = decoding_step(model, sampling.fast_decode)
    pad_id = tokenizer.pad_token_id
    eos = torch.tensor(eos_ids if eos_ids is not None else stop_ids(model, tokenizer), device=device)
    prompt_ids, prompt_mask, cache, attn, logits, next_pos = prefill(model, prompts, pad_id, group_size, device,
                                                                     room=max_new_tokens)
    n = prompt_ids.shape[0]
    alive = torch.arange(n, device=device)     # rows still generating, as indices into the batch
    width = attn.shape[1]
    attn = torch.cat([attn, attn.new_ones((n, max_new_tokens))], dim=1)  # with the columns decoding adds
    # Every seeded uniform number at once, [N, max_new_tokens] (a hash of each seed and position), not
    # some thirty small integer operations per token.
    table = seeded_uniform(seeds.to(device)[:, None], torch.arange(max_new_tokens, device=device)[None]) \
        if seeds is not None and not sampling.greedy else None

    drawn = []  # each step's (rows, their tokens, their log-probs), written into the batch at the end
    for t in range(max_new_tokens):
        tok, logp = draw_tokens(logits, sampling, None, t, generator, table[alive, t] if table is not None else None)
        drawn.append((alive, tok, logp))
        done = torch.isin(tok, eos)
        finished = int(done.sum())
        if t == max_new_tokens - 1 or finished == len(tok):
            break
        if finished:  # finished rows leave the batch and its cache
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            alive, attn, next_pos, tok = alive[keep], attn[keep], next_pos[keep], tok[keep]
        logits = step(tok, attn[:, :width + t + 1], next_pos, cache)
        next_pos = next_pos + 1

    rows, drawn_tokens, drawn_logps = (torch.cat(parts) for parts in zip(*drawn))
    columns = torch.arange(len(drawn), device=device).repeat_interleave(
        torch.tensor([len(step_rows) for step_rows, _, _ in drawn], device=device))
    lengths = torch.bincount(rows, minlength=n)  # each row's tokens: up to its stop token or max_new_tokens
    width = int(lengths.max())
    tokens = torch.full((n, width), pad_id, dtype=torch.long, device=device).index_put_((rows, columns), drawn_tokens)
    logps = torch.zeros((n, width), device=device).index_put_((rows, columns), drawn_logps)
    mask = (torch.arange(width, device=device)[None] < lengths[:, None]).float()
    truncated = ~torch.isin(tokens.gather(1, (lengths - 1)[:, None]).squeeze(-1), eos)
    texts = tokenizer.batch_decode(tokens.tolist(), skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, tokens, mask, logps, texts, truncated)
