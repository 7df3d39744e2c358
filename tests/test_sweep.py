"""Sweeps: the objective a member returns, members that fail, seeds as an axis, the pre-check of a
search, and the Hydra plugins of the `sweep` extra (Optuna, joblib, submitit), each skipped when
its plugin is not installed."""

import csv
import json
import math
import os
from pathlib import Path

import pytest
import yaml

from rlnotes.algos.registry import REGISTRY
from rlnotes.commands.check import check, loader
from rlnotes.commands.check import members as job_members
from rlnotes.commands.cli import UsageError, main
from rlnotes.commands.launch import launcher_overrides
from rlnotes.commands.sweep import optuna_history, seed_groups, summarize
from rlnotes.run.records import RESULT_FILE, load_run, objective_metric, objective_value
from tests.conftest import compose

TINY = ["trainer.steps=2", "logging.progress=false", "trainer.save_every=0"]


def _summary(sweep_dir: Path):
    with (sweep_dir / "summary.csv").open() as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / RESULT_FILE).read_text())


def objective(cfg):
    return objective_metric(cfg.sweep, cfg.trainer.eval_every, REGISTRY[cfg.algo.name])


# ---------------------------------------------------------------------------------------------
# The objective


def test_auto_objective_is_the_held_out_score_when_the_run_evaluates():
    assert objective(compose()) == ("reward/mean", "maximize")
    assert objective(compose("trainer.eval_every=5")) == ("eval/accuracy", "maximize")
    assert objective(compose("algo=sft")) == ("eval/sft_loss", "minimize")  # its preset evaluates
    assert objective(compose("algo=sft", "trainer.eval_every=null")) == ("loss", "minimize")
    assert objective(compose("algo=dpo")) == ("eval/dpo_accuracy", "maximize")
    assert objective(compose("sweep.objective=kl/ref")) == ("kl/ref", "minimize")
    assert objective(compose("sweep.objective=kl/ref", "sweep.direction=maximize")) == ("kl/ref", "maximize")


def test_objective_value_final_eval_or_mean_of_the_last_steps():
    rows = [{"step": s, "reward/mean": float(s)} for s in range(1, 6)]
    rows[1]["eval/accuracy"], rows[4]["eval/accuracy"] = 0.25, 0.5
    assert objective_value(rows, "eval/accuracy", 3) == 0.5          # the trained policy's score
    assert objective_value(rows, "reward/mean", 3) == (3 + 4 + 5) / 3  # a noisy batch metric: averaged
    assert objective_value(rows, "reward/mean", 10) == 3.0
    assert objective_value(rows, "kl/ref", 3) is None


def test_a_bad_sweep_setting_fails_in_one_line(capsys):
    assert main(["train", "sweep.direction=up"]) == 2
    assert "sweep.direction='up' is not valid; choose one of: maximize, minimize" in capsys.readouterr().err
    assert main(["train", "sweep.seeds=3"]) == 2
    assert "sweep.seeds=3 runs each configuration 3 times, once per seed: add -m" in capsys.readouterr().err
    assert main(["train", "sweep.objective=eval/accuracy"]) == 2
    assert "is logged only when the run evaluates: set trainer.eval_every=N" in capsys.readouterr().err
    assert main(["train", "-m", "sweep.seeds=3", "seed=0,1"]) == 2
    assert "give the seeds one way" in capsys.readouterr().err
    assert main(["train", "-m", "seed=0,1", "hydra.launcher.setup=[source ~/venv]"]) == 2
    assert "hydra.launcher.setup=[source ~/venv] (quote a value" in capsys.readouterr().err
    assert main(["train", "-m", "hydra/launcher=slurm", "seed=0,1"]) == 2
    err = capsys.readouterr().err  # a launcher that is not there, and where the plugins come from
    assert "hydra/launcher=slurm is not an option" in err and "pip install 'rlnotes[sweep]'" in err


def test_sweep_settings_are_bookkeeping_for_a_resumed_member():
    from rlnotes.run.restore import config_changes

    fatal, changed = config_changes(compose(), compose("sweep.seeds=3", "sweep.objective=kl/ref", "seed=2"))
    assert fatal == [] and changed == ["seed 0 -> 2"]


# ---------------------------------------------------------------------------------------------
# The pre-check of a search: representatives of its parameters


def test_search_members_are_representatives_one_parameter_at_a_time():
    members = job_members(["optim.lr=tag(log, interval(1e-5, 1e-2))", "algo=choice(grpo,ppo)", "trainer.steps=2"], True)
    assert members == [["optim.lr=1e-05", "algo=grpo", "trainer.steps=2"],
                       ["optim.lr=0.01", "algo=grpo", "trainer.steps=2"],
                       ["optim.lr=1e-05", "algo=ppo", "trainer.steps=2"]]


@pytest.mark.parametrize("override, expected", [
    ("optim.lr=interval(0, 1e-2)", "optim.lr=0 must be in (0, 1]"),
    ("optim.lrr=interval(1e-5, 1e-2)", "optim.lrr is not a setting; did you mean optim.lr? valid keys under optim: lr"),
    ("algo=choice(grpo,gpro)", "algo=gpro is not an option"),
])
def test_a_search_with_a_mistake_fails_before_any_run(override, expected, tmp_path, capsys):
    assert main(["train", "-m", override, *TINY, f"hydra.sweep.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


def test_a_search_space_in_a_yaml_file_is_checked_too(tmp_path, capsys):
    _plugin("hydra_plugins.hydra_optuna_sweeper")
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "search.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /hydra/sweeper: optuna\n"
        "hydra:\n  sweeper:\n    params:\n      optim.lr: interval(0, 1e-2)\n      algo.beta: interval(0, 0.1)\n")
    command = ["train", "-m", "--config-dir", str(tmp_path / "conf"), "experiment=search",
               f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    assert main(command) == 2
    assert "optim.lr=0 must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "sweep").exists()
    # The command line's own range for a parameter replaces the file's.
    members = job_members(["experiment=search", "optim.lr=interval(1e-4, 1e-2)"], True,
                       loader(str(tmp_path / "conf")))
    assert {m[2] for m in members} == {"optim.lr=0.0001", "optim.lr=0.01"}  # after experiment=search
    assert {m[0] for m in members} == {"algo.beta=0.0", "algo.beta=0.1"}


# ---------------------------------------------------------------------------------------------
# Seeds as an axis, and a member that fails (Hydra's basic sweeper: always runs)


def _seed_rows(tmp_path: Path):
    """Members written by hand: two configurations x two seeds, one of which failed."""
    runs = []
    for i, (beta, seed, value) in enumerate([(0, 0, 1.0), (0, 1, 3.0), (0.1, 0, 2.0), (0.1, 1, None)]):
        run = tmp_path / str(i)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"algo.beta={beta}", f"seed={seed}",
                                                                        "trainer.steps=2"]))
        rows = [{"step": 1, "reward/mean": value if value is not None else 0.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        status = "completed" if value is not None else "failed"
        (run / RESULT_FILE).write_text(json.dumps({"status": status, "objective": "reward/mean",
                                                   "direction": "maximize", "value": value, "error": ""}))
        runs.append(load_run(run))
    return runs


def test_seed_groups_report_mean_and_sample_std_of_completed_seeds(tmp_path):
    groups = seed_groups(_seed_rows(tmp_path))
    by = {row["configuration"]: row for row in groups.rows}
    assert set(by) == {"algo.beta=0", "algo.beta=0.1"}
    assert by["algo.beta=0"]["seeds"] == "2/2" and by["algo.beta=0.1"]["seeds"] == "1/2"
    assert by["algo.beta=0"]["objective mean"] == 2.0
    assert by["algo.beta=0"]["objective std"] == pytest.approx(math.sqrt(2.0))  # (1 - 2)^2 + (3 - 2)^2 over n - 1
    assert by["algo.beta=0.1"]["objective mean"] == 2.0 and by["algo.beta=0.1"]["objective std"] is None
    assert seed_groups(_seed_rows(tmp_path / "again")[::2]) is None  # one seed per configuration: no groups


def test_summary_keeps_failed_members_last_and_history_tracks_the_best(tmp_path):
    runs = _seed_rows(tmp_path)
    summary = summarize(runs)
    assert [r["run"] for r in summary.rows] == ["1", "2", "0", "3"]
    assert summary.rows[-1]["status"] == "failed" and summary.rows[-1]["objective"] is None
    history = optuna_history(summary, "max")
    assert [h["best"] for h in history] == [1.0, 3.0, 3.0, 3.0]
    assert [h["best"] for h in optuna_history(summary, "min")] == [1.0, 1.0, 1.0, 1.0]


def test_seeds_sweep_groups_members_and_a_failed_member_does_not_stop_it(tmp_path, monkeypatch, capsys):
    """`-m sweep.seeds=2 algo.beta=0,0.1`: four members; the one with seed 1 and beta 0.1 fails."""
    from rlnotes.core.errors import TrainingError
    from rlnotes.training import loop as common

    train = common.train

    def failing(cfg, algo, run_dir, console):
        if cfg.seed == 1 and cfg.algo.beta == 0.1:
            raise TrainingError("the loss is nan")
        return train(cfg, algo, run_dir, console)

    monkeypatch.setattr(common, "train", failing)
    code = main(["train", "-m", "sweep.seeds=2", "algo.beta=0,0.1", *TINY, f"hydra.sweep.dir={tmp_path}"])
    assert code == 1  # every member ran; the command says that one failed
    rows = _summary(tmp_path)
    assert {r["overrides"]: r["status"] for r in rows.values()} == {
        "algo.beta=0 seed=0": "completed", "algo.beta=0 seed=1": "completed",
        "algo.beta=0.1 seed=0": "completed", "algo.beta=0.1 seed=1": "failed"}
    failed = next(r for r in rows.values() if r["status"] == "failed")
    assert failed["error"] == "the loss is nan" and failed["objective"] == ""
    assert _result(tmp_path / failed["run"])["status"] == "failed"
    for row in rows.values():
        if row["status"] == "completed":
            rewards = load_run(tmp_path / row["run"]).series("reward/mean")[1]
            assert float(row["objective"]) == pytest.approx(sum(rewards) / len(rewards))
    with (tmp_path / "summary_by_config.csv").open() as f:
        groups = {r["configuration"]: r for r in csv.DictReader(f)}
    assert groups["algo.beta=0"]["seeds"] == "2/2" and groups["algo.beta=0.1"]["seeds"] == "1/2"
    assert "Configurations over their seeds" in (tmp_path / "summary.md").read_text()
    assert "1 of 4 members failed" in capsys.readouterr().out


def test_a_sweep_run_again_with_resume_auto_finishes_what_is_left_and_leaves_finished_members(tmp_path, monkeypatch):
    """Ctrl-C in the sweep's second member, then the same command again (docs/runs.md): the first,
    finished member was refused ('finished at step 3, and trainer.steps=3 asks for no more'), so the
    sweep could not go on. Now it is left as it is (its files unchanged), the second resumes from its
    checkpoint, and the summary has both."""
    import hashlib
    import signal

    from tests.test_checkpoint import stop_at

    args = ["train", "-m", "seed=0,1", "trainer.steps=3", "trainer.save_every=1", "trainer.resume=auto",
            "logging.progress=false", f"hydra.sweep.dir={tmp_path}"]
    with monkeypatch.context() as patch:
        stop_at(patch, "grpo", 5, signal.SIGINT)  # member 0 takes calls 1-3; member 1 stops in its second step
        assert main(args) == 130
    first = tmp_path / "0"

    def files():  # what the runs wrote (.hydra/ gets the new command's record, as any resume's)
        return {str(p.relative_to(first)): hashlib.sha256(p.read_bytes()).hexdigest() for p in first.rglob("*")
                if p.is_file() and ".hydra" not in p.parts}

    before = files()
    assert [json.loads(line)["step"] for line in (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()] == [1]
    assert main(args) == 0
    assert files() == before
    assert [json.loads(line)["step"] for line in (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert {r["overrides"]: r["status"] for r in _summary(tmp_path).values()} == {"seed=0": "completed",
                                                                                  "seed=1": "completed"}
    assert main(args) == 0 and files() == before  # and again, with nothing left to do


def test_a_member_that_never_logged_its_objective_failed(tmp_path):
    """With algo.beta=0 there is no reference pass, so no kl/ref: nothing to return."""
    assert main(["train", "-m", "sweep.objective=kl/ref", "algo.beta=0", *TINY, f"hydra.sweep.dir={tmp_path}"]) == 1
    result = _result(tmp_path / "0")
    assert result["status"] == "failed" and result["value"] is None
    assert result["error"].startswith("sweep.objective=kl/ref was not logged by this run")


# ---------------------------------------------------------------------------------------------
# The plugins of the `sweep` extra


def _plugin(name: str):
    pytest.importorskip(name, reason="the sweep extra: pip install 'rlnotes[sweep]'")


def test_optuna_direction_follows_the_objective():
    _plugin("hydra_plugins.hydra_optuna_sweeper")
    optuna = ["hydra/sweeper=optuna", "optim.lr=interval(1e-5, 1e-2)"]
    assert "hydra.sweeper.direction=maximize" in launcher_overrides(check(optuna, True, None), optuna)
    sft = [*optuna, "algo=sft"]
    assert "hydra.sweeper.direction=minimize" in launcher_overrides(check(sft, True, None), sft)
    clash = [*optuna, "hydra.sweeper.direction=minimize"]
    with pytest.raises(UsageError, match="disagrees with the objective's direction"):
        launcher_overrides(check(clash, True, None), clash)


def test_optuna_study_of_three_trials_survives_a_failed_trial(tmp_path, monkeypatch):
    _plugin("hydra_plugins.hydra_optuna_sweeper")
    from rlnotes.training import loop as common

    train, calls = common.train, []

    def second_fails(cfg, algo, run_dir, console):
        calls.append(run_dir)
        if len(calls) == 2:
            raise RuntimeError("out of memory")  # not an rlnotes error: a crash the study must survive
        return train(cfg, algo, run_dir, console)

    monkeypatch.setattr(common, "train", second_fails)
    code = main(["train", "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                 "hydra.sweeper.sampler.seed=0", "optim.lr=tag(log, interval(1e-5, 1e-2))",
                 "algo.beta=interval(0, 0.1)", *TINY, f"hydra.sweep.dir={tmp_path}"])
    assert code == 1 and len(calls) == 3
    rows = _summary(tmp_path)
    assert [rows[n]["status"] for n in "012"] == ["completed", "failed", "completed"]
    assert rows["1"]["error"] == "RuntimeError: out of memory"
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    winner = max("02", key=lambda n: float(rows[n]["objective"]))
    assert best["best_value"] == pytest.approx(float(rows[winner]["objective"]))
    assert set(best["best_params"]) == {"optim.lr", "algo.beta"}
    md = (tmp_path / "summary.md").read_text()
    assert "## Optuna study" in md and "best trial: optim.lr=" in md and "| 1 | failed | - |" in md

    pytest.importorskip("matplotlib")
    from rlnotes.commands.plot import plot

    assert tmp_path / "objective.png" in plot([tmp_path]).figures
    assert "## Optuna study" in (tmp_path / "summary.md").read_text()  # plot rewrote it with its sections


@pytest.mark.long
def test_joblib_runs_members_in_parallel_processes_with_threads_shared_out(tmp_path, capsys):
    """Two members in loky worker processes; the second's reward function breaks its contract."""
    _plugin("hydra_plugins.hydra_joblib_launcher")
    (tmp_path / "user_rewards.py").write_text("def good(completions, **_):\n    return [0.5] * len(completions)\n\n"
                                              "def broken(completions, **_):\n    return [0.5]\n")
    target = tmp_path / "user_rewards.py"
    out = tmp_path / "sweep"
    code = main(["train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "reward=custom",
                 f"reward.target={target}:good,{target}:broken", *TINY, f"hydra.sweep.dir={out}"])
    assert code == 1
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"2 members at a time (hydra/launcher=joblib), {threads} thread" in capsys.readouterr().err
    rows = _summary(out)
    assert rows["0"]["status"] == "completed" and float(rows["0"]["objective"]) == 0.5
    assert rows["1"]["status"] == "failed" and "returned 1 values for 32 completions" in rows["1"]["error"]
    assert yaml.safe_load((out / "0" / "config.yaml").read_text())["hardware"]["threads"] == threads


@pytest.mark.long
def test_submitit_local_members_have_their_own_run_dirs_and_resume(tmp_path):
    _plugin("hydra_plugins.hydra_submitit_launcher")
    command = ["train", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "logging.progress=false",
               "trainer.save_every=1", "trainer.resume=auto", f"hydra.sweep.dir={tmp_path}"]
    assert main([*command, "seed=0,1", "trainer.steps=2"]) == 0
    rows = _summary(tmp_path)
    assert {r["overrides"]: r["status"] for r in rows.values()} == {"seed=0": "completed", "seed=1": "completed"}
    assert all((tmp_path / n / "checkpoints").is_dir() and (tmp_path / n / "final").is_dir() for n in "01")
    # Member 0 again in the same dir, as submitit requeues a preempted member: it resumes from its checkpoint.
    assert main([*command, "seed=0", "trainer.steps=3"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "0" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and _result(tmp_path / "0")["status"] == "completed"
    log = "".join(p.read_text() for p in (tmp_path / ".submitit").glob("*/*_log.err"))
    assert f"resuming from {tmp_path / '0' / 'checkpoints' / 'step_000002'} at step 2" in log
