"""The package as a user gets it (`pip install .`, a wheel, `pip install git+URL`): the wheel built
from this tree holds every file of rlnotes/ and of conf/ (as rlnotes.conf) and nothing else. The
editable install of `make test` imports straight from the tree, so it hides a module the wheel
lacks: a hand-kept package list once left out rlnotes.agents. `make wheel-check` installs the wheel
in a fresh venv and trains with it."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import rlnotes

ROOT = Path(__file__).resolve().parent.parent
# The source folder of each folder the wheel installs (setup.py maps conf/ to rlnotes.conf).
INSTALLED_AS = {"rlnotes": "rlnotes", "conf": "rlnotes/conf"}
DIST_INFO = f"rlnotes-{rlnotes.__version__}.dist-info"


def tree_files():
    """The files a clone of this checkout has, plus new files git does not ignore: what `pip install .`
    or a wheel built in CI would see (no build/ left over, no __pycache__)."""
    if shutil.which("git") is None:
        pytest.skip("needs git to list the tree")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [name for name in out.stdout.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The names in a wheel built, as pip builds it, from a copy of the tree."""
    tmp = tmp_path_factory.mktemp("package")
    src, dist = tmp / "src", tmp / "dist"
    for name in tree_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = dist.glob("rlnotes-*.whl")
    with zipfile.ZipFile(path) as z:
        return {name: z.read(name).decode() if name.startswith(DIST_INFO) else None for name in z.namelist()}


def installed_path(name: str):
    top, _, rest = name.partition("/")
    return f"{INSTALLED_AS[top]}/{rest}" if top in INSTALLED_AS else None


def test_the_wheel_holds_every_module_and_config_file_and_nothing_else(wheel):
    expected = {installed_path(n) for n in tree_files()} - {None}
    assert "rlnotes/agents/tools.py" in expected and "rlnotes/conf/experiment/letters_env.yaml" in expected
    packaged = {n for n in wheel if not n.startswith(DIST_INFO + "/")}
    missing, extra = sorted(expected - packaged), sorted(packaged - expected)
    assert not missing, f"not in the wheel (setup.py decides what goes in): {missing}"
    assert not extra, f"in the wheel but not in rlnotes/ or conf/: {extra}"
    assert {n.split("/")[0] for n in wheel} == {"rlnotes", DIST_INFO}  # no tests/, scripts/, docs/, conf/


def test_the_wheel_carries_the_one_version_and_the_console_script(wheel):
    assert f"\nVersion: {rlnotes.__version__}\n" in wheel[f"{DIST_INFO}/METADATA"]
    assert "rlnotes = rlnotes.commands.cli:run" in wheel[f"{DIST_INFO}/entry_points.txt"]
