"""Checkpoints and resume: a run stopped at step k and resumed writes the same metrics as one that
never stopped; saves are atomic; keep_last prunes; Ctrl-C and SIGTERM leave a loadable checkpoint;
bad resume settings fail in one line before any model loads."""

import dataclasses
import importlib
import io
import json
import random
import shutil
import signal

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

import rlnotes
from rlnotes.algos import grpo
from rlnotes.algos.registry import REGISTRY
from rlnotes.commands.cli import UsageError
from rlnotes.commands.train import train
from rlnotes.core.errors import ConfigError
from rlnotes.run import checkpoint, config_file, restore
from tests.conftest import compose


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_metrics(run_dir):
    """The metrics rows without wall-clock keys, which differ between any two runs."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows(run_dir)]


def run(run_dir, *overrides):
    train(compose("logging.progress=false", "trainer.batch_size=4", *overrides), run_dir, Console(quiet=True))
    return training_metrics(run_dir)


def stop_at(monkeypatch, algo, call, sig, after=False):
    """Send `sig` to this process in the runner's `call`-th step: before it does anything but draw
    from every random stream and the data (which a stop must undo), or after its updates."""
    module = importlib.import_module(f"rlnotes.algos.{algo}")
    real, calls = module.train_step, []

    def step(ctx):
        calls.append(1)
        if len(calls) == call and not after:
            ctx.data.sampler.next_batch(), torch.rand(2, generator=ctx.run.generator), torch.rand(2), random.random()
            signal.raise_signal(sig)
        metrics = real(ctx)
        if len(calls) == call and after:
            signal.raise_signal(sig)
        return metrics

    monkeypatch.setitem(REGISTRY, algo, dataclasses.replace(REGISTRY[algo], train_step=step))


def stopped_then_resumed(tmp_path, monkeypatch, algo, call, sig, *overrides, after=False):
    """(uninterrupted metrics, metrics of a run stopped by `sig` and resumed with trainer.resume=auto)."""
    whole = run(tmp_path / "whole", *overrides)
    with monkeypatch.context() as patch:
        stop_at(patch, algo, call, sig, after)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "split", *overrides)
    return whole, run(tmp_path / "split", *overrides, "trainer.resume=auto")


# ---------------------------------------------------------------------------------------------
# Resumed == uninterrupted


@pytest.mark.parametrize("lora", [True, False])
def test_grpo_stopped_by_ctrl_c_resumes_exactly(tmp_path, monkeypatch, lora):
    """Ctrl-C in the 3rd step, after it drew from the data and every random stream: the checkpoint
    is step 2's state (the partial step is undone), and the resumed run repeats the uninterrupted
    one exactly, evaluations (trainer.eval_every) included."""
    overrides = ("trainer.steps=5", "trainer.eval_every=2", "eval.size=4", *(() if lora else ("model.lora=null",)))
    whole, resumed = stopped_then_resumed(tmp_path, monkeypatch, "grpo", 3, signal.SIGINT, *overrides)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert resumed == whole and "eval/reward" in resumed[4]
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "split")] == ["step_000002", "step_000005"]
    assert not (tmp_path / "split" / "interrupted").exists()


def test_reinforce_running_baseline_survives_sigterm(tmp_path, monkeypatch):
    """SIGTERM right after step 3's update: the step is finished and logged, then saved, with
    REINFORCE's running-mean baseline, which the next steps' advantages depend on."""
    overrides = ("algo=reinforce", "algo.baseline=mean", "trainer.steps=6")
    whole, resumed = stopped_then_resumed(tmp_path, monkeypatch, "reinforce", 3, signal.SIGTERM, *overrides,
                                          after=True)
    assert resumed == whole
    saved = torch.load(tmp_path / "split" / "checkpoints" / "step_000003" / checkpoint.STATE, weights_only=True)
    assert saved["cache"]["reinforce/mean_return"] != 0.0
    assert whole[3]["reward/baseline"] != whole[2]["reward/baseline"]  # it moves, so it had to be restored


def test_dpo_resumes_exactly_and_rebuilds_its_reference_table(tmp_path, monkeypatch):
    overrides = ("algo=dpo", "data=letters_pairs", "trainer.steps=6", "algo.precompute_ref=true", "trainer.eval_every=2",
                 "eval.size=8")
    whole, resumed = stopped_then_resumed(tmp_path, monkeypatch, "dpo", 4, signal.SIGINT, *overrides)
    assert resumed == whole and "eval/dpo_margin" in resumed[4]  # step 5: evaluated after the resume
    saved = torch.load(tmp_path / "split" / "checkpoints" / "step_000003" / checkpoint.STATE, weights_only=True)
    assert not set(saved["cache"]) & checkpoint.RECOMPUTED


def test_ppo_stopped_during_its_updates_finishes_the_batch(tmp_path, monkeypatch):
    """PPO makes 2 optimizer steps per sampled batch here (2 epochs of one minibatch): a SIGTERM
    after the first lets the batch finish (step 2), saves its checkpoint with the value head, and
    the run resumes exactly."""
    from rlnotes.algos import ppo

    real, calls = ppo.optimizer_step, []

    def signal_after_first_update(*parts):
        calls.append(1)
        out = real(*parts)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)
        return out

    whole = run(tmp_path / "whole", "algo=ppo", "trainer.steps=6")
    with monkeypatch.context() as patch:
        patch.setattr(ppo, "optimizer_step", signal_after_first_update)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "split", "algo=ppo", "trainer.steps=6")
    saved = checkpoint.checkpoints(tmp_path / "split")
    assert [p.name for p in saved] == ["step_000002"]
    assert checkpoint.read_manifest(saved[0])["heads"] == ["value_head"]
    assert run(tmp_path / "split", "algo=ppo", "trainer.steps=6", "trainer.resume=auto") == whole


def test_a_second_signal_mid_update_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    from rlnotes.algos import ppo

    real, calls = ppo.optimizer_step, []

    def two_signals(*parts):
        calls.append(1)
        if len(calls) == 6:  # the 2nd update of the 3rd batch; step 4, the end of the 2nd, was saved
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return real(*parts)

    monkeypatch.setattr(ppo, "optimizer_step", two_signals)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "algo=ppo", "trainer.steps=12", "trainer.save_every=4")
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_000004"]
    assert (tmp_path / "interrupted" / "adapter_config.json").exists()  # the policy as it was, not resumable


def test_a_finished_run_extends_and_a_path_carries_its_history(tmp_path):
    """resume=PATH from another run's checkpoint: the new run dir gets that run's rows up to the
    checkpoint's step, and more steps continue it as if it had been asked for them at first."""
    whole = run(tmp_path / "whole", "trainer.steps=6")
    run(tmp_path / "short", "trainer.steps=3")
    source = tmp_path / "short" / "checkpoints" / "step_000003"
    assert run(tmp_path / "long", "trainer.steps=6", f"trainer.resume={source}") == whole
    assert [r["step"] for r in rows(tmp_path / "short")] == [1, 2, 3]  # the source run is left alone
    # A run dir also works as the path: its latest checkpoint.
    assert restore.resolve(str(tmp_path / "long")) == tmp_path / "long" / "checkpoints" / "step_000006"


def test_optimizer_settings_changed_on_resume_apply_from_the_checkpoints_step(tmp_path, monkeypatch):
    """trainer.resume=auto optim.lr=1e-4 on a run trained at 3e-5: before, the optimizer's rate and the
    schedule's base came back from the checkpoint and the new rate was ignored. Now every setting the
    user changed is in the optimizer from the resumed step, at the schedule's position there: linear
    over 4 steps, step 3 (after 2) runs at lr (1 - 2/4), step 4 at lr (1 - 3/4)."""
    seen = []

    def step(ctx):
        group = ctx.model.optimizer.param_groups[0]
        seen.append((group["lr"], group["betas"], group["eps"], group["weight_decay"]))
        return grpo.train_step(ctx)

    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(REGISTRY["grpo"], train_step=step))
    common = ("trainer.steps=4", "optim.schedule=linear")
    run(tmp_path, *common, "optim.lr=3e-5", "trainer.save_every=2")
    assert [r["optim/lr"] for r in rows(tmp_path)] == pytest.approx([3e-5, 3e-5 * 0.75, 3e-5 * 0.5, 3e-5 * 0.25])
    shutil.rmtree(tmp_path / "final")
    shutil.rmtree(tmp_path / "checkpoints" / "step_000004")  # the run as if it had stopped after step 2
    seen.clear()
    console = Console(file=io.StringIO(), width=500)
    train(compose("logging.progress=false", "trainer.batch_size=4", *common, "optim.lr=1e-4", "optim.beta1=0.8",
                  "optim.weight_decay=0.1", "trainer.resume=auto"), tmp_path, console)
    assert seen == [(pytest.approx(1e-4 * 0.5), (0.8, 0.999), 1e-8, 0.1), (pytest.approx(1e-4 * 0.25), (0.8, 0.999),
                                                                           1e-8, 0.1)]
    assert [r["optim/lr"] for r in rows(tmp_path)][2:] == pytest.approx([1e-4 * 0.5, 1e-4 * 0.25])
    said = console.file.getvalue()
    assert (f"resuming from {tmp_path / 'checkpoints' / 'step_000002'} at step 2; optim.lr 3e-05 -> 0.0001, "
            "optim.weight_decay 0.0 -> 0.1, optim.beta1 0.9 -> 0.8 from step 2") in said, said


def test_resuming_an_earlier_checkpoint_drops_later_rows_and_checkpoints(tmp_path):
    whole = run(tmp_path, "trainer.steps=4", "trainer.save_every=1", "trainer.keep_last=null")
    earlier = tmp_path / "checkpoints" / "step_000002"
    assert run(tmp_path, "trainer.steps=4", f"trainer.resume={earlier}", "trainer.keep_last=null") == whole
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_000001", "step_000002", "step_000004"]


@pytest.mark.parametrize("fires_at", [2, 3])
def test_resume_gives_each_warning_once_over_the_whole_run(tmp_path, monkeypatch, fires_at):
    """A warning given at or before the checkpoint's step is not given again on resume (the watcher
    sees the steps before it); one given after it belongs to steps that are redone, and is given
    again at the same step, not twice in warnings.log."""
    from rlnotes.run import diagnostics

    fired = []  # the steps seen (restored ones included) each time the check fires

    def seen(history, cfg):
        if history.count("reward/mean") >= fires_at:
            fired.append(history.count("reward/mean"))
            return "steps seen"

    monkeypatch.setattr(diagnostics, "CHECKS", {"seen": seen})
    run(tmp_path, "trainer.steps=4", "trainer.save_every=2", "trainer.keep_last=null")
    warned = [f"step {fires_at} seen: steps seen"]
    assert (tmp_path / "warnings.log").read_text().splitlines() == warned and fired == [fires_at]
    fired.clear()
    run(tmp_path, "trainer.steps=4", f"trainer.resume={tmp_path / 'checkpoints' / 'step_000002'}")
    assert (tmp_path / "warnings.log").read_text().splitlines() == warned
    assert fired == ([] if fires_at <= 2 else [fires_at])


# ---------------------------------------------------------------------------------------------
# What a checkpoint is


def test_a_checkpoint_is_a_loadable_adapter_with_its_state(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from rlnotes.engine.model.loading import load_base

    cfg = compose("logging.progress=false", "trainer.steps=2")
    train(cfg, tmp_path, Console(quiet=True))
    path = tmp_path / "checkpoints" / "step_000002"
    manifest = checkpoint.read_manifest(path)
    assert manifest["step"] == 2 and manifest["bad_steps"] == 0 and manifest["heads"] == []
    assert manifest["sampler"] == {"epoch": 0, "pos": 2 * cfg.trainer.batch_size, "seed": 0,
                                   "rows": cfg.data.train_size}
    model = PeftModel.from_pretrained(load_base(cfg.model)[0], path)
    assert any("lora_B" in name and p.abs().sum() > 0 for name, p in model.named_parameters())
    saved, final = (load_file(str(d / "adapter_model.safetensors")) for d in (path, tmp_path / "final"))
    assert saved.keys() == final.keys() and all(torch.equal(saved[k], final[k]) for k in saved)
    state = torch.load(path / checkpoint.STATE, weights_only=True)
    assert state["scheduler"]["last_epoch"] == 2 and set(state["rng"]) == {"python", "torch", "generator"}


def saved_by(path, version):
    """Make the checkpoint at `path` look saved by rlnotes `version` (None: one that did not record
    its version in config.yaml), its manifest's file table to match."""
    saved = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"))
    saved.pop(config_file.VERSION_KEY)
    recorded = {config_file.VERSION_KEY: version, **saved} if version else saved
    (path / "config.yaml").write_text(OmegaConf.to_yaml(recorded))
    manifest = checkpoint.read_manifest(path)
    (path / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "files": checkpoint.file_table(path)}))


def test_config_yaml_records_the_rlnotes_that_made_it_and_older_runs_resume(tmp_path):
    """The run dir's and each checkpoint's config.yaml begin with the version of the rlnotes that
    wrote them; the command line cannot set it. A checkpoint whose config.yaml has no version (saved
    before rlnotes recorded it) resumes, and one saved by another version says so on resume."""
    run(tmp_path, "trainer.steps=2", "+rlnotes_version=9.9")
    first_line = f"{config_file.VERSION_KEY}: {rlnotes.__version__}\n"
    step_2 = tmp_path / "checkpoints" / "step_000002"
    for path in (tmp_path, step_2):
        assert (path / "config.yaml").read_text().startswith(first_line)
        assert "9.9" not in (path / "config.yaml").read_text()
    with pytest.raises(UsageError, match="rlnotes_version"):
        compose("rlnotes_version=9.9")
    saved_by(step_2, "0.0.1")
    same = compose("logging.progress=false", "trainer.batch_size=4", "trainer.steps=2")
    assert restore.check_config(step_2, same) == [f"rlnotes_version 0.0.1 -> {rlnotes.__version__}"]
    saved_by(step_2, None)
    assert restore.check_config(step_2, same) == []
    assert [r["step"] for r in run(tmp_path, "trainer.steps=3", "trainer.resume=auto")] == [1, 2, 3]
    assert (tmp_path / "config.yaml").read_text().startswith(first_line)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    run(tmp_path / "two", "trainer.steps=5", "trainer.save_every=1", "trainer.keep_last=2")
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "two")] == ["step_000004", "step_000005"]
    run(tmp_path / "end", "trainer.steps=3", "trainer.save_every=0")
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "end")] == ["step_000003"]


def test_save_every_counts_steps_that_jump():
    """PPO moves several optimizer steps a batch: a save is due when a batch passes a multiple."""
    from rlnotes.run.logger import passed_multiple

    assert [s for s in range(4, 41, 4) if passed_multiple(s - 4, s, 10)] == [12, 20, 32, 40]
    assert [s for s in range(1, 7) if passed_multiple(s - 1, s, 2)] == [2, 4, 6]
    assert not any(passed_multiple(s - 1, s, every) for s in range(1, 7) for every in (None, 0))


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The save of step 4 dies half-way (after the weights, before the optimizer state): step 2's
    checkpoint is untouched, the half-written one is never taken for a checkpoint, and
    resume=auto continues from step 2 to the same result as a run that never crashed."""
    overrides = ("trainer.steps=6", "trainer.save_every=2")
    whole = run(tmp_path / "whole", *overrides)

    real_save, saves = torch.save, []

    def dies_on_second_save(obj, f, *a, **k):
        saves.append(1)
        if len(saves) >= 2:  # and every save after it: the run's own retry of step 4 (common.rescue) too
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.torch, "save", dies_on_second_save)
        with pytest.raises(OSError, match="disk full"):
            run(tmp_path / "crash", *overrides)
    root = tmp_path / "crash" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # the failed save's temporary dir is removed
    assert restore.locate("auto", tmp_path / "crash") == root / "step_000002"
    assert run(tmp_path / "crash", *overrides, "trainer.resume=auto") == whole
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006"]  # leftovers pruned


def test_resume_auto_without_a_checkpoint_starts_fresh(tmp_path):
    """A run that died before its first checkpoint: resume=auto starts over (one line says so)
    and drops the dead attempt's rows instead of appending to them. (A run writes its config.yaml
    before its first row: a dir of rows alone is not a run, and is refused.)"""
    config_file.write(tmp_path / "config.yaml", compose("trainer.steps=2"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n')
    assert run(tmp_path, "trainer.steps=2", "trainer.resume=auto") == run(tmp_path / "fresh", "trainer.steps=2")


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("override, message", [
    ("trainer.save_every=-1", "trainer.save_every=-1 must be >= 0"),
    ("trainer.keep_last=0", "trainer.keep_last=0 must be at least 1"),
    ("trainer.resume=/no/such/dir", "trainer.resume=/no/such/dir: no such directory"),
])
def test_bad_settings_fail_in_one_line(override, message):
    with pytest.raises(UsageError, match=message):
        compose(override)


def test_bad_resume_paths_say_what_to_pass(tmp_path):
    with pytest.raises(UsageError, match="holds no checkpoint"):
        compose(f"trainer.resume={tmp_path}")
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)  # a save that never finished
    with pytest.raises(UsageError, match="is an incomplete checkpoint"):
        compose(f"trainer.resume={tmp_path / 'checkpoints' / 'step_000002'}")
    with pytest.raises(UsageError, match="holds no checkpoint"):
        compose(f"trainer.resume={tmp_path}")


def test_a_checkpoint_of_another_model_or_a_reused_dir_is_refused(tmp_path):
    run(tmp_path, "trainer.steps=1")
    with pytest.raises(ConfigError, match=r"other model settings \(model.lora.r 8 -> 4\)"):
        run(tmp_path / "other", "trainer.steps=2", "model.lora.r=4", f"trainer.resume={tmp_path}")
    with pytest.raises(ConfigError, match="already holds a run that finished at step 1.*trainer.resume=auto"):
        run(tmp_path, "trainer.steps=1")
    assert not (tmp_path / "other" / "config.yaml").exists()  # refused before any model loaded
