"""A run dir abused as a careful user (or a cluster) might: reused, shared by two processes, killed
at each phase of a run, its checkpoints corrupted, truncated or deleted file by file, a manifest
that lies about its step, a torn metrics line, links and hard-linked copies among its files, dirs
that are not a run given as one, and evaluations pointed at it. Each test hashes what the earlier
run wrote and checks that nothing of it is lost or silently changed: a command that would
overwrite it is refused in one line, and a damaged checkpoint is named and set aside, never
deleted or used.

102 abuses (test cases), by section: reusing a run or sweep dir 11; two processes 2; SIGKILL at
each phase 8; damaged checkpoints 28; torn step logs 5; links, hard-linked copies, lock files,
checkpoints, policies, run folders, files, unwritable and not-a-run dirs given as run dirs, fewer
steps than the checkpoint, a second sweep into a sweep dir in use or into a run, changed data 34; a run
that fails before it starts, in a dir it made or one the user named 4; rlnotes eval
into a run, into another evaluation, from inside a run, unwritable, of a pruned checkpoint, of a shared
run's code 10.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from rlnotes.algos import grpo
from rlnotes.commands.cli import main
from rlnotes.commands.train import train
from rlnotes.core.errors import ConfigError
from rlnotes.engine.policy.policy import Policy
from rlnotes.run import checkpoint, restore, rundir, steplogs
from rlnotes.run.logger import MetricsLogger
from tests.conftest import compose, set_step

SETTINGS = ("logging.progress=false", "trainer.batch_size=4", "trainer.save_every=2")
# Forked processes and a live run paused on a pipe: a hang fails the test instead of the suite.
pytestmark = pytest.mark.timeout(300)


def snapshot(run_dir: Path) -> dict:
    """sha256 of every file a run wrote (the owner's .lock, which names the current owner, aside)."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(run_dir).rglob("*")) if p.is_file() and p.name != rundir.LOCK}


def rows(run_dir: Path) -> list:
    """metrics.jsonl's rows without wall-clock keys, which differ between any two runs."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(run_dir: Path, *overrides: str, console: Console = None) -> list:
    train(compose(*SETTINGS, *overrides), run_dir, console or Console(quiet=True))
    return rows(run_dir)


def cli(capsys, run_dir: Path, *overrides: str) -> tuple:
    """`rlnotes train` in this process: (exit code, stderr)."""
    try:
        code = main(["train", *SETTINGS, f"hydra.run.dir={run_dir}", *overrides])
    except SystemExit as e:  # an error inside the job
        code = e.code
    return code, capsys.readouterr().err


def in_child(fn) -> int:
    """fn() in a forked copy of this process (a real second process, without the cost of imports):
    its exit code, or minus the signal that ended it."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def kill_self(*_, **__):
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 6-step run, and one stopped (Ctrl-C) after its step-4 checkpoint, before final/."""
    root = tmp_path_factory.mktemp("runs")
    assert main(["train", *SETTINGS, "trainer.steps=6", f"hydra.run.dir={root / 'finished'}"]) == 0
    finished = rows(root / "finished")
    real, calls = grpo.train_step, []

    def stop_in_step_5(ctx):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(ctx)

    set_step("grpo", stop_in_step_5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(root / "stopped", "trainer.steps=6")
    finally:
        set_step("grpo", real)
    assert [p.name for p in checkpoint.checkpoints(root / "stopped")] == ["step_000002", "step_000004"]
    return {"root": root, "finished": finished}


def copy_of(runs, name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(runs["root"] / name, out)
    return out


# ---------------------------------------------------------------------------------------------
# Reusing a run dir: refused before Hydra writes anything, unless the user asked to resume.


def _no_checkpoints(d):
    shutil.rmtree(d / "checkpoints")


def _no_final(d):
    shutil.rmtree(d / "final")


def _killed_before_first_checkpoint(d):
    shutil.rmtree(d / "checkpoints")
    shutil.rmtree(d / "final")


@pytest.mark.parametrize("source, change, overrides, message", [
    ("finished", None, (), "already holds a run that finished at step 6.*raise trainer.steps above 6 with "
                           "trainer.resume=auto"),
    ("finished", None, ("trainer.resume=auto",), "holds a run that finished at step 6, and trainer.steps=6 asks for "
                                                 "no more; to train it longer, raise trainer.steps above 6"),
    ("finished", _no_checkpoints, ("trainer.resume=auto",), "holds a finished run .* with no checkpoint to continue"),
    ("finished", _no_checkpoints, (), "already holds a run that finished at step 6"),
    ("finished", _no_final, (), "already holds a run \\(config.yaml, metrics.jsonl, checkpoints\\)"),
    ("finished", _killed_before_first_checkpoint, (), "already holds a run \\(config.yaml, metrics.jsonl\\)"),
    ("stopped", None, (), "already holds a run .*continue it with trainer.resume=auto"),
    ("stopped", None, ("trainer.resume={other}",), "already holds a run"),
    ("finished", None, ("trainer.resume={own}/checkpoints/step_000006",), "finished at step 6.*raise trainer.steps "
                                                                          "above 6"),
])
def test_a_command_that_would_overwrite_a_run_is_refused_before_anything_changes(runs, tmp_path, capsys, source,
                                                                                  change, overrides, message):
    """Before: resume=auto into a finished run without checkpoints truncated its metrics.jsonl and
    overwrote final/; a new run appended its rows after the old ones; a refused command still
    rewrote .hydra/overrides.yaml. Now every such command stops in one line and no file changes."""
    run_dir, other = copy_of(runs, source, tmp_path), runs["root"] / "stopped"
    if change:
        change(run_dir)
    before = snapshot(run_dir)
    overrides = [o.format(other=other, own=run_dir) for o in overrides]
    code, err = cli(capsys, run_dir, "trainer.steps=6", *overrides)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("rlnotes: error:"), err
    assert __import__("re").search(message, err), err
    assert snapshot(run_dir) == before


def test_training_a_finished_run_longer_keeps_what_it_wrote(runs, tmp_path, capsys):
    """resume=auto with more steps is asked for: the run goes on; its rows, its first command's
    .hydra/ files and its checkpoints stay as they were (keep_last prunes the old ones only after
    newer ones are saved; final/ is the longer run's policy)."""
    run_dir = copy_of(runs, "finished", tmp_path)
    before = snapshot(run_dir)
    code, err = cli(capsys, run_dir, "trainer.steps=8", "trainer.resume=auto")
    assert code == 0, err
    assert rows(run_dir)[:6] == runs["finished"] and [r["step"] for r in rows(run_dir)] == list(range(1, 9))
    after = snapshot(run_dir)
    assert all(after[k] == before[k] for k in before if k.startswith(".hydra/"))
    assert [p for p in after if p.startswith(".hydra/resumed_") and p.endswith("overrides.yaml")]


def test_a_sweep_into_a_used_sweep_dir_is_refused_before_any_member_runs(tmp_path, capsys):
    sweep = ["train", "-m", "seed=0,1", "trainer.steps=1", *SETTINGS, f"hydra.sweep.dir={tmp_path}"]
    assert main(sweep) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    assert main(sweep) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / '0'} already holds a run that finished at step 1" in err and len(err.splitlines()) == 1
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------
# Two processes, one run dir.


def test_a_second_process_is_refused_while_a_run_is_live_and_admitted_after(runs, tmp_path, capsys):
    """A real run in a forked process, paused in its 3rd step: a second resume=auto into its dir
    is refused with the owner's pid, and rewrites none of its files (.hydra/ included); once the
    owner has finished, its lock is gone."""
    run_dir = tmp_path / "live"
    started, go = os.pipe(), os.pipe()
    real, calls = grpo.train_step, []

    def paused_in_step_3(ctx):
        calls.append(1)
        if len(calls) == 3:
            os.write(started[1], b"x")
            os.read(go[0], 1)
        return real(ctx)

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            set_step("grpo", paused_in_step_3)
            code = main(["train", *SETTINGS, "trainer.steps=4", f"hydra.run.dir={run_dir}"])
        finally:
            os._exit(code)
    assert os.read(started[0], 1) == b"x"
    before = snapshot(run_dir)
    code, err = cli(capsys, run_dir, "trainer.steps=4", "trainer.resume=auto")
    assert code == 2 and f"is in use by another rlnotes process (pid {pid}" in err and len(err.splitlines()) == 1
    assert snapshot(run_dir) == before
    os.write(go[1], b"x")
    assert os.waitpid(pid, 0)[1] == 0
    rundir.own(run_dir)  # free again
    rundir.release(run_dir)


@pytest.mark.long
def test_the_console_script_is_refused_by_a_live_owner(tmp_path):
    """The real `rlnotes train` in another process, while this one owns the run dir: exit 2, one
    line naming this pid, and not even Hydra's .hydra/ is written."""
    rundir.own(tmp_path)
    try:
        command = [str(Path(sys.executable).with_name("rlnotes")), "train", "trainer.steps=1",
                   f"hydra.run.dir={tmp_path}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    finally:
        rundir.release(tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"rlnotes: error: {tmp_path} is in use by another rlnotes process (pid {os.getpid()}, see {tmp_path}/.lock); "
        "wait for it to end or stop it, or start this run in another dir (hydra.run.dir=NEW_DIR)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


# ---------------------------------------------------------------------------------------------
# SIGKILL at each phase of a run, then resume=auto.


def _kill_in_step(n):
    def patch():
        real, calls = grpo.train_step, []

        def step(ctx):
            calls.append(1)
            if len(calls) == n:
                kill_self()
            return real(ctx)
        set_step("grpo", step)
    return patch


def _kill_mid_row(n):
    def patch():
        real = MetricsLogger.log

        def log(self, step, metrics):
            if step == n:
                self.file.write(json.dumps({"step": step, **metrics})[:25])
                self.file.flush()
                kill_self()
            return real(self, step, metrics)
        MetricsLogger.log = log
    return patch


def _kill_on_call(module, name, n, when=lambda *a: True):
    def patch():
        real, calls = getattr(module, name), []

        def wrapped(*args, **kwargs):
            if when(*args):
                calls.append(1)
                if len(calls) == n:
                    kill_self()
            return real(*args, **kwargs)
        setattr(module, name, wrapped)
    return patch


PHASES = {
    "before the first step": _kill_in_step(1),
    "in the middle of step 3": _kill_in_step(3),
    "writing step 3's metrics row": _kill_mid_row(3),
    "writing step 4's checkpoint": _kill_on_call(checkpoint.torch, "save", 2),
    "after step 4's checkpoint is in place, before pruning": _kill_on_call(checkpoint, "prune", 2),
    "after step 6's checkpoint, before pruning (keep_last deletes step 2)": _kill_on_call(checkpoint, "prune", 3),
    "writing final/": _kill_on_call(Policy, "save", 1, lambda policy, out, *a: "final" in out.name),
}


@pytest.mark.parametrize("phase", PHASES)
def test_a_run_killed_at_any_phase_resumes_to_the_same_result(runs, tmp_path, phase):
    """SIGKILL (no handler runs, no file is closed) at each phase of a real run in a forked
    process: its lock dies with it, resume=auto finishes the run to the same metrics as one never
    killed, and what the killed run had completed (rows, checkpoints) is unchanged until the
    resumed run itself moves past it."""
    run_dir = tmp_path / "run"
    assert in_child(lambda: (PHASES[phase](), run(run_dir, "trainer.steps=6"))) == -signal.SIGKILL
    before = snapshot(run_dir)
    kept = checkpoint.checkpoints(run_dir)
    assert run(run_dir, "trainer.steps=6", "trainer.resume=auto") == runs["finished"]
    after = snapshot(run_dir)
    for path in kept:
        name = str(path.relative_to(run_dir))
        assert all(after.get(k, "pruned") in (before[k], "pruned") for k in before if k.startswith(name))
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step_000004", "step_000006"]
    assert (run_dir / "final" / "adapter_model.safetensors").is_file()


def test_a_run_killed_again_while_resuming_still_resumes(runs, tmp_path):
    """Killed in step 5, then killed again while its resume loads the checkpoint (after the logs
    were cut back to step 4): the third start finishes the run as if nothing happened."""
    run_dir = tmp_path / "run"
    assert in_child(lambda: (_kill_in_step(5)(), run(run_dir, "trainer.steps=6"))) == -signal.SIGKILL
    resume = ("trainer.steps=6", "trainer.resume=auto")
    assert in_child(lambda: (_kill_on_call(restore, "load", 1)(), run(run_dir, *resume))) == -signal.SIGKILL
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]
    assert run(run_dir, *resume) == runs["finished"]


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: named, set aside, and the newest good one resumed.


def _flip(f: Path):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {"flipped byte": _flip, "truncated": _truncate, "deleted": Path.unlink}
FILES = ("adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "config.yaml", "tokenizer.json",
         "manifest.json")


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_file_in_the_latest_checkpoint_is_named_and_set_aside(runs, tmp_path, name, damage):
    run_dir = copy_of(runs, "stopped", tmp_path)
    latest = run_dir / "checkpoints" / "step_000004"
    DAMAGE[damage](latest / name)
    before = snapshot(latest)
    notes = []
    assert restore.locate("auto", run_dir, notes) == run_dir / "checkpoints" / "step_000002"
    assert len(notes) == 1 and "step_000004 is damaged" in notes[0] and "set aside as damaged_step_000004" in notes[0]
    assert name in notes[0] or (name == "manifest.json" and "manifest" in notes[0]), notes
    assert snapshot(run_dir / "checkpoints" / "damaged_step_000004") == before  # kept as it was, for a look


@pytest.mark.parametrize("damage", DAMAGE)
def test_resume_falls_back_to_the_newest_good_checkpoint_and_finishes_the_same(runs, tmp_path, damage):
    run_dir = copy_of(runs, "stopped", tmp_path)
    DAMAGE[damage](run_dir / "checkpoints" / "step_000004" / "trainer_state.pt")
    console = Console(width=400)
    with console.capture() as out:
        assert run(run_dir, "trainer.steps=6", "trainer.resume=auto", console=console) == runs["finished"]
    assert "step_000004 is damaged (trainer_state.pt" in out.get()
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step_000004", "step_000006"]
    assert (run_dir / "checkpoints" / "damaged_step_000004").is_dir()


@pytest.mark.parametrize("claim", ["in its own dir", "in a dir renamed to match"])
def test_a_manifest_claiming_step_999_is_caught(runs, tmp_path, claim):
    """Before: accepted; the run logged negative steps and pruned the good checkpoint."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    latest = run_dir / "checkpoints" / "step_000004"
    manifest = json.loads((latest / "manifest.json").read_text())
    (latest / "manifest.json").write_text(json.dumps({**manifest, "step": 999}))
    if claim != "in its own dir":
        latest = latest.rename(latest.with_name("step_000999"))
    problem = checkpoint.verify(latest, steplogs.logged_steps(run_dir))
    assert problem == ("manifest.json says step 999 but the dir is step_000004" if claim == "in its own dir"
                       else "manifest.json says step 999, past its run's trainer.steps=6")
    assert run(run_dir, "trainer.steps=6", "trainer.resume=auto") == runs["finished"]
    assert (run_dir / "checkpoints" / f"damaged_{latest.name}").is_dir()


def test_a_checkpoint_ahead_of_the_metrics_is_not_trusted(runs, tmp_path):
    """metrics.jsonl lost its last rows (steps 4 and 5): step 4's checkpoint was saved after a row
    that is gone, so resume takes step 2, where log and checkpoint agree."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:3]))
    assert "saved after metrics.jsonl's row of step 4" in checkpoint.verify(
        run_dir / "checkpoints" / "step_000004", steplogs.logged_steps(run_dir))
    assert run(run_dir, "trainer.steps=6", "trainer.resume=auto") == runs["finished"]


def test_every_checkpoint_damaged_is_one_line_and_changes_nothing(runs, tmp_path):
    run_dir = copy_of(runs, "stopped", tmp_path)
    for path in checkpoint.checkpoints(run_dir):
        (path / "adapter_model.safetensors").unlink()
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="no checkpoint in .* verifies \\(checkpoint .*step_000004 is damaged "
                                          "\\(adapter_model.safetensors is missing\\)\\)"):
        run(run_dir, "trainer.steps=6", "trainer.resume=auto")
    assert snapshot(run_dir) == before


def test_a_deleted_adapter_is_reported_as_missing_not_as_a_lora_setting(runs, tmp_path):
    """Before: 'it was saved by a run with model.lora=null: resume with model.lora=null'."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    path = run_dir / "checkpoints" / "step_000004"
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match="step_000004 is damaged \\(adapter_model.safetensors is missing\\); give an "
                                          "earlier checkpoint"):
        run(tmp_path / "new", "trainer.steps=6", f"trainer.resume={path}")
    with pytest.raises(ConfigError, match="is missing its LoRA adapter"):  # even unverified, the cause is right
        restore.load_policy(type("P", (), {"uses_lora": True, "model": torch.nn.Linear(1, 1)})(), path)


def test_keep_last_never_deletes_a_good_checkpoint_for_a_damaged_one(runs, tmp_path):
    run_dir = copy_of(runs, "finished", tmp_path)
    _flip(run_dir / "checkpoints" / "step_000006" / "adapter_model.safetensors")
    removed, damaged = checkpoint.prune(run_dir, 1)
    assert removed == [] and [p.name for p, _ in damaged] == ["damaged_step_000006"]
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step_000004"]


def test_a_format_1_checkpoint_without_checksums_still_resumes(runs, tmp_path):
    """Checkpoints written before sizes and checksums: what they hold is checked, and they load."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    for path in checkpoint.checkpoints(run_dir):
        manifest = json.loads((path / "manifest.json").read_text())
        del manifest["files"], manifest["logged"]
        (path / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))
    (run_dir / "checkpoints" / "step_000004" / "adapter_model.safetensors").unlink()
    notes = []
    assert restore.locate("auto", run_dir, notes).name == "step_000002"
    assert "adapter_model.safetensors is missing" in notes[0]
    assert run(run_dir, "trainer.steps=6", "trainer.resume=auto") == runs["finished"]


# ---------------------------------------------------------------------------------------------
# Torn step logs.


@pytest.mark.parametrize("log", steplogs.STEP_LOGS)
def test_a_torn_last_line_is_dropped_with_a_note(runs, tmp_path, log):
    """Before: a JSONDecodeError blocked the resume."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    with (run_dir / log).open("a") as f:
        f.write('{"step": 5, "reward/me')
    console = Console(width=400)
    with console.capture() as out:
        assert run(run_dir, "trainer.steps=6", "trainer.resume=auto", console=console) == runs["finished"]
    assert f"{log}: its last line is torn" in out.get()


def test_a_broken_line_inside_a_log_is_an_error_not_dropped(runs, tmp_path):
    run_dir = copy_of(runs, "stopped", tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join([lines[0], "garbage\n", *lines[1:]]))
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="metrics.jsonl line 2 is not a row of a step log"):
        run(run_dir, "trainer.steps=6", "trainer.resume=auto")
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------------------------------------
# Links, hard-linked copies, and dirs that hold something else than a run: nothing outside the run
# changes, and nothing but a run (or a new dir) is written into.


@pytest.mark.parametrize("name", [".lock", "config.yaml", "metrics.jsonl", "result.json", "warnings.log",
                                  "samples.jsonl", "checkpoints/step_000004/config.yaml"])
def test_a_symlink_among_a_runs_files_is_refused_and_what_it_points_to_is_kept(runs, tmp_path, capsys, name):
    """Before: a symlinked .lock was followed (its target truncated to the pid), and config.yaml and
    result.json were written through links, overwriting whatever file of the user's they named."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    target = tmp_path / "mine.txt"
    target.write_text("the user's own file\n")
    link = run_dir / name
    if os.path.lexists(link):
        link.unlink()
    link.symlink_to(target)
    before = snapshot(run_dir)
    code, err = cli(capsys, run_dir, "trainer.steps=6", "trainer.resume=auto")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"holds symbolic links among its files ({name} -> {target})" in err, err
    assert target.read_text() == "the user's own file\n" and link.is_symlink() and snapshot(run_dir) == before
    with pytest.raises(ConfigError, match="symbolic link"):  # in-process too, before the lock is taken
        run(run_dir, "trainer.steps=6", "trainer.resume=auto")
    assert target.read_text() == "the user's own file\n"


def test_a_lock_file_that_is_a_link_or_a_dir_is_one_line(tmp_path):
    """rundir.own on its own (a run dir checked before, then changed): the link is never followed, a
    directory in its place is named; before, the link's target was truncated, the dir a traceback."""
    target = tmp_path / "mine.txt"
    target.write_text("kept\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / rundir.LOCK).symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link; rlnotes never writes through one"):
        rundir.own(tmp_path / "a")
    assert target.read_text() == "kept\n"
    (tmp_path / "b" / rundir.LOCK).mkdir(parents=True)
    with pytest.raises(ConfigError, match="is a directory, where rlnotes keeps the lock file"):
        rundir.own(tmp_path / "b")


def test_a_lock_dir_in_a_run_is_one_line_through_the_command(runs, tmp_path, capsys):
    run_dir = copy_of(runs, "stopped", tmp_path)
    (run_dir / rundir.LOCK).unlink()
    (run_dir / rundir.LOCK).mkdir()
    before = snapshot(run_dir)
    code, err = cli(capsys, run_dir, "trainer.steps=6", "trainer.resume=auto")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is a directory, where rlnotes keeps" in err, err
    assert snapshot(run_dir) == before


def test_a_hard_linked_copy_resumed_leaves_the_original_as_it_was(runs, tmp_path, capsys):
    """`cp -al RUN COPY`, then COPY trained longer: before, config.yaml, result.json, Hydra's train.log
    and the lock were written in place, changing the original's files; now each is written aside and
    renamed, and a file still shared is copied before it grows."""
    original = copy_of(runs, "finished", tmp_path)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    before, lock = snapshot(original), (original / rundir.LOCK).read_bytes()
    code, err = cli(capsys, copy, "trainer.steps=8", "trainer.resume=auto")
    assert code == 0, err
    assert snapshot(original) == before and (original / rundir.LOCK).read_bytes() == lock
    assert [r["step"] for r in rows(copy)] == list(range(1, 9)) and rows(original) == runs["finished"]


@pytest.mark.parametrize("where, message", [
    ("checkpoints/step_000006", "is a checkpoint, not a run dir; to continue its run: trainer.resume=auto "
                                "hydra.run.dir={run}; to start a new run from it: trainer.resume={run}/checkpoints/"
                                "step_000006 hydra.run.dir=NEW_DIR"),
    ("final", "is a saved policy"),
    ("checkpoints/mine", "is inside {run}/checkpoints, the checkpoints/ folder of the run in {run}"),
    ("final/merged", "is inside {run}/final, a saved policy or checkpoint"),
    ("eval/mine", "is inside {run}/eval, the eval/ folder of the run in {run}"),
])
def test_a_run_dir_in_a_checkpoint_a_policy_or_a_runs_folders_is_refused(runs, tmp_path, capsys, where, message):
    """Before: hydra.run.dir=RUN/checkpoints/step_6 trainer.resume=auto trained a fresh run inside the
    checkpoint (the next real resume found it damaged and fell back two steps); a run in RUN/final/
    was deleted with final/ by the next resume."""
    run_dir = copy_of(runs, "finished", tmp_path)
    before = snapshot(run_dir)
    for resume in ((), ("trainer.resume=auto",)):
        code, err = cli(capsys, run_dir / where, "trainer.steps=8", *resume)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert message.format(run=run_dir) in err, err
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("target", ["its own dir", "a new dir"])
def test_resuming_with_fewer_steps_than_the_checkpoint_is_refused_before_anything_is_written(runs, tmp_path, capsys,
                                                                                             target):
    """Before: resuming step 4's checkpoint with trainer.steps=3 exited 0 and left a checkpoint past
    trainer.steps, which never verified again."""
    run_dir = copy_of(runs, "stopped", tmp_path)
    before = snapshot(run_dir)
    into, resume = ((run_dir, "trainer.resume=auto") if target == "its own dir" else
                    (tmp_path / "new", f"trainer.resume={run_dir / 'checkpoints' / 'step_000004'}"))
    code, err = cli(capsys, into, "trainer.steps=3", resume)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "step_000004 is at step 4, past trainer.steps=3; a run cannot be trained back: resume with " \
           "trainer.steps=4 or more" in err.replace(f"{run_dir}/checkpoints/", ""), err
    assert snapshot(run_dir) == before and not (tmp_path / "new").exists()


def _fake_evaluation(d: Path):
    """What `rlnotes eval` leaves: its config.yaml, eval.jsonl and samples.jsonl."""
    d.mkdir()
    from rlnotes.run import config_file
    config_file.write(d / "config.yaml", compose())
    (d / "eval.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    (d / "samples.jsonl").write_text('{"prompt": "p", "completion": "c"}\n')


@pytest.mark.parametrize("contents, message", [
    ({"eval.jsonl": '{"my": "data"}\n'}, "is not empty and holds no rlnotes run (eval.jsonl)"),
    ({"samples.jsonl": '{"my": "data"}\n', "notes.txt": "x\n"}, "holds no rlnotes run (notes.txt, samples.jsonl)"),
    ({"config.yaml": "lr: 3\n"}, "holds no rlnotes run (config.yaml)"),
    ({"metrics.jsonl": '{"step": 1}\n'}, "holds no rlnotes run (metrics.jsonl)"),
    (_fake_evaluation, "holds an evaluation (rlnotes eval's eval.jsonl, samples.jsonl), not a run"),
])
@pytest.mark.parametrize("resume", [(), ("trainer.resume=auto",)])
def test_a_dir_that_holds_something_else_than_a_run_is_refused(tmp_path, capsys, contents, message, resume):
    """Before: a dir holding a user's own eval.jsonl or samples.jsonl was taken as empty and the run's
    rows were appended to them; a user's config.yaml was a "run", which resume=auto overwrote."""
    run_dir = tmp_path / "dir"
    if callable(contents):
        contents(run_dir)
    else:
        run_dir.mkdir()
        for name, text in contents.items():
            (run_dir / name).write_text(text)
    before = snapshot(run_dir)
    code, err = cli(capsys, run_dir, "trainer.steps=1", *resume)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("mistake, says", [
    ("data.path=missing.jsonl", "data.path=missing.jsonl: no such file"),
    ("data.path=bad.jsonl", "bad.jsonl line 2, column 15: not valid JSON"),
])
def test_a_run_that_fails_before_it_starts_leaves_no_dir_it_made(tmp_path, capsys, monkeypatch, mistake, says):
    """Before: an input error found when the run starts left outputs/DATE/TIME-ALGO holding Hydra's
    .hydra/, an empty train.log and the lock, which `rlnotes plot outputs/*/*` then tripped over. The
    dirs the command made go (outputs/ and DATE/ too, when it made them and they are empty); a dir
    already there keeps what it holds."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "letter": "a"}\n{"prompt": "b"\n')
    argv = ["train", *SETTINGS, "trainer.steps=1", "reward=letters", mistake]
    for earlier in (None, tmp_path / "outputs" / "2020-01-01" / "12-00-00-grpo"):
        if earlier is not None:
            earlier.mkdir(parents=True)
            (earlier / "notes.txt").write_text("mine\n")
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == (
            ["bad.jsonl"] if earlier is None else
            ["bad.jsonl", "outputs", "outputs/2020-01-01", "outputs/2020-01-01/12-00-00-grpo",
             "outputs/2020-01-01/12-00-00-grpo/notes.txt"])


@pytest.mark.parametrize("held", [{}, {".hydra/keep.yaml": "mine\n", "earlier.log": "an earlier attempt\n"}])
def test_a_dir_the_user_named_keeps_what_it_held_when_the_run_fails_before_it_starts(tmp_path, capsys, held):
    """A new (empty, or holding only what Hydra leaves before a run) dir given as hydra.run.dir: after
    an input error it still exists and holds what it held; what this command added at its top (the
    job log, the lock) goes, and the dir is a new one for the next attempt."""
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    for name, text in held.items():
        (run_dir / name).parent.mkdir(exist_ok=True)
        (run_dir / name).write_text(text)
    before = snapshot(run_dir)
    code, err = cli(capsys, run_dir, "trainer.steps=1", "reward=letters", f"data.path={tmp_path / 'missing.jsonl'}")
    assert code == 2 and "missing.jsonl: no such file" in err, err
    assert run_dir.is_dir() and before.items() <= snapshot(run_dir).items()
    assert sorted(p.name for p in run_dir.iterdir()) == sorted({name.split("/")[0] for name in held})
    assert rundir.contents(run_dir) == "new"


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_a_run_dir_that_is_a_file_or_cannot_be_written_is_one_line(runs, tmp_path, capsys, monkeypatch, kind):
    """Before: tracebacks (Hydra's, writing .hydra/ into a file's path or a read-only dir)."""
    if kind == "a file":
        run_dir = tmp_path / "file"
        run_dir.write_text("mine\n")
        expected = "is a file, not a dir"
    else:
        run_dir = copy_of(runs, "stopped", tmp_path)
        for path in (run_dir, *run_dir.rglob("*")):
            path.chmod(path.stat().st_mode & ~0o222)
        if os.geteuid() == 0:  # root writes anyway: what a read-only file system answers
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(run_dir))
                                and mode & os.W_OK else real(p, mode, **kw))
        expected = "is not writable by this user"
    before = snapshot(run_dir) if run_dir.is_dir() else run_dir.read_text()
    code, err = cli(capsys, run_dir, "trainer.steps=6", "trainer.resume=auto")
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err
    assert (snapshot(run_dir) if run_dir.is_dir() else run_dir.read_text()) == before
    if run_dir.is_dir():
        for path in (run_dir, *run_dir.rglob("*")):
            path.chmod(path.stat().st_mode | 0o200)


def test_a_second_sweep_into_a_sweep_dir_in_use_is_refused_before_it_writes(tmp_path, capsys):
    """A first sweep in another process, paused after Hydra wrote its first member's .hydra/ and
    before that member took its lock: before, a second sweep into the same dir passed every check
    and rewrote the members' .hydra/ files (both summaries then labelled runs with overrides they
    did not train with). Now the first holds the sweep dir's lock for its whole multirun."""
    from rlnotes.commands import train as train_command

    sweep = tmp_path / "sweep"
    args = ["train", "-m", "trainer.steps=1", *SETTINGS, f"hydra.sweep.dir={sweep}"]
    started, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            real = train_command.train_job

            def paused(cfg):
                os.write(started[1], b"x")
                os.read(go[0], 1)
                return real(cfg)
            train_command.train_job = paused
            code = main([*args, "seed=0,1"])
        finally:
            os._exit(code)
    assert os.read(started[0], 1) == b"x"
    before = snapshot(sweep)
    assert main([*args, "seed=7,8"]) == 2
    err = capsys.readouterr().err
    assert f"{sweep} is in use by another rlnotes process (pid {pid}" in err and "hydra.sweep.dir=NEW_DIR" in err, err
    assert len(err.strip().splitlines()) == 1 and snapshot(sweep) == before
    os.write(go[1], b"xx")
    assert os.waitpid(pid, 0)[1] == 0
    assert main([*args, "seed=0,1"]) == 2  # then: its members hold runs
    assert "already holds a run that finished at step 1" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["{run}", "{run}/final", "{run}/checkpoints/sweep"])
def test_a_sweep_into_a_run_a_policy_or_a_runs_folders_is_refused(runs, tmp_path, capsys, where):
    """hydra.sweep.dir naming a run dir (or a place inside it): before, the members went into the run's
    dir and the sweep's summary files and multirun.yaml over whatever it held."""
    run_dir = copy_of(runs, "finished", tmp_path)
    before = snapshot(run_dir)
    code = main(["train", "-m", "seed=0,1", "trainer.steps=1", *SETTINGS, f"hydra.sweep.dir={where.format(run=run_dir)}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "hydra.sweep.dir=NEW_DIR" in err, err
    assert snapshot(run_dir) == before


def test_a_resume_on_rows_whose_content_changed_is_refused_before_anything_changes(tmp_path):
    """The data file edited between stop and resume (same row count): before, the run went on
    silently on other rows from the checkpoint's data position."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write the letter a {i}", "letter": "a"}) + "\n"
                            for i in range(16)))
    run_dir, settings = tmp_path / "run", (f"data.path={data}", "reward=letters", "trainer.steps=4")
    run(run_dir, *settings)
    data.write_text(data.read_text().replace("letter a 3", "letter a 33"))
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match="the train rows differ from those .*step_000004 was trained on \\(the same "
                                          "16 rows, other content"):
        run(run_dir, *settings[:2], "trainer.steps=6", "trainer.resume=auto")
    assert snapshot(run_dir) == before
    data.write_text(data.read_text().replace("letter a 33", "letter a 3"))  # put back: it resumes
    assert [r["step"] for r in run(run_dir, *settings[:2], "trainer.steps=6", "trainer.resume=auto")] == list(
        range(1, 7))


# ---------------------------------------------------------------------------------------------
# rlnotes eval: a dir of its own, never a run's, and no code of a run it was not told to trust.


def evaluate(capsys, *overrides: str) -> tuple:
    """`rlnotes eval` in this process: (exit code, stderr)."""
    code = main(["eval", "eval.size=4", *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("out", ["{run}", "{run}/eval/final", "{run}/mine", "{run}/final", "{run}/checkpoints/e"])
def test_an_evaluation_into_a_run_is_refused(runs, tmp_path, capsys, monkeypatch, out):
    """Before: eval.out=RUN_DIR deleted the run's eval.jsonl history and overwrote its samples.jsonl and
    config.yaml; the default (RUN/eval/final) was shared by every evaluation of the policy."""
    import rlnotes.commands.eval as eval_command

    run_dir = copy_of(runs, "finished", tmp_path)
    before = snapshot(run_dir)
    monkeypatch.setattr(eval_command.Policy, "from_saved", lambda *a: pytest.fail("the model loaded"))
    code, err = evaluate(capsys, f"eval.policy={run_dir}/final", f"eval.out={out.format(run=run_dir)}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("rlnotes: error: eval.out"), err
    assert snapshot(run_dir) == before


def test_evaluations_of_one_policy_each_get_a_dir_of_their_own_outside_the_run(runs, tmp_path, capsys, monkeypatch):
    """Two evaluations of one policy started in the same second, and a third told to write where the
    first did: before, each overwrote the one before it under RUN/eval/final."""
    import rlnotes.commands.eval as eval_command

    run_dir = copy_of(runs, "finished", tmp_path)
    before = snapshot(run_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(eval_command.time, "strftime", lambda *a: "2026-12-04_12-00-00")
    assert evaluate(capsys, f"eval.policy={run_dir}/final")[0] == 0
    assert evaluate(capsys, f"eval.policy={run_dir}/final", "eval.greedy=false", "eval.samples_per_prompt=2")[0] == 0
    first, second = sorted((tmp_path / "outputs" / "eval").iterdir())
    assert (first.name, second.name) == ("2026-12-04_12-00-00", "2026-12-04_12-00-00-1")
    assert len((first / "samples.jsonl").read_text().splitlines()) == 4
    assert len((second / "samples.jsonl").read_text().splitlines()) == 8
    kept = snapshot(first)
    code, err = evaluate(capsys, f"eval.policy={run_dir}/final", f"eval.out={first}")
    assert code == 2 and f"eval.out={first} holds another evaluation" in err, err
    assert snapshot(first) == kept and snapshot(run_dir) == before


def test_an_evaluation_started_inside_a_run_dir_does_not_write_there(runs, tmp_path, capsys, monkeypatch):
    """rlnotes eval started from inside a run dir (its default outputs/eval/<time> is relative):
    before the default moved out of RUN/eval/, nothing stopped it from writing into the run."""
    import rlnotes.commands.eval as eval_command

    run_dir = copy_of(runs, "finished", tmp_path)
    before = snapshot(run_dir)
    monkeypatch.chdir(run_dir)
    monkeypatch.setattr(eval_command.Policy, "from_saved", lambda *a: pytest.fail("the model loaded"))
    code, err = evaluate(capsys, "eval.policy=final")
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"is inside the run dir {run_dir}" in err, err
    assert snapshot(run_dir) == before and not (run_dir / "outputs").exists()


def test_an_evaluation_that_cannot_write_fails_before_the_model_loads(runs, tmp_path, capsys, monkeypatch):
    """Before: the whole evaluation ran, then a traceback writing its first file."""
    import rlnotes.commands.eval as eval_command

    monkeypatch.setattr(eval_command.Policy, "from_saved", lambda *a: pytest.fail("the model loaded"))
    (tmp_path / "file").write_text("mine\n")
    code, err = evaluate(capsys, f"eval.policy={runs['root']}/finished/final", f"eval.out={tmp_path / 'file'}")
    assert code == 2 and "is a file; choose a new or empty dir" in err, err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(locked))
                        and mode & os.W_OK else real(p, mode, **kw))  # as for root on a read-only file system
    code, err = evaluate(capsys, f"eval.policy={runs['root']}/finished/final", f"eval.out={locked / 'out'}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is not writable by this user" in err, err
    assert (tmp_path / "file").read_text() == "mine\n" and list(locked.iterdir()) == []


def test_a_checkpoint_pruned_while_it_is_evaluated_is_one_line(runs, tmp_path, capsys, monkeypatch):
    """The run that saved it prunes it (trainer.keep_last) while rlnotes eval loads it: before, a
    traceback from the loader; now one line naming the cause, and the evaluation's dir is removed."""
    import rlnotes.commands.eval as eval_command

    run_dir = copy_of(runs, "stopped", tmp_path)
    real = eval_command.Policy.from_saved

    def pruned_meanwhile(model, path, device):
        shutil.rmtree(path)
        return real(model, path, device)

    monkeypatch.setattr(eval_command.Policy, "from_saved", pruned_meanwhile)
    out = tmp_path / "ev"
    code, err = evaluate(capsys, f"eval.policy={run_dir}/checkpoints/step_000002", f"eval.out={out}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "step_000002 was removed while it loaded (its run's trainer.keep_last prunes" in err
    assert not out.exists()


def test_evaluating_a_shared_run_imports_none_of_its_code_unless_trusted(runs, tmp_path, capsys, monkeypatch):
    """A run dir someone else wrote, whose config.yaml names a reward in a file there: before,
    rlnotes eval imported and ran it, and wrote into the shared dir. Now it is named and refused
    unless eval.trust_run_code=true, and the shared dir is never written either way."""
    shared = copy_of(runs, "finished", tmp_path)
    marker = tmp_path / "imported"
    (shared / "score.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                     "def score(completions, **kwargs):\n    return [0.5] * len(completions)\n")
    config = (shared / "config.yaml").read_text()
    (shared / "config.yaml").write_text(config.replace("  target: null", f"  target: {shared}/score.py:score"))
    assert f"target: {shared}/score.py:score" in (shared / "config.yaml").read_text()
    before = snapshot(shared)
    monkeypatch.chdir(tmp_path)
    code, err = main(["eval", f"eval.policy={shared}/final", "eval.size=2"]), capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"names code that this evaluation would import and run (reward.target={shared}/score.py:score); add " \
           "eval.trust_run_code=true if you trust that run" in err, err
    assert not marker.exists() and snapshot(shared) == before
    code = main(["eval", f"eval.policy={shared}/final", "eval.size=2", "eval.trust_run_code=true"])
    assert code == 0 and marker.exists() and snapshot(shared) == before
