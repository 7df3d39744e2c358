"""Calling reward functions as TRL (1.16) calls them: by keyword, each call with its own deep copies
of the inputs (so a function that edits them changes nothing another function or the samples table
sees), a `trainer_state`, and `log_extra`/`log_metric` that collect what it logs. Sync functions
run one after another, then the async ones are awaited side by side on one event loop kept for the
run in its own thread. A time-out bounds each call (rlnotes.rewards.scoring.Rewards says what
becomes of a call past it), and a watchdog names a call still running long after its usual time
(rlnotes.rewards.watchdog).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

from rlnotes.rewards.loading import RewardFn
from rlnotes.rewards.watchdog import Watchdog, in_thread


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


def _failed(error: BaseException) -> BaseException:
    """`error` as a reward function's failure; KeyboardInterrupt (Ctrl-C, or a function that raises
    it) stops the run instead, as it would anywhere else."""
    if isinstance(error, KeyboardInterrupt):
        raise error
    return error


def call_sync(rf: RewardFn, kwargs: dict, timeout: Optional[float]) -> Outcome:
    """One call of a sync function: in this thread, or with a time-out in a worker thread that is
    abandoned (still running) when `timeout` seconds pass."""
    start = time.perf_counter()
    if timeout is None:
        try:
            return Outcome(rf.fn(**kwargs), seconds=time.perf_counter() - start)
        except BaseException as e:  # noqa: BLE001 - a user's function may raise anything (SystemExit, CancelledError)
            return Outcome(error=_failed(e), seconds=time.perf_counter() - start)
    finished = in_thread(lambda: rf.fn(**kwargs), timeout, f"reward {rf.name}")
    seconds = time.perf_counter() - start
    if not finished.done:
        return Outcome(seconds=seconds, timed_out=True)
    return Outcome(finished.result, None if finished.error is None else _failed(finished.error), seconds)


async def _guarded(rf: RewardFn, kwargs: dict) -> Outcome:
    """One awaited call of an async function, on the functions' event loop: whatever it raises
    (SystemExit and KeyboardInterrupt, which would stop the loop, included) comes back in the Outcome."""
    start = time.perf_counter()
    try:
        return Outcome(await rf.fn(**kwargs), seconds=time.perf_counter() - start)
    except BaseException as e:  # noqa: BLE001 - handed to the calling thread
        return Outcome(error=e, seconds=time.perf_counter() - start)


# How the watchdog's line says to bound a reward function's calls.
HANG_HINT = "reward.timeout_s=SECONDS bounds a call; Ctrl-C stops the run and says how to resume"


class Calls:
    """Calls of the configured functions on a batch, each bounded by `timeout` seconds (None: no
    limit) and watched by `watchdog`; the async ones run on one event loop for the whole run, in
    its own thread (as TRL runs them), so that this thread can stop waiting for a call that
    blocks the loop."""

    def __init__(self, timeout: Optional[float], watchdog: Watchdog):
        self.timeout = timeout
        self.watchdog = watchdog
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
                kwargs = self.kwargs(rf, inputs, log, state, offset)
                with self.watchdog.watching(rf.name, f"reward function {rf.name!r}", HANG_HINT):
                    out[i] = call_sync(rf, kwargs, self.timeout)
        awaited = [i for i, rf in enumerate(fns) if rf.awaited]
        if awaited:
            out.update(zip(awaited, self._awaited([fns[i] for i in awaited],
                                                  [self.kwargs(fns[i], inputs, log, state, offset) for i in awaited])))
        return [out[i] for i in range(len(fns))]

    def _awaited(self, fns: List[RewardFn], kwargs: List[dict]) -> List[Outcome]:
        """The async functions' calls side by side on the event loop, waited for at most `timeout`
        seconds in all: a call still running then is cancelled (at its next await) and timed out."""
        loop = self._event_loop()
        start = time.perf_counter()
        futures = []
        for rf, kw in zip(fns, kwargs):
            key = self.watchdog.start(rf.name, f"reward function {rf.name!r}", HANG_HINT)
            future = asyncio.run_coroutine_threadsafe(_guarded(rf, kw), loop)
            future.add_done_callback(lambda _, key=key: self.watchdog.stop(key))
            futures.append(future)
        done, _ = concurrent.futures.wait(futures, timeout=self.timeout)
        out = []
        for future in futures:
            if future in done:
                outcome = future.result()
                out.append(replace(outcome, error=None if outcome.error is None else _failed(outcome.error)))
            else:
                future.cancel()
                out.append(Outcome(seconds=time.perf_counter() - start, timed_out=True))
        return out

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        # One loop for the whole run, as TRL keeps: an async client a function made on its first
        # call (an HTTP session, a rate limiter) stays bound to a loop that is still open.
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="reward functions' event loop", daemon=True).start()
        return self._loop
