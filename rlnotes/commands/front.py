"""The front of `rlnotes train`: its command line read and every job checked before the modules
that train load. rlnotes.commands.train imports torch, transformers and peft (seconds), the check
needs none of them (rlnotes.commands.check), so a mistake in the config, whichever route it came
by (the command line, a --config-name file, a --config-dir group file, a sweep's member), is one
line at once; a command line that checks goes on to rlnotes.commands.train with its checked jobs.

`--cfg job|hydra|all` prints the config of each checked job, as the run will have it (data=auto
and reward=auto resolved, data.path alone read as data=file), where Hydra's own flag would print
the composition before rlnotes settles it. Hydra's other informational flags (--help, --info...)
are Hydra's, answered by rlnotes.commands.train.
"""

from __future__ import annotations

import importlib
import sys
from typing import List

from rlnotes.commands import hydra
from rlnotes.commands.check import check_args
from rlnotes.commands.usage import UsageError

TRAIN = "rlnotes.commands.train"


def main(argv: List[str]) -> int:
    args = hydra.parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return importlib.import_module(TRAIN).main(argv)
    jobs = check_args(args)  # before the import: a mistake costs the check alone
    if args.cfg:
        _show(jobs, args)
        return 0
    return importlib.import_module(TRAIN).main(argv, jobs)


def _show(jobs: list, args) -> None:
    """Each job's config as --cfg asks (a sweep's members each under a comment naming its overrides)."""
    for cfg in jobs:
        try:
            text = hydra.show(cfg, args.cfg, args.package, args.resolve)
        except hydra.COMPOSE_ERRORS as e:
            raise UsageError(str(e).strip().splitlines()[0]) from None
        if len(jobs) > 1:
            sys.stdout.write(f"# {' '.join(cfg.hydra.overrides.task)}\n")
        sys.stdout.write(text)
