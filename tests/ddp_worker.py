"""Run by tests/test_distributed.py under torchrun: train every case of CASES in this one process
group (as a multirun's jobs would share it), each into OUT/<case>, then exit.

    torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py OUT [CASE ...]
"""

import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from rlnotes.commands.train import train  # noqa: E402
from rlnotes.engine.hardware.distributed import end_process  # noqa: E402
from tests.conftest import compose  # noqa: E402
from tests.test_distributed import CASES  # noqa: E402


def main(out: Path, names) -> None:
    for name in names:
        overrides = [o.replace("{OUT}", str(out)) for o in CASES[name]]
        train(compose("logging.progress=false", *overrides), out / name, Console(quiet=True))


if __name__ == "__main__":
    faulthandler.enable()  # a crash (SIGABRT, SIGSEGV) prints every thread's Python stack where the test shows it
    main(Path(sys.argv[1]), sys.argv[2:] or list(CASES))
    end_process(0)  # as the rlnotes command ends a rank: without the interpreter's finalization
