"""Stopping a run on a signal (SIGINT, SIGTERM, SIGHUP) at a step boundary, and the command that resumes it.

The train loop saves the boundary state (rlnotes.run.checkpoint.capture) of the step where a signal
stopped it; `resume_command` is the line that continues the run from there.
"""

from __future__ import annotations

import shlex
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from hydra.core.hydra_config import HydraConfig
from rich.markup import escape

from rlnotes.core.errors import Interrupted
from rlnotes.core.overrides import override_value
from rlnotes.engine.hardware import distributed


# The signals that stop a run with a checkpoint: Ctrl-C, a scheduler's or kill's SIGTERM, and the
# SIGHUP of a closed terminal or SSH session (unless the run was started ignoring it, as under nohup).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """SIGINT (Ctrl-C), SIGTERM and SIGHUP while training, and while the stop saves.

    A signal raises Interrupted at once when no optimizer update has run since the last
    completed step (`run.updating` is off): that step's checkpoint is then exact, and the partial
    step is simply redone on resume. During a step's updates (PPO's minibatches, GRPO's mu passes)
    the step is finished first and `check` stops after it; a second signal stops at once.
    With several processes every first signal waits for the end of the step, and `check` stops
    every rank after the same step when any of them got one (a rank stopping alone would leave the
    others waiting in a collective).

    A save (`saving`: a checkpoint, or the policy to interrupted/) is never cut short by the signal
    that stopped the run nor by the next one: the first signal after the stop began (or during a
    save) says what is being saved and that one more abandons it; only that one more does (its
    temporary dir is removed, the previous checkpoints stay). So Ctrl-C pressed twice in quick
    succession still saves, and a third press abandons the save. Handlers are installed only in
    the main thread (Python delivers signals nowhere else).
    """

    def __init__(self, run, console):
        """`run`: the run's training.context.Run, whose `updating` says whether a step is in its
        updates; `console`: where the stop's messages go."""
        self.run, self.console, self.signum, self._previous = run, console, None, {}
        self.stopping = False  # Interrupted was raised: the run is on its way out
        self.writing: Optional[str] = None  # what is being saved now
        self.warned = False  # the user was told that one more signal abandons the save
        self.abandoned = False  # and sent it: a save was abandoned

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # nohup: the user asked the run to outlive its terminal
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @contextmanager
    def saving(self, what: str):
        """Mark the block as writing `what` (for the message a signal gets meanwhile)."""
        self.writing = what
        try:
            yield
        finally:
            self.writing = None

    def _say(self, text: str) -> None:
        try:
            self.console.print(f"[yellow]{escape(text)}[/]", soft_wrap=True, highlight=False)
        except OSError:  # the terminal is gone (SIGHUP): the stop goes on without a word
            pass

    def _handle(self, signum, frame) -> None:
        first, self.signum = self.signum is None, self.signum or signum
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {signal.Signals(signum).name} again"
        if self.stopping or self.writing:
            if self.writing and self.warned:
                self.abandoned, self.stopping = True, True
                raise Interrupted(self.signum)
            if not self.warned:
                self.warned = True
                self._say(f"{signal.Signals(signum).name}: saving {self.writing or 'a checkpoint'} before stopping; "
                          f"{again} to abandon it (the previous checkpoints are kept)")
            return
        if first and (self.run.updating or distributed.active()):
            self._say(f"{signal.Signals(signum).name}: stopping once this step is done ({again} to stop now, "
                      "without a checkpoint of this step)")
            return
        self.stopping = True
        raise Interrupted(self.signum)

    def check(self) -> None:
        """Stop now if a signal came during the step just finished (to any rank)."""
        if distributed.any_rank(self.signum is not None):
            self.stopping = True
            raise Interrupted(self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "KeyboardInterrupt"


def resume_command(run_dir: Path) -> str:
    """The command line that continues this run: its --config-dir, --config-name and overrides
    (a multirun member's own), then trainer.resume=auto and its run dir."""
    words, overrides = ["rlnotes", "train"], ["..."]
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        for source in hydra.runtime.config_sources:
            if source.provider == "command-line" and source.schema == "file":  # --config-dir
                words += ["--config-dir", source.path]
        if hydra.job.config_name != "config":
            words += ["--config-name", hydra.job.config_name]
        overrides = [o for o in hydra.overrides.task if not o.startswith("trainer.resume=")]
    words += [*overrides, "trainer.resume=auto", f"hydra.run.dir={override_value(str(run_dir))}"]
    return " ".join(w if w == "..." else shlex.quote(w) for w in words)

