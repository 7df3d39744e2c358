"""The reference pass on a spare core, in a process of its own, beside the policy's passes.

hardware.threads=auto gives a small model's passes one thread (rlnotes.engine.hardware.threads): its
products are too small to split over cores. On a machine with more cores one of them then idles while
the policy's pass runs, and the reference pass, which reads only weights that never change (the base
with the adapter off, or a frozen copy), can run there at the same time. A thread would share Python's
global lock with the main thread, which a small model's passes hold between their many short
operations; a forked process has its own, and the weights it reads are the parent's pages, not a copy
(copy-on-write: nobody writes them). It serves one request at a time: rows of token ids in, their
reference log-probs out, through a pipe; the same operations on the same weights, so the same numbers.

Only on Linux (fork); elsewhere, and wherever no core is spare (spare_core), the reference pass runs
in the main process, as it always did. The child ignores Ctrl-C (the parent stops the run), writes
nothing, and ends when the parent closes the pipe or exits.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
import traceback
from typing import Callable, Sequence, Tuple

import torch

from rlnotes.engine.hardware.threads import auto_threads

Rows = Tuple[torch.Tensor, torch.Tensor]    # token ids [B, T] and attention mask [B, T] of one pass
Answer = Tuple[torch.Tensor, float, float]  # log-probs [B, T], the pass's seconds, the seconds waited for it


def spare_core(threads_setting, model: torch.nn.Module, world_size: int, device: torch.device) -> bool:
    """Whether a core is free beside this process's torch thread for the reference pass: on Linux
    and a CPU, hardware.threads=auto gave `model` (the base model) one thread for its size (not for
    OMP_NUM_THREADS=1, a choice of one core), and the process may run on at least two cores per
    process of the run (its CPU affinity, shared among the ranks)."""
    if sys.platform != "linux" or device.type != "cpu" or threads_setting != "auto" or torch.get_num_threads() != 1:
        return False
    if auto_threads(sum(p.numel() for p in model.parameters())) != 1:
        return False
    return len(os.sched_getaffinity(0)) // max(world_size, 1) >= 2


class ReferenceProcess:
    """A forked copy of this process that computes `policy.ref_logprobs` of the rows sent to it."""

    def __init__(self, policy):
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self.pipe, child = context.Pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written again by the child
            stream.flush()
        self.process = context.Process(target=_serve, args=(policy, child, self.pipe), daemon=True,
                                       name="rlnotes-reference")
        self.process.start()
        child.close()
        self.unread = 0  # answers to requests whose caller never asked for them (it raised first)

    def submit(self, passes: Sequence[Rows], n_completion: int, temperature: float) -> Callable[[], Answer]:
        """Start the reference log-probs of each pass's rows, in this thread's CPU autocast; returns
        the function that waits for them: (log-probs [B, T] of the passes' rows in order, seconds the
        pass took in the child, seconds this process waited for them), or raises what it raised."""
        while self.unread:
            self._receive()
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        self.pipe.send(([(ids.numpy(), mask.numpy()) for ids, mask in passes], n_completion, temperature, autocast))
        self.unread += 1
        return functools.cache(self._receive)

    def _receive(self) -> Answer:
        start = time.perf_counter()
        try:
            answer = self.pipe.recv()
        except EOFError:
            raise RuntimeError(f"the reference pass's process ended (exit code {self.process.exitcode}) before "
                               "answering; hardware.threads=1 computes the reference pass in this one") from None
        self.unread -= 1
        if isinstance(answer, str):
            raise RuntimeError(f"the reference pass raised, in its process:\n{answer}")
        return torch.from_numpy(answer[0]), answer[1], time.perf_counter() - start

    def close(self) -> None:
        """End the child: it sees the pipe close and returns."""
        self.pipe.close()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


def _serve(policy, pipe, parents_end) -> None:
    """The child: the reference log-probs of each request, until the parent closes its end of the
    pipe (the child's copy of that end closed first, or it would never see it close)."""
    parents_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    policy.eval()  # the reference is evaluated: no dropout in the base's forward
    while True:
        try:
            passes, n_completion, temperature, autocast = pipe.recv()
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        try:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logprobs = torch.cat([policy.ref_logprobs(torch.from_numpy(ids), torch.from_numpy(mask), n_completion,
                                                          temperature) for ids, mask in passes])
            answer: object = (logprobs.numpy(), time.perf_counter() - start)
        except Exception:
            answer = traceback.format_exc()
        try:
            pipe.send(answer)
        except OSError:  # the parent closed its end meanwhile (a run stopped by Ctrl-C or an error): done
            return
