"""Calling reward functions as TRL (1.16) calls them: by keyword, each call with its own deep copies
of the inputs (so a function that edits them changes nothing another function or the samples table
sees), a `trainer_state`, and `log_extra`/`log_metric` that collect what it logs. Sync functions
run one after another, then the async ones are awaited together (asyncio.gather) on one event
loop kept for the run. A time-out bounds each call (rlnotes.rewards.scoring.Rewards says what
becomes of a call past it).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

from rlnotes.rewards.loading import RewardFn


@dataclass
class TrainerState:
    """The `trainer_state` a reward function gets (the fields of TRL's TrainerState that reward
    shaping reads): optimizer steps taken, the run's trainer.steps, and epochs of the training
    rows sampled so far."""
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


# Inputs every function gets as the same objects, not copies: the episodes' environment instances
# (TRL's `environments` keyword), whose state is what a function reads.
SHARED_INPUTS = ("environments",)

# Columns of the samples table a reward function's log_extra cannot take.
SAMPLE_FIELDS = ("step", "prompt", "completion", "reward")


@dataclass
class Outcome:
    """What one call of a reward function gave: its result or the exception it raised, and its time."""
    result: object = None
    error: Optional[BaseException] = None
    seconds: float = 0.0
    timed_out: bool = False


class CallLog:
    """What the functions of one scoring call log: extra samples-table columns (log_extra) and
    scalars (log_metric), the latter as reward/<function>/<name>."""

    def __init__(self, n: int):
        self.n = n
        self.columns: Dict[str, list] = {}
        self.metrics: Dict[str, List[float]] = {}

    def extra(self, offset: int, count: int) -> Callable[[str, list], None]:
        """log_extra for a call on samples offset..offset+count (a per-sample retry scores one)."""
        def log_extra(column: str, values) -> None:
            values = list(values)
            if len(values) != count:
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {count} completions")
            if column in SAMPLE_FIELDS:
                raise ValueError(f"log_extra({column!r}, ...): {column!r} is a column of the samples table already")
            self.columns.setdefault(column, [None] * self.n)[offset:offset + count] = values
        return log_extra

    def metric(self, fn_name: str) -> Callable[[str, float], None]:
        def log_metric(name: str, value: float) -> None:
            self.metrics.setdefault(f"reward/{fn_name}/{name}", []).append(float(value))
        return log_metric


def _own_copy(value):
    """A deep copy of `value`, quick for the common lists of strings and numbers."""
    if isinstance(value, list):
        return [v if isinstance(v, (str, int, float, type(None))) else _own_copy(v) for v in value]
    return copy.deepcopy(value)


def call_sync(rf: RewardFn, kwargs: dict, timeout: Optional[float]) -> Outcome:
    """One call of a sync function: in this thread, or with a time-out in a worker thread (_in_thread)."""
    start = time.perf_counter()
    if timeout is None:
        try:
            return Outcome(rf.fn(**kwargs), seconds=time.perf_counter() - start)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's function may raise anything
            return Outcome(error=e, seconds=time.perf_counter() - start)
    return _in_thread(rf, kwargs, timeout, start)


def _in_thread(rf: RewardFn, kwargs: dict, timeout: float, start: float) -> Outcome:
    """The call in a worker thread, abandoned (still running) when `timeout` seconds pass."""
    box: Dict[str, object] = {}

    def work() -> None:
        try:
            box["result"] = rf.fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=work, name=f"reward {rf.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = time.perf_counter() - start
    if worker.is_alive():
        return Outcome(seconds=seconds, timed_out=True)
    if isinstance(box.get("error"), KeyboardInterrupt):
        raise box["error"]
    return Outcome(box.get("result"), box.get("error"), seconds)


async def call_async(rf: RewardFn, kwargs: dict, timeout: Optional[float]) -> Outcome:
    """One awaited call of an async function, cancelled at its next await past `timeout` seconds."""
    start = time.perf_counter()
    task = asyncio.ensure_future(rf.fn(**kwargs))
    done, _ = await asyncio.wait({task}, timeout=timeout)
    seconds = time.perf_counter() - start
    if not done:
        task.cancel()
        return Outcome(seconds=seconds, timed_out=True)
    try:
        return Outcome(task.result(), seconds=seconds)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's function may raise anything
        return Outcome(error=e, seconds=seconds)


class Calls:
    """Calls of the configured functions on a batch, each bounded by `timeout` seconds (None: no
    limit), the async ones on one event loop for the whole run."""

    def __init__(self, timeout: Optional[float]):
        self.timeout = timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None   # runs the async functions

    def kwargs(self, rf: RewardFn, inputs: dict, log: CallLog, state: TrainerState, offset: int) -> dict:
        """rf's own copies of its keyword arguments for a call on samples offset.. of the batch."""
        n = len(inputs["completions"])
        kwargs = {**{k: list(v) if k in SHARED_INPUTS else _own_copy(v) for k, v in inputs.items()},
                  "trainer_state": replace(state),
                  "log_extra": log.extra(offset, n), "log_metric": log.metric(rf.name), **_own_copy(rf.args)}
        return kwargs if rf.accepts is None else {k: v for k, v in kwargs.items() if k in rf.accepts}

    def outcomes(self, fns: Sequence[RewardFn], inputs: dict, log: CallLog, state: TrainerState,
                 offset: int = 0) -> List[Outcome]:
        """One call of each of `fns` on `inputs`: the sync ones in turn, then the async ones together."""
        out: Dict[int, Outcome] = {}
        for i, rf in enumerate(fns):
            if not rf.awaited:
                out[i] = call_sync(rf, self.kwargs(rf, inputs, log, state, offset), self.timeout)
        awaited = [i for i, rf in enumerate(fns) if rf.awaited]
        if awaited:
            async def together():
                return await asyncio.gather(*[call_async(fns[i], self.kwargs(fns[i], inputs, log, state, offset),
                                                         self.timeout) for i in awaited])
            # One loop for the whole run, as TRL keeps: an async client a function made on its first
            # call (an HTTP session, a rate limiter) stays bound to a loop that is still open.
            self._loop = self._loop or asyncio.new_event_loop()
            out.update(zip(awaited, self._loop.run_until_complete(together())))
        return [out[i] for i in range(len(fns))]
