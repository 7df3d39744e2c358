"""How torch's OpenMP threads wait between parallel regions: set in the environment before torch is
imported (its OpenMP runtime reads it once, when it loads). No torch here.

torch splits every matmul and every large elementwise operation over its threads, and between two
of them the threads wait. A thread that spins while it waits takes a core from other processes: with
libgomp's default (300,000 spins, milliseconds) a tiny model's GRPO steps on 2 threads took 2.5x as
long beside two busy processes as with OMP_WAIT_POLICY=PASSIVE, which sleeps at once. Sleeping at once
costs a wake-up of tens of microseconds at the next region instead, and a decoding step or a training
pass of a model like SmolLM2-135M runs thousands of regions of a few dozen microseconds each. A short
spin (GOMP_SPINCOUNT=SPIN_COUNT, tens of microseconds) catches the next region while work goes on and
gives the core up soon after it stops. Measured on a 2-core machine (docs/benchmarks.md, "How threads
wait"): a SmolLM2 GRPO step's passes 1.2-1.5x faster than with passive waiting on a quiet machine, and
about as fast as with it beside two busy processes.
"""

from __future__ import annotations

from typing import MutableMapping

# libgomp's spins before a waiting thread sleeps (each a read and a pause: tens of nanoseconds).
SPIN_COUNT = "1000"


def wait_briefly(env: MutableMapping[str, str]) -> None:
    """OMP_WAIT_POLICY=PASSIVE (for OpenMP runtimes other than libgomp) and GOMP_SPINCOUNT=SPIN_COUNT
    (libgomp's spin before it sleeps, which it takes over the passive policy's 0) in `env`, unless
    the user set either: their own choice wins."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
