"""What an algorithm declares about itself, in one object: the registry (rlnotes.algos.registry) is built
from these declarations, and every other floor asks the declaration instead of comparing names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple


@dataclass(frozen=True)
class Shape:
    """The batch arithmetic of one step, from the config: what a batch row is, how many sequences
    the policy scores per batch, and how they split into optimizer steps."""
    unit: str                 # what trainer.batch_size counts: prompts, pairs or rows
    sequences: int            # sequences the policy scores per batch: B*G sampled, 2B for pairs, B rows
    per_update: int           # sequences of one optimizer step (PPO: a minibatch; else the batch)
    per_update_text: str      # those sequences in words, for the micro-batch check's message
    minibatches: int = 1      # optimizer steps per pass over a batch
    updates: int = 1          # optimizer steps per batch
    rounds: int = 1           # sampling rounds a batch may take at most (DAPO's dynamic sampling)
    max_new_tokens: Optional[int] = None  # completion tokens per sequence at most; None without sampling


def _no_check(cfg) -> None:
    return None


@dataclass(frozen=True)
class Algorithm:
    """An algorithm: its config schema, its step and everything the rest of rlnotes needs to know.

    name:        algo.name, the key of the registry (presets such as rloo and dapo are YAML files
                 of conf/algo that set it).
    schema:      the dataclass of its `algo` section (a subclass of core.schema.AlgoConfig).
    train_step:  ctx -> metrics, one step of the algorithm (rlnotes.training.context.Context).
    samples:     whether it samples completions (and so needs a reward) or learns from fixed rows.
    default_task: the built-in task data=auto trains on.
    columns:     the dataset columns it reads.
    shape:       cfg -> Shape, its batch arithmetic.
    check:       cfg -> None, its settings beyond their types (raises ConfigError).
    ranges:      the valid range of each numeric key of its schema ("algo.beta": ">= 0"; the
                 notation of core.checks.RANGES, which holds the other sections'), or the key is
                 in core.checks.CHECKED_ELSEWHERE; its meaning is the schema comment's.
    choices:     its keys that name an option, and the options.
    evaluate:    ctx -> metrics, its own held-out evaluation (trainer.eval_every: DPO's margins, SFT's
                 loss); None: none of its own. The train loop adds the evaluation of generated
                 completions (rlnotes.training.evaluation) when the run's evaluations generate: for
                 an algorithm that samples, always; for another, with eval.generate.
    objective:   the metric sweep.objective=auto optimises when the run evaluates ...
    train_objective: ... and when it does not.
    group_relative: algo section -> whether its advantages are relative to a prompt's group (a
                 group whose rewards are all equal then teaches nothing).
    """
    name: str
    schema: type
    train_step: Callable[[Any], Dict[str, float]]
    samples: bool
    default_task: str
    shape: Callable[[Any], Shape]
    objective: str
    train_objective: str
    evaluate: Optional[Callable[[Any], Dict[str, float]]] = None
    columns: Tuple[str, ...] = ("prompt",)
    check: Callable[[Any], None] = _no_check
    ranges: Dict[str, str] = field(default_factory=dict)
    choices: Dict[str, tuple] = field(default_factory=dict)
    group_relative: Callable[[Any], bool] = lambda algo: False
