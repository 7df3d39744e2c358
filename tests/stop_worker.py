"""`rlnotes train ARGS` with every torch.save slowed by $SAVE_DELAY seconds (checkpoint saves
call it for the optimizer state), touching the file $SAVE_MARK when one starts: tests/test_signals.py
sends real signals while a save is under way.

    python tests/stop_worker.py train OVERRIDES...
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rlnotes.commands.cli import main  # noqa: E402

real_save = torch.save


def slow_save(*args, **kwargs):
    Path(os.environ["SAVE_MARK"]).touch()
    time.sleep(float(os.environ["SAVE_DELAY"]))
    return real_save(*args, **kwargs)


torch.save = slow_save
sys.exit(main(sys.argv[1:]))
