"""The `rlnotes` command: `rlnotes train|eval|plot|export ...`, each command a module of
rlnotes/commands with a `main(argv)`.

A command's module is loaded only once the command is known: the settings of `_environment` must
be in place before torch and the Hugging Face libraries are imported, `rlnotes --help` answers at
once, and `rlnotes plot` needs neither torch nor a model.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import List, NoReturn, Optional

from rlnotes import __version__
from rlnotes.commands.usage import UsageError
from rlnotes.core.errors import INPUT_ERROR, Interrupted
from rlnotes.engine.hardware.openmp import wait_briefly
from rlnotes.run.logger import quiet_libraries

USAGE = """usage: rlnotes COMMAND [OVERRIDES...]   |   rlnotes --version (-V)

commands:
  train    fine-tune a model: rlnotes train algo=grpo model=tiny trainer.steps=40
           (Hydra flags work: -m for sweeps, --cfg job, --help for the config groups)
  eval     evaluate the base model or a trained policy on the task's eval split:
           rlnotes eval model=smollm2-135m data=arith   |   rlnotes eval eval.policy=RUN_DIR/final
  plot     figures of runs overlaid, and a table of their final metrics (pip extra: plot):
           rlnotes plot RUN_DIR [RUN_DIR...] | SWEEP_DIR [--out DIR] [--sort METRIC] [--smooth 0.9]
  export   merge a LoRA adapter into its base and save a Hugging Face model dir:
           rlnotes export RUN_DIR/final OUT_DIR [--dtype bfloat16]
  config   every setting a run would get, with its value, range and meaning (docs/config.md):
           rlnotes config [OVERRIDES...] [KEY...]   e.g. rlnotes config algo=ppo algo
"""

# Each command and the module whose main(argv) runs it (loaded when the command runs, see above;
# train's checks its config before the modules that train load: rlnotes.commands.front).
COMMANDS = {"train": "rlnotes.commands.front", "eval": "rlnotes.commands.eval", "plot": "rlnotes.commands.plot",
            "export": "rlnotes.commands.export", "config": "rlnotes.commands.config"}


def _environment() -> None:
    """Settings that must be in place before torch is imported; a user's own values win."""
    # OpenMP's threads spin briefly between parallel regions, then sleep (rlnotes.engine.hardware.openmp).
    wait_briefly(os.environ)
    # A hub id with no network behind it fails within seconds instead of hanging.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: Optional[List[str]] = None) -> int:
    _environment()
    quiet_libraries()  # deprecation notices and advice from the libraries below us mean nothing to a user
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"rlnotes {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"rlnotes: error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return INPUT_ERROR
    try:
        return importlib.import_module(COMMANDS[command]).main(rest)
    except UsageError as e:
        print(f"rlnotes: error: {e}", file=sys.stderr)
        return INPUT_ERROR
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops; rank 0 says so
            print(f"rlnotes: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum  # as a shell reports it: 130 for SIGINT, 143 for SIGTERM


def run() -> NoReturn:
    """The `rlnotes` console script and `python -m rlnotes`: main's exit code as the process's. A
    process of several (torchrun) ends through rlnotes.engine.hardware.distributed.end_process,
    which keeps the interpreter's finalization from aborting a rank that finished its work."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    dist = sys.modules.get("torch.distributed")  # imported only by a command that trains
    if dist is not None and dist.is_available() and dist.is_initialized():
        from rlnotes.engine.hardware.distributed import end_process  # optional: torch, loaded only by a command
        end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
