"""The front of `rlnotes train`: its command line read and every job checked before the modules
that train load. rlnotes.commands.train imports torch, transformers and peft (seconds), the check
needs none of them (rlnotes.commands.check), so a mistake in the config, whichever route it came
by (the command line, a --config-name file, a --config-dir group file, a sweep's member), is one
line at once; a command line that checks goes on to rlnotes.commands.train with its checked jobs.
Hydra's informational flags (--help, --cfg, --info...) are Hydra's, answered by rlnotes.commands.train.
"""

from __future__ import annotations

import importlib
from typing import List

from rlnotes.commands import hydra
from rlnotes.commands.check import check_args

TRAIN = "rlnotes.commands.train"


def main(argv: List[str]) -> int:
    args = hydra.parse_args(argv)
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return importlib.import_module(TRAIN).main(argv)
    jobs = check_args(args)  # before the import: a mistake costs the check alone
    return importlib.import_module(TRAIN).main(argv, jobs)

