"""Stopping a run: Ctrl-C and SIGTERM save a checkpoint that a second signal does not cut short
(only a third abandons it), every stop prints the exact command that resumes the run, SIGTERM
exits with 143 and SIGINT with 130, and a full disk is one line that keeps the earlier checkpoints.
The subprocess tests send real signals to a real `rlnotes train` whose saves are slowed
(tests/stop_worker.py)."""

import dataclasses
import errno
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from rlnotes.commands.cli import main
from rlnotes.commands.train import train
from rlnotes.run import checkpoint
from tests.conftest import compose

WORKER = Path(__file__).with_name("stop_worker.py")
ENDLESS = ("trainer.steps=100000", "trainer.save_every=null", "logging.progress=false", "trainer.batch_size=4")


def rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture
def start(tmp_path):
    """start(*args, delay=s): `rlnotes train ARGS` in a subprocess whose saves take `delay` s more;
    one still running when the test ends (it failed) is killed."""
    procs = []

    def spawn(*args, delay=1.0):
        env = dict(os.environ, OMP_NUM_THREADS="1", SAVE_DELAY=str(delay), SAVE_MARK=str(tmp_path / "saving"))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "train", *args], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_for(condition, proc, timeout=120):
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def finish(proc):
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def resume_line(err):
    """The command printed under 'resume with:'."""
    lines = err.splitlines()
    return lines[lines.index("resume with:") + 1].strip()


@pytest.mark.long
def test_two_ctrl_c_50_ms_apart_still_save_and_the_printed_command_resumes(tmp_path, start):
    run_dir = tmp_path / "run"
    proc = start(*ENDLESS, f"hydra.run.dir={run_dir}")
    wait_for(lambda: len(rows(run_dir)) >= 2, proc)
    proc.send_signal(signal.SIGINT)  # in a step: its checkpoint is the last completed step's
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # while the (1 s) save runs: it says so, and does not abandon it
    code, err = finish(proc)
    assert code == 130, err
    assert "SIGINT: saving " in err and "before stopping; press Ctrl-C again to abandon it" in err, err
    assert "Traceback" not in err
    (saved,) = checkpoint.checkpoints(run_dir)
    step = checkpoint.read_manifest(saved)["step"]
    assert f"SIGINT at step {step}: checkpoint saved to" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [saved.name]
    command = resume_line(err)
    assert command == (f"rlnotes train {' '.join(ENDLESS)} trainer.resume=auto hydra.run.dir={run_dir}")
    words = shlex.split(command)
    assert main([*words[1:], f"trainer.steps={step + 1}"]) == 0  # the same run, one step further
    assert [r["step"] for r in rows(run_dir)] == list(range(1, step + 2))


@pytest.mark.long
def test_a_third_ctrl_c_abandons_the_save_and_leaves_nothing_half_written(tmp_path, start):
    run_dir = tmp_path / "run"
    proc = start(*ENDLESS, f"hydra.run.dir={run_dir}", delay=30)
    wait_for(lambda: len(rows(run_dir)) >= 1, proc)
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: (tmp_path / "saving").exists(), proc)
    proc.send_signal(signal.SIGINT)  # warns
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)  # abandons
    code, err = finish(proc)
    assert code == 130, err
    assert "press Ctrl-C again to abandon it" in err and "was abandoned; there is no checkpoint yet" in err, err
    assert "Traceback" not in err and "resume with:" in err
    assert list((run_dir / "checkpoints").iterdir()) == []  # the temporary dir is gone too


@pytest.mark.long
def test_sigterm_in_a_sweep_member_saves_exits_143_and_names_that_member(tmp_path, start):
    sweep = tmp_path / "sweep"
    proc = start("-m", "seed=1,2", *ENDLESS, f"hydra.sweep.dir={sweep}", delay=0)
    wait_for(lambda: len(rows(sweep / "0")) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 143, err
    (saved,) = checkpoint.checkpoints(sweep / "0")
    assert f"SIGTERM at step {checkpoint.read_manifest(saved)['step']}: checkpoint saved to" in err, err
    member = " ".join(ENDLESS).replace("=false", "=False")  # as Hydra writes a sweep member's overrides
    assert resume_line(err) == f"rlnotes train seed=1 {member} trainer.resume=auto hydra.run.dir={sweep / '0'}"
    assert not (sweep / "1").exists()


# ---------------------------------------------------------------------------------------------
# In-process: the same machinery, signals raised in this process


def run(run_dir, *overrides, console=None):
    console = console or Console(file=io.StringIO(), width=1000)
    train(compose("logging.progress=false", "trainer.batch_size=4", *overrides), run_dir, console)
    return console


def signals_during_stop_save(monkeypatch, count, step=4):
    """SIGINT in the `step`-th step, then `count` more while the stop's checkpoint (of the step
    before) is written."""
    from rlnotes.algos import grpo
    from rlnotes.algos.registry import REGISTRY

    real_step, real_save, calls = grpo.train_step, torch.save, []

    def step_fn(ctx):
        calls.append(1)
        if len(calls) == step:
            signal.raise_signal(signal.SIGINT)
        return real_step(ctx)

    def save(*args, **kwargs):
        if ".step_%06d.tmp" % (step - 1) in str(args[1]):
            for _ in range(count):
                signal.raise_signal(signal.SIGINT)
        return real_save(*args, **kwargs)

    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(REGISTRY["grpo"], train_step=step_fn))
    monkeypatch.setattr(checkpoint.torch, "save", save)


@pytest.mark.parametrize("count", [1, 2])
def test_one_more_signal_during_the_save_warns_two_abandon_it(tmp_path, monkeypatch, count):
    signals_during_stop_save(monkeypatch, count)
    console = Console(file=io.StringIO(), width=1000)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "trainer.steps=10", "trainer.save_every=2", console=console)
    out = console.file.getvalue()
    assert "SIGINT: saving the checkpoint of step 3 to" in out and "press Ctrl-C again to abandon it" in out
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    if count == 1:
        assert names == ["step_000002", "step_000003"] and "SIGINT at step 3: checkpoint saved to" in out
    else:  # abandoned: the earlier checkpoint stays, the temporary dir is removed
        assert names == ["step_000002"], names
        assert "the checkpoint of step 3 was abandoned; the latest checkpoint is" in out


def test_a_stop_before_the_first_step_during_setup_and_in_the_updates_prints_the_resume_command(
        tmp_path, monkeypatch, capsys):
    """Every way a stop can happen, through the command: a stop while loading, in PPO's updates
    (two signals: the policy goes to interrupted/), and SIGTERM exits with 143."""
    from rlnotes.engine.policy import policy
    from rlnotes.algos import ppo

    def no_model(*args, **kwargs):
        raise KeyboardInterrupt

    conf = tmp_path / "conf"  # a user's config dir goes into the command too
    conf.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(policy.Policy, "from_config", no_model)
        assert main(["train", "--config-dir", str(conf), "trainer.steps=2", f"hydra.run.dir={tmp_path / 'a'}",
                     "logging.progress=false"]) == 130
    err = capsys.readouterr().err
    assert f"resume with:\n  rlnotes train --config-dir {conf} trainer.steps=2 logging.progress=false " \
           f"trainer.resume=auto hydra.run.dir={tmp_path / 'a'}" in err, err

    real, calls = ppo.optimizer_step, []

    def two_signals(*parts):
        calls.append(1)
        if len(calls) == 4:  # the 2nd update of the 2nd batch: the first signal waits for the batch's end
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
        return real(*parts)

    with monkeypatch.context() as patch:
        patch.setattr(ppo, "optimizer_step", two_signals)
        code = main(["train", "algo=ppo", "trainer.steps=12", "trainer.save_every=2", "trainer.batch_size=4",
                     f"hydra.run.dir={tmp_path / 'b'}", "logging.progress=false"])
    err = capsys.readouterr().err
    assert code == 143, err
    assert "SIGTERM during the updates of the step after 2" in err and "the latest checkpoint is" in err, err
    assert "resume with:\n  rlnotes train algo=ppo" in err and "rlnotes: interrupted (SIGTERM)" in err


# ---------------------------------------------------------------------------------------------
# A full disk


def test_a_full_disk_is_one_line_that_keeps_the_earlier_checkpoints(tmp_path, monkeypatch, capsys):
    real, saves = torch.save, []

    def full_on_second_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_on_second_save)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["train", "trainer.steps=6", "trainer.save_every=2", "trainer.batch_size=4", "logging.progress=false",
              f"hydra.run.dir={run_dir}"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlnotes: error:")]
    assert lines == [f"rlnotes: error: no space left on device while saving checkpoint step_000004 to "
                     f"{run_dir / 'checkpoints'}; the previous checkpoints are kept (the latest: step_000002): "
                     f"free space and resume with: rlnotes train trainer.steps=6 trainer.save_every=2 "
                     f"trainer.batch_size=4 logging.progress=false trainer.resume=auto hydra.run.dir={run_dir}"], err
    assert "Traceback" not in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002"]


@pytest.mark.parametrize("error, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), True),  # safetensors
    (OSError(errno.EACCES, "Permission denied"), False),
    (KeyboardInterrupt(), False),
])
def test_out_of_space_is_recognised_in_each_form(tmp_path, error, full):
    assert checkpoint.out_of_space(error, tmp_path) == full


# ---------------------------------------------------------------------------------------------
# A run stopped by an error keeps the steps it finished


def test_a_reward_that_breaks_mid_run_keeps_the_finished_steps_and_says_how_to_resume(tmp_path, monkeypatch,
                                                                                        capsys):
    """A reward function that fails on every sample from step 4 stops the run in one line; the
    checkpoint of step 3 is saved (save_every is far away) and the printed command resumes it."""
    module = tmp_path / "breaks_at_four.py"
    module.write_text("def score(completions, trainer_state, **kwargs):\n"
                      "    if trainer_state.global_step == 3:\n"
                      "        raise RuntimeError('the grader is down')\n"
                      "    return [0.5] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    args = ["train", "reward=custom", "reward.target=breaks_at_four.score", "trainer.steps=6",
            "trainer.save_every=100", "trainer.batch_size=4", "logging.progress=false", f"hydra.run.dir={run_dir}"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "rlnotes: error: reward function 'score' gave no finite number" in err, err
    assert f"the checkpoint of that step is in {run_dir / 'checkpoints' / 'step_000003'}" in err
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step_000003"]
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]
    command = resume_line(err.replace("after a fix, resume with:", "resume with:"))
    assert command.endswith(f"trainer.resume=auto hydra.run.dir={run_dir}") and "reward.target=" in command


def test_a_bug_mid_run_keeps_the_finished_steps(tmp_path, monkeypatch):
    """An unexpected exception before a step's update (here from sampling in step 3) still leaves
    the checkpoint of the last completed step, whole and verified."""
    from rlnotes.algos import grpo

    real = grpo.sample_and_score

    def sample_and_score(rollouts, model, data, run, *args, **kwargs):
        if run.step == 2:
            raise AttributeError("a bug")
        return real(rollouts, model, data, run, *args, **kwargs)

    monkeypatch.setattr(grpo, "sample_and_score", sample_and_score)
    run_dir = tmp_path / "run"
    cfg = compose("trainer.steps=5", "trainer.batch_size=4", "logging.progress=false")
    with pytest.raises(AttributeError, match="a bug"):
        train(cfg, run_dir, Console(file=io.StringIO()))
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step_000002"]
    assert checkpoint.verify(checkpoint.checkpoints(run_dir)[0]) is None


# ---------------------------------------------------------------------------------------------
# SIGHUP (a closed terminal or SSH session), a full disk mid-log, and paths the resume line must quote


@pytest.fixture
def terminal_hup():
    """SIGHUP with its default disposition, as a terminal's process has it. A suite started under
    nohup inherits SIGHUP ignored, and a run rightly keeps it so (test below): the tests of the
    terminal's case would then see no stop at all."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


def hup_in_step(monkeypatch, call=3):
    from rlnotes.algos import grpo
    from rlnotes.algos.registry import REGISTRY

    real, calls = grpo.train_step, []

    def step(ctx):
        calls.append(1)
        if len(calls) == call:
            signal.raise_signal(signal.SIGHUP)
        return real(ctx)

    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(REGISTRY["grpo"], train_step=step))


def test_sighup_saves_a_checkpoint_exits_129_and_prints_the_resume_command(tmp_path, monkeypatch, capsys, terminal_hup):
    """Before: SIGHUP's default action killed the run with no checkpoint of its last step and no
    resume command. Now it stops the run as SIGTERM does."""
    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        hup_in_step(patch)
        code = main(["train", "trainer.steps=6", "trainer.save_every=100", "trainer.batch_size=4",
                     "logging.progress=false", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 129 and "SIGHUP at step 2: checkpoint saved to" in err and "rlnotes: interrupted (SIGHUP)" in err
    assert [p.name for p in checkpoint.checkpoints(run_dir)] == ["step_000002"]
    assert main(shlex.split(resume_line(err))[1:]) == 0
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 7))


def test_sighup_ignored_by_nohup_stays_ignored(tmp_path, monkeypatch):
    """A run started with `nohup` asked to outlive its terminal: its SIGHUP is left ignored."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        hup_in_step(monkeypatch)
        run(tmp_path, "trainer.steps=4")
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]


class FullFile(io.StringIO):
    """A file whose disk fills up: every write after the first `rows` raises ENOSPC."""

    def __init__(self, real, rows):
        super().__init__()
        self.real, self.rows = real, rows

    def write(self, text):
        if self.rows == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.rows -= 1
        return self.real.write(text)

    def flush(self):
        self.real.flush()

    def close(self):
        self.real.close()


def test_a_full_disk_while_a_metrics_row_is_written_is_one_line_and_resumes(tmp_path, monkeypatch, capsys):
    """Before: a traceback (OSError from metrics.jsonl's write). Now the line a full disk during a
    checkpoint gives: what was kept and the command that resumes once there is space."""
    from rlnotes.run import logger

    real_append = logger.files.append
    monkeypatch.setattr(logger.files, "append", lambda path: FullFile(real_append(path), 3)
                        if path.name == "metrics.jsonl" else real_append(path))
    run_dir = tmp_path / "run"
    args = ["train", "trainer.steps=6", "trainer.save_every=2", "trainer.batch_size=4", "logging.progress=false",
            f"hydra.run.dir={run_dir}"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlnotes: error:")]
    assert lines == [f"rlnotes: error: no space left on device while writing the run's files in {run_dir}; the "
                     "previous checkpoints are kept (the latest: step_000002): free space and resume with: rlnotes "
                     "train trainer.steps=6 trainer.save_every=2 trainer.batch_size=4 logging.progress=false "
                     f"trainer.resume=auto hydra.run.dir={run_dir}"], err
    assert "Traceback" not in err
    monkeypatch.setattr(logger.files, "append", real_append)
    assert main(shlex.split(lines[0].rpartition("resume with: ")[2])[1:]) == 0
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 7))


def test_the_printed_resume_command_pastes_for_a_path_hydra_would_not_read_unquoted(tmp_path, monkeypatch, capsys, terminal_hup):
    """A run dir with a non-ASCII letter, `~`, a space and a quote: before, the printed command
    named it unquoted for Hydra and failed with a lexer error when pasted."""
    from rlnotes.core.overrides import override_value

    run_dir = tmp_path / "rün ~1 'q'"
    with monkeypatch.context() as patch:
        hup_in_step(patch)
        code = main(["train", "trainer.steps=4", "trainer.batch_size=4", "logging.progress=false",
                     f"hydra.run.dir={override_value(str(run_dir))}"])
    err = capsys.readouterr().err
    assert code == 129 and (run_dir / "checkpoints" / "step_000002").is_dir(), err
    assert main(shlex.split(resume_line(err))[1:]) == 0, capsys.readouterr().err
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]
