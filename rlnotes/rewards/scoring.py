"""Reward functions and their weighted sum.

Every reward function is called as TRL (1.16) calls it, by keyword, so a function written for
TRL works unchanged:

    fn(prompts=..., completions=..., completion_ids=..., <column>=... for every other dataset
       column, trainer_state=..., log_extra=..., log_metric=..., <its configured args>)
       -> list[float | None], one value per completion

`def reward_len(completions, **kwargs)`, `def accuracy(completions, ground_truth, **kwargs)` and
keyword-only signatures all work; a function without **kwargs gets only the names it takes. A
configured arg named like a column replaces it. `completion_ids` are each completion's sampled
token ids, EOS included (None where no tokens are known). `trainer_state` has global_step,
max_steps and epoch; `log_metric(name, value)` logs reward/<function>/<name>; `log_extra(column,
values)` adds a column to the samples table. A prompt is a string, or a list of {role, content}
messages for conversational data; a completion then comes as [{"role": "assistant", "content":
text}], as TRL passes it, and as plain text otherwise. `async def` functions are awaited, side by
side. Functions are named by built-in name, import path ('pkg.mod.fn' or 'pkg.mod:fn', found
from the working directory as `python -m` would) or file ('path/to/rewards.py:fn').

The reward of a sample is the weighted sum sum_k w_k r_k over the functions k that gave it a
number. None means "no opinion" and leaves that function out of the sum; a sample on which every
function says None gets 0, the empty sum (a warning names the first such row, once: it usually
means a column is missing). A function that raises (any BaseException but KeyboardInterrupt), or
gives NaN, inf or a non-number, does not stop the run: a batched call that raises is retried
sample by sample, every failing sample gets `reward.fallback` and is counted in reward/failures,
and the first traceback is shown once. A function that fails on every sample it scores in a batch, or returns other than
one value per completion, stops the run (RewardFailure). `reward.timeout_s` bounds a call (see
Rewards); a call still running long after its usual time is named while it runs (its watchdog).
"""

from __future__ import annotations

import math
import traceback
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from rich.markup import escape

from rlnotes.rewards.calling import CallLog, Calls, Outcome, TrainerState
from rlnotes.core.user_code import first_line
from rlnotes.rewards.loading import RewardFn, build
from rlnotes.rewards.watchdog import Watchdog, say_on_stderr


def in_prompt_format(prompt, completion):
    """A completion shaped like its prompt: [assistant message] for a conversation, else text. An
    episode's messages (a list: the model's turns and what answered them) stay as they are."""
    if isinstance(completion, list):
        return completion
    return [{"role": "assistant", "content": completion}] if isinstance(prompt, list) else completion


class RewardFailure(RuntimeError):
    """A reward function broke its contract (a wrong number of values), gave no usable value for
    any sample of a batch, or timed out on several calls in a row: the run cannot learn."""


# A call warns, once it has returned, when it took SLOW_FACTOR times the function's usual time
# (the median of its recent calls: rlnotes.rewards.watchdog) and at least SLOW_MIN_S seconds.
SLOW_FACTOR, SLOW_MIN_S = 10.0, 1.0
# A function that times out on this many calls in a row stops the run.
TIMEOUTS_IN_A_ROW = 3


def _number(value) -> Optional[float]:
    """`value` as a finite float; None for NaN, inf, a number too large for a float, a string, a
    list or anything else."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except Exception:  # noqa: BLE001 - TypeError, OverflowError, or whatever a user's __float__ raises
        return None
    return number if math.isfinite(number) else None


def _as_list(result) -> Optional[list]:
    """The values of what a function returned when it is a list, a tuple, or a 1-D numpy array or
    tensor; None for anything else (a dict's keys, a set's order or a string's characters are no
    values per completion)."""
    if isinstance(result, (list, tuple)):
        return list(result)
    if isinstance(result, (torch.Tensor, np.ndarray)) and result.ndim == 1:
        return result.tolist()
    return None


def _add_weighted(totals: List[float], scored: List[int], weight: float, values: List[Optional[float]]) -> float:
    """Add weight * value to each sample's total where the function gave a value, count the sample as
    scored there, and return the function's mean over those samples (NaN when it gave none)."""
    for i, v in enumerate(values):
        if v is not None:
            totals[i] += weight * v
            scored[i] += 1
    given = [v for v in values if v is not None]
    return sum(given) / len(given) if given else float("nan")


def _brief(value, width: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's __repr__, or an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[:width - 1] + "…"


class Rewards:
    """The weighted sum of the configured reward functions, robust to a function that fails.

    Each function is called by keyword, as TRL calls it: prompts=, completions=, completion_ids=,
    one keyword per dataset column, trainer_state= (a TrainerState: at_step sets it before a call),
    log_extra=, log_metric=, then its configured args (a function without **kwargs gets only
    the names it takes). Each call gets its own deep copies of these inputs, so a function that
    edits them changes nothing another function or the samples table sees. Sync functions run one
    after another, then the async ones are awaited side by side on one event loop kept for the
    run in its own thread (rlnotes.rewards.calling).

    `reward.timeout_s` bounds each call. A sync function then runs in a worker thread that is
    abandoned at the time-out: Python cannot stop a thread, so it runs on in the background until
    it returns (its result dropped), and may overlap with the next call of the same function. An
    async function is cancelled at its next await; one that blocks without awaiting is timed out
    too, but holds up the loop (and the async calls after it) until it returns. A call past the
    time-out gives every one of its samples the fallback and is not retried; TIMEOUTS_IN_A_ROW such
    calls in a row stop the run.
    """

    def __init__(self, cfg, console=None):
        self.fns = build(cfg)
        self.fallback = float(cfg.fallback)
        self.timeout = cfg.timeout_s
        self.console = console
        self.state = TrainerState()
        # The samples-table columns the functions logged with log_extra in the last call.
        self.extra: Dict[str, list] = {}
        self._said: set = set()
        self._timeouts: Dict[str, int] = {rf.name: 0 for rf in self.fns}
        self.watchdog = Watchdog(self._say)
        self._calls = Calls(self.timeout, self.watchdog)

    def _say(self, line: str) -> None:
        """A warning line on the console (stderr without one): the watchdog's, from its thread."""
        if self.console is None:
            say_on_stderr(line)
        else:
            self.console.print(f"[yellow]{escape(line)}[/]")

    def _once(self, key: str, message: str) -> None:
        """Print `message` the first time `key` comes up in this run."""
        if key not in self._said and self.console is not None:
            self.console.print(message)
        self._said.add(key)

    # -- checking what came back -------------------------------------------------------------

    @staticmethod
    def _values(rf: RewardFn, result, n: int) -> list:
        """The list a call returned; anything but one value per completion breaks the contract."""
        values = _as_list(result)
        if values is None:
            what = (f"a {result.ndim}-D {type(result).__name__}" if isinstance(result, (torch.Tensor, np.ndarray))
                    else type(result).__name__)
            raise RewardFailure(f"reward function {rf.name!r} returned {what}, not a list of one value (a number or "
                                f"None) per completion (a list, a tuple, or a 1-D numpy array or tensor)")
        if len(values) != n:
            raise RewardFailure(f"reward function {rf.name!r} returned {len(values)} values for {n} completions; "
                                "it must return one value (a number or None) per completion")
        return values

    def _sample(self, rf: RewardFn, inputs: dict, log: CallLog, i: int):
        """rf's value for sample i alone; NaN when it raises or times out."""
        one = {k: v[i:i + 1] if v is not None else None for k, v in inputs.items()}
        (outcome,) = self._calls.outcomes([rf], one, log, self.state, offset=i)
        if outcome.error is not None or outcome.timed_out:
            return float("nan")
        return self._values(rf, outcome.result, 1)[0]

    def _watch_time(self, rf: RewardFn, seconds: float) -> None:
        """Warn (once per function) about a call far slower than the function's usual calls."""
        usual = self.watchdog.usual(rf.name)
        if usual is not None:
            if seconds > SLOW_FACTOR * usual and seconds > SLOW_MIN_S:
                self._once(f"slow:{rf.name}", f"[yellow]reward function {rf.name!r} took {seconds:.1f} s on this "
                                              f"batch, {seconds / max(usual, 1e-9):.0f}x its usual {usual:.2g} s; "
                                              "reward.timeout_s=SECONDS bounds a call[/]")
        self.watchdog.record(rf.name, seconds)

    def _settle(self, rf: RewardFn, outcome: Outcome, inputs: dict, log: CallLog) -> tuple[List[Optional[float]], int]:
        """One number or None per sample, failing samples replaced by the fallback, and their count."""
        n = len(inputs["completions"])
        if outcome.timed_out:
            return self._timed_out(rf, n), n
        self._timeouts[rf.name] = 0
        self._watch_time(rf, outcome.seconds)
        if outcome.error is None:
            return self._with_fallback(rf, self._values(rf, outcome.result, n), None)
        return self._with_fallback(rf, self._retried(rf, outcome.error, inputs, log), first_line(outcome.error))

    def _timed_out(self, rf: RewardFn, n: int) -> List[float]:
        """The fallback for the n samples of a call past the time-out; too many in a row stop the run."""
        self._timeouts[rf.name] += 1
        if self._timeouts[rf.name] >= TIMEOUTS_IN_A_ROW:
            raise RewardFailure(f"reward function {rf.name!r} took longer than reward.timeout_s={self.timeout} "
                                f"s on {TIMEOUTS_IN_A_ROW} calls in a row; make it faster or raise the limit")
        self._once(f"timeout:{rf.name}", f"[yellow]reward function {rf.name!r} took longer than "
                                         f"reward.timeout_s={self.timeout} s; its {n} samples get "
                                         f"{self.fallback}[/]")
        return [self.fallback] * n

    def _retried(self, rf: RewardFn, error: BaseException, inputs: dict, log: CallLog) -> list:
        """After a batched call raised: rf's value for each sample alone (NaN where it fails again)."""
        trace = "".join(traceback.format_exception(error))
        self._once("traceback", f"[yellow]reward function {rf.name!r} raised; retrying sample by sample "
                                f"(failures get {self.fallback}). First traceback:[/]\n{trace}")
        return [self._sample(rf, inputs, log, i) for i in range(len(inputs["completions"]))]

    def _with_fallback(self, rf: RewardFn, values: list, error: Optional[str]) -> tuple[List[Optional[float]], int]:
        """The values with each one that is not a finite number replaced by the fallback, and their
        count; a function that gave no finite number at all stops the run (`error`: why, when it raised)."""
        failed = [v for v in values if v is not None and _number(v) is None]
        if failed and len(failed) == sum(v is not None for v in values):
            why = error or f"it returned {_brief(failed[0])}"
            raise RewardFailure(f"reward function {rf.name!r} gave no finite number for any sample of the batch "
                                f"({why}); fix it or remove it from reward.functions")
        if failed and error is None:
            shown = escape(_brief(failed[0]))
            self._once(f"bad:{rf.name}", f"[yellow]reward function {rf.name!r} returned {shown} for {len(failed)} "
                                         f"samples; they get {self.fallback}[/]")
        return [None if v is None else (self.fallback if _number(v) is None else _number(v)) for v in values], \
            len(failed)

    def at_step(self, step: int, steps: int, epoch: float) -> None:
        """The `trainer_state` the next calls get: optimizer steps taken, trainer.steps and epochs of
        the train rows drawn."""
        self.state = TrainerState(step, steps, epoch)

    def fallback_for(self, source: str, values: torch.Tensor, fix: str = "fix its reward") -> tuple[torch.Tensor, int]:
        """Rewards [N] (float32) from `source` (an environment, or the weighted sum) with each NaN or
        inf replaced by the fallback, as a function's values are, and how many were (warned once).
        A source that gave no finite reward at all stops the run, naming it and what to `fix` (a
        NaN would otherwise reach the loss, which blames the learning rate)."""
        bad = ~torch.isfinite(values)
        failed = int(bad.sum())
        if failed and failed == len(values):
            raise RewardFailure(f"{source} gave no finite reward for any sample of the batch ({values[0].item()}); "
                                f"{fix}")
        if failed:
            self._once(f"bad:{source}", f"[yellow]{escape(source)} gave the reward {values[bad][0].item()} for "
                                        f"{failed} of {len(values)} samples; they get {self.fallback}[/]")
        return torch.where(bad, torch.full_like(values, self.fallback), values), failed

    # -- scoring -------------------------------------------------------------------------------

    def score_groups(self, rows: Sequence[dict], completions: Sequence,
                     completion_ids: Optional[Sequence[Sequence[int]]] = None,
                     group_size: int = 1, environments: Optional[list] = None) -> tuple[torch.Tensor, Dict[str, float]]:
        """Rewards and metrics of `group_size` completions per row, each row's next to each other: the
        row's prompt and other columns are repeated for each of its completions. `environments`:
        each episode's environment instance, passed as TRL passes them (multi-turn runs)."""
        prompts = [r["prompt"] for r in rows for _ in range(group_size)]
        columns = {k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
        if environments is not None:
            columns["environments"] = environments
        return self(prompts, completions, columns, completion_ids=completion_ids)

    def __call__(self, prompts: Sequence, completions: Sequence[str], columns: Dict[str, list],
                 completion_ids: Optional[Sequence[Sequence[int]]] = None) -> tuple[torch.Tensor, Dict[str, float]]:
        """Total rewards [N] of the text `completions` and metrics: reward/<name> (the mean of each
        function over the samples it scored), reward/failures (samples that got the fallback) and
        the functions' own log_metric scalars, reward/<name>/<metric> (their mean over the call).
        The columns the functions logged with log_extra are in `self.extra` afterwards."""
        prompts = list(prompts)
        shaped = [in_prompt_format(p, c) for p, c in zip(prompts, completions)]
        ids = [list(i) for i in completion_ids] if completion_ids is not None else None
        inputs = {**columns, "prompts": prompts, "completions": shaped, "completion_ids": ids}
        log = CallLog(len(shaped))
        totals, scored = [0.0] * len(shaped), [0] * len(shaped)
        metrics: Dict[str, float] = {}
        failures = 0
        for rf, outcome in zip(self.fns, self._calls.outcomes(self.fns, inputs, log, self.state)):
            values, failed = self._settle(rf, outcome, inputs, log)
            failures += failed
            metrics[f"reward/{rf.name}"] = _add_weighted(totals, scored, rf.weight, values)
        if 0 in scored and self.fns:
            self._warn_unscored(scored, prompts, shaped, columns)
        # Finite values can sum, or weigh, past float32's largest (3.4e38): those samples fail too.
        total, overflowed = self.fallback_for("the weighted sum of the reward functions", torch.tensor(totals),
                                              "scale the rewards or the weights down")
        metrics["reward/failures"] = failures + overflowed
        metrics.update({name: sum(v) / len(v) for name, v in log.metrics.items()})
        self.extra = log.columns
        return total, metrics

    def _warn_unscored(self, scored: List[int], prompts: list, completions: list, columns: Dict[str, list]) -> None:
        """Once a run: the samples no function scored, and the first of them with its row."""
        i = scored.index(0)
        row = ", ".join(f"{k}={_brief(v[i], 40)}" for k, v in columns.items())
        self._once("unscored", f"[yellow]every reward function said None (no opinion) for {scored.count(0)} of "
                               f"{len(scored)} samples; they get 0. The first is sample {i}: prompt "
                               f"{escape(_brief(prompts[i]))}, completion {escape(_brief(completions[i]))}"
                               + (f", {escape(row)}" if row else "") + ". Check the columns your functions read.[/]")
