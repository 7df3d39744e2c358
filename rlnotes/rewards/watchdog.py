"""Calls of a user's code that may hang (reward functions, environments, tools): run in a worker
thread when a time-out bounds them, and watched either way, so that a call still running long
after its usual time is named in one line while it runs.

The watchdog does not stop a call (Python cannot stop a thread, and only the user knows whether a
slow judge is worth waiting for): it says which call the run is waiting for and how to bound it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

from rlnotes.engine.hardware import distributed

# The usual time of a call is the median of the last HANG_WINDOW calls of the same code (known
# from its third call on). A call still running after HANG_FACTOR times that, and at least
# HANG_MIN_S seconds (HANG_MIN_S alone while no usual time is known), is named, once.
HANG_WINDOW, HANG_FACTOR, HANG_MIN_S = 20, 10.0, 60.0


def say_on_stderr(line: str) -> None:
    """A warning line on stderr, from the main process only (every rank runs the same calls)."""
    if distributed.is_main():
        print(f"rlnotes: warning: {line}", file=sys.stderr, flush=True)


@dataclass
class _Running:
    label: str        # what the line calls it: "reward function 'judge'", "environment Guess.step"
    hint: str         # how to bound it
    start: float
    usual: Optional[float]
    due: float        # when it is named (time.monotonic())
    say: Callable[[str], None]


class _Watcher:
    """The calls being watched in this process and the one daemon thread that names them: it
    sleeps until the soonest is due (woken only when a call due sooner comes in)."""

    def __init__(self):
        self.running: Dict[int, _Running] = {}
        self.keys = itertools.count()
        self.changed = threading.Condition()
        self.thread: Optional[threading.Thread] = None
        self.wakes_at = math.inf

    def add(self, call: _Running) -> int:
        with self.changed:
            key = next(self.keys)
            self.running[key] = call
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="rlnotes watchdog", daemon=True)
                self.thread.start()
            if call.due < self.wakes_at:
                self.changed.notify()
        return key

    def remove(self, key: int) -> None:
        with self.changed:
            self.running.pop(key, None)

    def _watch(self) -> None:
        while True:
            with self.changed:
                now = time.monotonic()
                due = [self.running.pop(k) for k, r in list(self.running.items()) if r.due <= now]
                if not due:
                    self.wakes_at = min((r.due for r in self.running.values()), default=math.inf)
                    self.changed.wait(None if self.wakes_at == math.inf else self.wakes_at - now)
                    continue
            for call in due:
                call.say(message(call, time.monotonic()))


_WATCHER = _Watcher()


class Watchdog:
    """Names calls still running long after their usual time (module docstring) through `say`.
    `usual` and `record` keep each name's recent times; `watching(name, label, hint)` watches one
    call (or `start` and `stop`, for a call that ends in another thread)."""

    def __init__(self, say: Callable[[str], None] = say_on_stderr):
        self.say = say
        self._times: Dict[str, deque] = {}

    def usual(self, name: str) -> Optional[float]:
        """The median time of `name`'s recent calls; None before its third."""
        times = self._times.get(name, ())
        return statistics.median(times) if len(times) >= 3 else None

    def record(self, name: str, seconds: float) -> None:
        self._times.setdefault(name, deque(maxlen=HANG_WINDOW)).append(seconds)

    def start(self, name: str, label: str, hint: str) -> int:
        """Watch a call of `name` from now on; returns the key that `stop` takes."""
        now, usual = time.monotonic(), self.usual(name)
        wait = max(HANG_FACTOR * usual, HANG_MIN_S) if usual is not None else HANG_MIN_S
        return _WATCHER.add(_Running(label, hint, now, usual, now + wait, self.say))

    @staticmethod
    def stop(key: int) -> None:
        _WATCHER.remove(key)

    @contextmanager
    def watching(self, name: str, label: str, hint: str) -> Iterator[None]:
        key = self.start(name, label, hint)
        try:
            yield
        finally:
            self.stop(key)


def message(call: _Running, now: float) -> str:
    elapsed = now - call.start
    usual = f", {elapsed / max(call.usual, 1e-9):.0f}x its usual {call.usual:.2g} s" if call.usual is not None else ""
    shown = f"{elapsed:.0f}" if elapsed >= 10 else f"{elapsed:.1f}"
    return f"{call.label} has been running for {shown} s{usual}; the run is waiting for it ({call.hint})"


@dataclass
class Finished:
    """What a call in a worker thread gave: its result or the exception it raised, or done=False
    when it was still running at the time-out."""
    result: object = None
    error: Optional[BaseException] = None
    done: bool = True


def in_thread(fn: Callable[[], object], timeout: Optional[float], name: str) -> Finished:
    """fn() in a daemon thread, waited for at most `timeout` seconds (None: until it returns). A
    call past the time-out is left running in the background until it returns (its result is
    dropped). Whatever fn raises, KeyboardInterrupt and SystemExit included, comes back as `error`."""
    box: Dict[str, object] = {}

    def work() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=work, name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return Finished(done=False)
    return Finished(box.get("result"), box.get("error"))
