"""Fixed rows of a run's data as model inputs, for the algorithms that learn from a dataset instead
of sampling (DPO, SFT, reward models) and the SFT warm-up: (prompt, completion) rows through
rlnotes.engine.sequences.encode with the model's prompt format, conversations (a `messages`
column) as the episodes render them (rlnotes.agents.rendering), and the likelihood of what they
demonstrate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from rlnotes.agents.rendering import Renderer, conversation_tokens
from rlnotes.engine.hardware import distributed
from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.sequences import Sequences, encode, pack
from rlnotes.notes import aggregate
from rlnotes.training.batching import batch_totals, micro_batch_weight, micro_batches, pass_tokens, token_budget

if TYPE_CHECKING:
    from rlnotes.agents.multi_turn import MultiTurn
    from rlnotes.engine.policy.policy import Policy
    from rlnotes.training.context import Model, Run


def encode_rows(model: Model, rows, key: Optional[str]) -> Sequences:
    """`encode` of the rows' prompts and their `key` column, in the model's prompt format (key None:
    the first half of `rows` gives its `chosen` column, the second half `rejected`)."""
    completions = [r[key] for r in rows] if key else \
        [r["chosen"] for r in rows[:len(rows) // 2]] + [r["rejected"] for r in rows[len(rows) // 2:]]
    fmt = model.prompt_format
    return encode(model.policy.tokenizer, [r["prompt"] for r in rows], completions, model.device,
                  fmt.chat_template, fmt.system_prompt)


def demonstration(row, columns: Sequence[str]):
    """The row's demonstration: the value of the first of `columns` it holds, text (the completion
    of its prompt) or a conversation (a list of messages)."""
    return next(row[c] for c in columns if row.get(c) is not None)


def encode_demonstrations(model: Model, rows, columns: Sequence[str],
                          multi_turn: Optional[MultiTurn] = None) -> Sequences:
    """The rows' demonstrations (`demonstration`) as one batch: a text one after the row's prompt, in
    the model's prompt format (encode_rows), a conversation as an episode of the run's `multi_turn`
    side renders it (the tools of the environment its row chose described), its assistant turns alone
    carrying loss (conversation_tokens)."""
    tokenizer, fmt = model.policy.tokenizer, model.prompt_format
    renderers: Dict[Optional[str], Renderer] = {}
    eos = [tokenizer.eos_token_id]
    prompts, completions, masks = [], [], []
    for i, row in enumerate(rows):
        shown = demonstration(row, columns)
        if isinstance(shown, str):
            (prompt,) = fmt.encode(tokenizer, [row["prompt"]])
            ids = tokenizer(shown, add_special_tokens=False)["input_ids"] + eos
            mask = [1.0] * len(ids)
        else:
            name = multi_turn.environment_of(row, f"row {i + 1} of the demonstrations") if multi_turn else None
            if name not in renderers:
                renderers[name] = Renderer.of(tokenizer, fmt.chat_template, multi_turn.schemas(name) if multi_turn else ())
            prompt, ids, mask = conversation_tokens(renderers[name], shown, fmt.system_prompt)
        prompts.append(prompt)
        completions.append(ids)
        masks.append(mask)
    return pack(prompts, completions, tokenizer.pad_token_id, model.device, masks)


def nll(policy: Policy, seqs: Sequences, aggregation: str) -> torch.Tensor:
    """The negative log-likelihood of the completions of `seqs` under the policy, aggregated over
    their tokens (rlnotes.notes.AGGREGATIONS; token-mean: every token weighs the same): a scalar."""
    logp = policy.logprobs(seqs.input_ids, seqs.attention_mask, seqs.n_completion)
    return aggregate(-logp, seqs.completion_mask, aggregation)


def nll_backward(model: Model, run: Run, seqs: Sequences, aggregation: str) -> float:
    """The gradient of the batch's aggregated NLL (`nll`), micro-batch by micro-batch (the model's
    batching): each micro-batch's loss weighted by its share of the global batch's. Returns the
    batch's loss (all ranks'); its time is time/policy_s."""
    totals = batch_totals(seqs.completion_mask)  # the global batch's tokens and rows
    model.policy.train()
    loss_sum = 0.0
    with run.timed("policy"):
        for idx in sequence_micro_batches(model, seqs):
            chunk = seqs.select(idx)
            loss = nll(model.policy, chunk, aggregation)
            weight = micro_batch_weight(aggregation, chunk.completion_mask, totals)
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
    return distributed.sum_over_ranks([loss_sum])[0]  # the ranks' shares of the batch's loss


def encode_pairs(model: Model, rows) -> Sequences:
    """Preference pairs as one batch: chosen completions in the first half, rejected in the second."""
    return encode_rows(model, rows + rows, None)


def _sequence_tokens(policy: Policy, seqs: Sequences, trimmed: bool):
    n = seqs.n_completion
    return pass_tokens(seqs.input_ids[:, :-n], seqs.attention_mask[:, :-n], seqs.real, policy.share_prompts, trimmed,
                       prefix=not is_sharded(policy.model))


def sequence_micro_batches(model: Model, seqs: Sequences) -> List[torch.Tensor]:
    """`micro_batches` of the rows of `seqs` as the model's batching cuts them (micro_batch_size, else
    the token budget), each chunk as wide as the batch (Sequences.select keeps the width)."""
    trainer = model.batching
    budget = None if trainer.micro_batch_size else token_budget(trainer, model.policy.model)
    if budget is None:  # no token counts needed
        return micro_batches(len(seqs.input_ids), trainer.micro_batch_size)
    return micro_batches(len(seqs.input_ids), None, budget, _sequence_tokens(model.policy, seqs, trimmed=False),
                         most=seqs.input_ids.numel())


def pair_micro_batches(model: Model, rows) -> List[Tuple[torch.Tensor, Sequences]]:
    """`micro_batches` of preference pairs as the model's batching cuts them, each chunk with its
    pairs encoded on their own (encode_pairs: chosen and rejected in one pass, padded to the chunk's
    longest completion). The token budget counts a chunk's prompts as wide as the batch's, an upper
    bound; the batch is encoded once when it is one chunk."""
    trainer, budget = model.batching, token_budget(model.batching, model.policy.model)
    encoded = lambda idx: encode_pairs(model, [rows[i] for i in idx])  # noqa: E731
    if trainer.micro_batch_size or budget is None:
        return [(idx, encoded(idx)) for idx in micro_batches(len(rows), trainer.micro_batch_size)]
    seqs, n = encode_pairs(model, rows), len(rows)
    tokens = _sequence_tokens(model.policy, seqs, trimmed=True)
    chunks = micro_batches(n, None, budget, lambda idx: tokens(torch.cat([idx, idx + n])), most=seqs.input_ids.numel())
    return [(chunks[0], seqs)] if len(chunks) == 1 else [(idx, encoded(idx)) for idx in chunks]
