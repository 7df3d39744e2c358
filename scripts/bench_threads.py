"""Time a GRPO step at 1 thread and at all cores, for models of growing size: the measurement
behind hardware.threads=auto (rlnotes.engine.hardware.threads.AUTO_ONE_THREAD_BELOW).

    python scripts/bench_threads.py                          # tiny at widths 64 .. 1024
    python scripts/bench_threads.py --widths 64 512 --steps 15 --rounds 2
    python scripts/bench_threads.py --smollm2 --smollm2-steps 3   # and SmolLM2-135M (about 20 s a step)

Each (model, threads) pair runs `rlnotes train` in its own process, the pairs of one model in
turn (1, N, 1, N, ...), so that a change in the machine's load touches both. The figure is the
median of `time/step_s` over the steps after the first two (warm-up). The tiny model is widened
with model.tiny.hidden_size=W and intermediate_size=2W (its own ratio), 2 layers. Run it on a
quiet machine: another process on one of the cores slows the many-thread runs most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins

# The default batch shape of `rlnotes train` (conf/), progress bar off.
COMMON = ["logging.progress=false", "trainer.eval_every=null", "trainer.save_every=0"]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tiny_overrides(width: int) -> list:
    return ["model=tiny", f"model.tiny.hidden_size={width}", f"model.tiny.intermediate_size={2 * width}"]


def parameters(overrides: list) -> int:
    """The base model's parameter count (embeddings included) for these model overrides."""
    from hydra.types import RunMode
    from transformers.utils import logging

    from rlnotes.commands.check import loader
    from rlnotes.engine.model.loading import load_base

    logging.disable_progress_bar()
    cfg = loader(None).load_configuration("config", overrides, RunMode.RUN)
    model, _ = load_base(cfg.model)
    return sum(p.numel() for p in model.parameters())


def step_time(overrides: list, threads: int, steps: int) -> float:
    """Median seconds per step after the first two, of one `rlnotes train` process."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "rlnotes", "train", *overrides, *COMMON, f"trainer.steps={steps}",
               f"hardware.threads={threads}", f"hydra.run.dir={tmp}/run"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if out.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["time/step_s"] for r in rows[2:] or rows)


def measure(name: str, overrides: list, steps: int, rounds: int, many: int) -> None:
    times = {1: [], many: []}
    for _ in range(rounds):
        for threads in times:
            times[threads].append(step_time(overrides, threads, steps))
    one, all_ = statistics.median(times[1]), statistics.median(times[many])
    print(f"{name} | {parameters(overrides) / 1e6:.2f} | {one:.3f} | {all_:.3f} | {one / all_:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", nargs="*", type=int, default=[64, 128, 256, 512, 1024],
                        help="hidden sizes of the tiny model")
    parser.add_argument("--steps", type=int, default=12, help="steps per tiny run (the first two are warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per (model, threads), alternating")
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M (about 20 s a step on 2 cores)")
    parser.add_argument("--smollm2-steps", type=int, default=3)
    args = parser.parse_args()
    many = cores()
    print(f"GRPO step (the default shape), median seconds after two warm-up steps; {many} cores, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"model | parameters (M) | 1 thread s | {many} threads s | speed-up of {many}")
    for width in args.widths:
        measure(f"tiny hidden {width}", tiny_overrides(width), args.steps, args.rounds, many)
    if args.smollm2:
        measure("smollm2-135m", ["model=smollm2-135m"], args.smollm2_steps, 1, many)


if __name__ == "__main__":
    main()
