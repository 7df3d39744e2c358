"""The errors every floor raises and the commands report: each message is one line that says
what to do."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; its message is one line that says what to do."""


# The exit status of a command whose input is wrong (its command line, a setting, its data, the
# hardware it names: a UsageError or ConfigError), whether it is found before the run or during it,
# as for a usage error; 1 is a run that failed otherwise (a reward function or an environment that
# raised, a run that cannot go on).
INPUT_ERROR = 2


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (rlnotes.run.signals.StopSignals); the command exits with 128 +
    `signum`, as a shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)


class TrainingError(RuntimeError):
    """A run that cannot go on; its message says what to try."""


class SaveFailed(TrainingError):
    """A checkpoint could not be written (a full disk); the message says how to resume."""
