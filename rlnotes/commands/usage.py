"""A mistake on a command line: UsageError, reported as one `rlnotes: error:` line with exit
status 2, and the argparse parser of the commands whose mistakes are one such line."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one UsageError line, like every other rlnotes error."""

    def error(self, message: str):
        raise UsageError(f"{message}; usage: {' '.join(self.format_usage().split()[1:])}")
