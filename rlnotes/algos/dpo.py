"""DPO (Rafailov et al. 2023, Direct Preference Optimization), as in the notes.

For each batch of preference pairs (x, y_w, y_l), micro-batch by micro-batch:
  1. log pi_ref(y|x), summed over the completion's tokens, for y_w and y_l: a pass of the base
     model with the adapter off, or a look-up in a table made once (algo.precompute_ref);
  2. log pi(y|x) for y_w and y_l in one forward pass of the policy (both halves in one batch);
  3. minimise the mean over pairs of -log sigma(beta [log pi/pi_ref (y_w) - log pi/pi_ref (y_l)])
     (Eq. 7), one optimizer step per batch;
  4. report the implicit rewards r = beta log pi/pi_ref (Eq. 5), how often r(y_w) > r(y_l) (strict, as
     TRL counts it) and how often they tie exactly, on the batch and, every trainer.eval_every steps,
     on held-out pairs (the train loop's schedule: before the first step, then after every N steps and
     the last). Before the first update the policy is the reference: every r is exactly 0, every pair
     a tie, and the accuracy 0 (dpo/ties, eval/dpo_ties: 1).
With several processes each rank takes 1/N of the pairs; every mean is over the global batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from rlnotes.core.algorithm import Algorithm, Shape
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import AlgoConfig
from rlnotes.data.tasks import Row
from rlnotes.engine.hardware import distributed
from rlnotes.engine.sequences import Sequences, summed_logprobs
from rlnotes.notes import DPO_LOSS_TYPES, dpo_implicit_rewards, dpo_loss
from rlnotes.training.batching import micro_batches, row_totals
from rlnotes.training.context import Context, Model, Run
from rlnotes.training.offline import encode_pairs, pair_micro_batches
from rlnotes.training.optimizer import optimizer_step
from rlnotes.training.sampling import answered, next_rows


@dataclass
class DPOConfig(AlgoConfig):
    name: str = "dpo"
    # The strength of DPO's implicit KL; its loss is flat at 0 and IPO's divides by it. The implicit
    # reward is beta log pi/pi_ref (Rafailov et al. 2023 use 0.1 and 0.5).
    beta: float = 0.1
    # sigmoid (the paper's -log sigma(beta h)) or ipo (Azar et al. 2023: (h - 1/(2 beta))^2).
    loss_type: str = "sigmoid"
    # The probability that a pair's label is flipped (conservative DPO); 0 is the paper's loss.
    label_smoothing: float = 0.0
    # Compute the reference log-probs of the whole train set once at the start instead of one
    # reference pass per step: same loss, one forward per step saved once rows repeat.
    precompute_ref: bool = False


def ref_logprobs(model: Model, table: Optional[Dict[tuple, tuple]], rows: List[Row], seqs: Sequences) -> torch.Tensor:
    """[2n] summed reference log-probs of `encode_pairs(rows)`: from the `table` (precompute_reference)
    or, without one, a fresh pass of the model's reference."""
    if table is None:
        logp = model.policy.ref_logprobs(seqs.input_ids, seqs.attention_mask, seqs.n_completion)
        return summed_logprobs(logp, seqs)
    keys = [_key(r) for r in rows]
    return torch.tensor([table[k][0] for k in keys] + [table[k][1] for k in keys], device=model.device)


def reference_beside(model: Model, run: Run, table: Optional[Dict[tuple, tuple]], rows: List[Row],
                     seqs: Sequences) -> Callable[[], torch.Tensor]:
    """ref_logprobs, from the table or in the spare core's process beside the policy's pass that
    follows (model.reference_process), else computed now: the function that gives them."""
    process = model.reference_process() if table is None else None
    if process is None:
        with run.timed("reference"):
            ref = ref_logprobs(model, table, rows, seqs)
        return lambda: ref
    answer = process.submit([(seqs.input_ids, seqs.attention_mask)], seqs.n_completion, 1.0)
    return functools.cache(lambda: summed_logprobs(answered(run, answer), seqs))


def _key(row: Row) -> tuple:
    """A pair's table key; a conversational prompt (a list of messages) as its repr, which hashes."""
    return repr(row["prompt"]), row["chosen"], row["rejected"]


def precompute_reference(model: Model, train_rows: List[Row], chunk_size: int) -> Dict[tuple, tuple]:
    """Reference log-probs of every distinct train pair, made once: the reference never changes,
    so this replaces the per-step no-grad pass over 2B sequences by one pass over the train set
    (a win once training sees pairs more than once; it costs memory of two floats per pair).
    With several processes each rank scores 1/N of the pairs (parts made equal by repeating a few
    pairs, so that FSDP's lock-step passes line up) and every rank gets the whole table."""
    unique = list({_key(r): r for r in train_rows}.values())
    padded = [unique[i % len(unique)] for i in range(len(unique) + (-len(unique)) % distributed.world_size())]
    table: Dict[tuple, tuple] = {}
    mine = distributed.shard(padded)
    for idx in micro_batches(len(mine), chunk_size):
        chunk = [mine[i] for i in idx]
        seqs = encode_pairs(model, chunk)
        ref = ref_logprobs(model, None, chunk, seqs).tolist()
        for i, r in enumerate(chunk):
            table[_key(r)] = (ref[i], ref[len(chunk) + i])
    return {k: v for part in distributed.gather(table) for k, v in part.items()}


@torch.no_grad()
def evaluate(ctx: Context) -> Dict[str, float]:
    """Held-out implicit-reward margin and pairwise accuracy on the first eval.size pairs (all: null)."""
    cfg, model = ctx.cfg, ctx.model
    rows = ctx.data.eval_rows[:cfg.eval.size]
    model.policy.eval()
    margins = []
    refs = ctx.run.cache.setdefault("eval_ref", {})  # the reference never changes: one pass per eval chunk
    for i, idx in enumerate(micro_batches(len(rows), cfg.trainer.micro_batch_size or cfg.trainer.batch_size)):
        chunk = [rows[j] for j in idx]
        seqs = encode_pairs(model, chunk)
        if i not in refs:
            refs[i] = summed_logprobs(model.policy.ref_logprobs(seqs.input_ids, seqs.attention_mask,
                                                                seqs.n_completion), seqs)
        ref = refs[i]
        logp = summed_logprobs(model.policy.logprobs(seqs.input_ids, seqs.attention_mask, seqs.n_completion), seqs)
        r = dpo_implicit_rewards(logp, ref, cfg.algo.beta)
        margins.append(r[:len(chunk)] - r[len(chunk):])
    margin = torch.cat(margins)
    return {"eval/dpo_margin": float(margin.mean()), "eval/dpo_accuracy": float((margin > 0).float().mean()),
            "eval/dpo_ties": float((margin == 0).float().mean())}


def train_step(ctx: Context) -> Dict[str, float]:
    cfg, algo, model, run = ctx.cfg, ctx.cfg.algo, ctx.model, ctx.run
    policy = model.policy
    metrics: Dict[str, float] = {}
    if algo.precompute_ref and "ref" not in run.cache:
        with run.timed("reference"):
            run.cache["ref"] = precompute_reference(model, ctx.data.sampler.rows,
                                                    cfg.trainer.micro_batch_size or cfg.trainer.batch_size)

    rows = next_rows(ctx.data.sampler)
    totals = row_totals(len(rows))  # the global batch's pairs
    sums = {"loss": 0.0, "dpo/chosen_reward": 0.0, "dpo/rejected_reward": 0.0, "dpo/margin": 0.0,
            "dpo/accuracy": 0.0, "dpo/ties": 0.0}
    tokens = 0.0
    for idx, seqs in pair_micro_batches(model, rows):
        chunk, share = [rows[i] for i in idx], len(idx) / totals.rows  # the chunk's share of the global batch
        n = len(chunk)
        # 1. Reference log-probs (no grad), on a spare core beside step 2 where there is one.
        reference = reference_beside(model, run, run.cache.get("ref"), chunk, seqs)
        # 2. Policy log-probs of chosen and rejected in one pass.
        policy.train()
        with run.timed("policy"):
            logp = summed_logprobs(policy.logprobs(seqs.input_ids, seqs.attention_mask, seqs.n_completion), seqs)
            # 3. The DPO loss, its share of the batch mean.
            ref = reference()
            out = dpo_loss(logp[:n], logp[n:], ref[:n], ref[n:], beta=algo.beta, loss_type=algo.loss_type,
                           label_smoothing=algo.label_smoothing)
            loss = out.loss.mean()
            (loss * share).backward()
        # 4. Implicit rewards of the batch as it was before the update.
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        for key, value in (("loss", loss.detach()), ("dpo/chosen_reward", chosen.mean()),
                           ("dpo/rejected_reward", rejected.mean()), ("dpo/margin", (chosen - rejected).mean()),
                           ("dpo/accuracy", (chosen > rejected).float().mean()),
                           ("dpo/ties", (chosen == rejected).float().mean())):
            sums[key] += float(value) * share
        tokens += seqs.tokens()
    metrics.update(distributed.sum_shares(sums), **{"perf/tokens": tokens})  # tokens: summed by the train loop
    metrics.update(optimizer_step(model, run, ctx.out.console))
    return metrics


def check(cfg) -> None:
    if cfg.algo.loss_type == "ipo" and cfg.algo.label_smoothing != 0:
        raise ConfigError("algo.label_smoothing applies to algo.loss_type=sigmoid only; set it to 0 for ipo")


def shape(cfg) -> Shape:
    b = cfg.trainer.batch_size
    return Shape("pairs", 2 * b, b, "pairs of a step (trainer.batch_size)")


ALGORITHM = Algorithm(name="dpo", schema=DPOConfig, train_step=train_step, samples=False,
                      default_task="arith_pairs", columns=("prompt", "chosen", "rejected"), shape=shape, check=check,
                      evaluate=evaluate, objective="eval/dpo_accuracy", train_objective="dpo/accuracy",
                      choices={"algo.loss_type": DPO_LOSS_TYPES},
                      ranges={"algo.beta": "> 0", "algo.label_smoothing": "[0, 0.5)"})
