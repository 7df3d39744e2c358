"""Trackers: TensorBoard written and read back for real; wandb, MLflow and trackio against stand-in
modules that record the calls they get; names and overrides that tell sweep members apart."""

import sys
import types
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlnotes.commands.check import check
from rlnotes.commands.cli import UsageError, main
from rlnotes.core.errors import ConfigError
from rlnotes.run import tracking
from tests.conftest import compose

ROWS = [{"step": 1, "reward/mean": 0.25, "kl/ref": None, "loss": -0.5},
        {"step": 2, "reward/mean": 0.75, "kl/ref": 0.125, "loss": 0.5}]


def open_sinks(cfg, run_dir: Path):
    """tracking.open_sinks of a composed config: its logging section, and the whole as plain data."""
    return tracking.open_sinks(cfg.logging, run_dir, OmegaConf.to_container(cfg, resolve=True))


def _sweep_member(tmp_path: Path, num: int = 1, overrides=("trainer.steps=2", "seed=1")) -> Path:
    """A run dir inside a sweep dir, with the files Hydra writes there (`-m seed=0,1 trainer.steps=2`)."""
    sweep = tmp_path / "12-00-00-grpo"
    (sweep / str(num) / ".hydra").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {
        "task": ["trainer.steps=2", "seed=0,1"]}}}))
    (sweep / str(num) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    return sweep / str(num)


def _log(sinks):
    for row in ROWS:
        for sink in sinks:
            sink.log(row["step"], row)
    for sink in sinks:
        sink.close()


class Recorder:
    """Stands in for a tracker's module or run object: records every call as (name, args, kwargs)."""

    def __init__(self, returns=None):
        self.calls, self.returns = [], returns or {}

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            value = self.returns.get(name)
            if isinstance(value, Exception):
                raise value
            return value
        return call

    def named(self, name):
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


def _fake_module(monkeypatch, name, returns=None) -> Recorder:
    recorder = Recorder(returns)
    module = types.ModuleType(name)
    module.__getattr__ = recorder.__getattr__  # module-level functions: init, log, ...
    monkeypatch.setitem(sys.modules, name, module)
    return recorder


def test_tensorboard_event_file_holds_every_logged_value(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _sweep_member(tmp_path)
    sinks = open_sinks(compose("logging=tensorboard"), run_dir)
    assert [type(s) for s in sinks] == [tracking.TensorBoardSink]
    _log(sinks)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward/mean", "kl/ref", "loss"}
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("kl/ref")] == [(2, 0.125)]  # null left out
    name = events.Tensors("run/name/text_summary")[0].tensor_proto.string_val[0].decode()
    assert name == "12-00-00-grpo/1 seed=1"


def test_wandb_gets_name_group_tags_config_and_rows(tmp_path, monkeypatch):
    run = Recorder()
    wandb = _fake_module(monkeypatch, "wandb", {"init": run})
    run_dir = _sweep_member(tmp_path)
    _log(open_sinks(compose("logging=wandb", "algo.beta=0.5"), run_dir))
    [(_, init)] = wandb.named("init")
    assert init["name"] == "12-00-00-grpo/1 seed=1" and init["group"] == "12-00-00-grpo"
    assert init["project"] == "rlnotes" and init["tags"] == ["seed=1"] and init["dir"] == str(run_dir)
    assert init["config"]["overrides"] == ["trainer.steps=2", "seed=1"] and init["config"]["algo"]["beta"] == 0.5
    assert run.named("log") == [(({"reward/mean": 0.25, "loss": -0.5},), {"step": 1}),
                                (({"reward/mean": 0.75, "kl/ref": 0.125, "loss": 0.5},), {"step": 2})]
    assert len(run.named("finish")) == 1


def test_mlflow_gets_an_sqlite_store_in_the_sweep_dir_params_tags_and_rows(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow = _fake_module(monkeypatch, "mlflow", {"get_experiment_by_name": None, "create_experiment": "7"})
    run_dir = _sweep_member(tmp_path)
    _log(open_sinks(compose("logging=mlflow", "logging.project=letters"), run_dir))
    sweep = run_dir.parent.resolve()
    assert mlflow.named("set_tracking_uri") == [((f"sqlite:///{sweep / 'mlflow.db'}",), {})]
    artifacts = (sweep / "mlartifacts").as_uri()
    assert mlflow.named("create_experiment") == [(("letters",), {"artifact_location": artifacts})]
    [(_, start)] = mlflow.named("start_run")
    assert start["experiment_id"] == "7" and start["run_name"] == "12-00-00-grpo/1 seed=1"
    assert start["tags"]["rlnotes.overrides"] == "trainer.steps=2 seed=1"
    assert start["tags"]["rlnotes.sweep"] == sweep.name
    [((params,), _)] = mlflow.named("log_params")
    assert params["algo.beta"] == "0.04" and params["trainer.steps"] == "60" and params["seed"] == "0"
    assert [(args[0], kw["step"]) for args, kw in mlflow.named("log_metrics")] == [
        ({"reward/mean": 0.25, "loss": -0.5}, 1), ({"reward/mean": 0.75, "kl/ref": 0.125, "loss": 0.5}, 2)]
    assert len(mlflow.named("end_run")) == 1


def test_mlflow_uses_the_users_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    mlflow = _fake_module(monkeypatch, "mlflow", {"get_experiment_by_name": types.SimpleNamespace(experiment_id="3")})
    _log(open_sinks(compose("logging=mlflow"), tmp_path))
    assert mlflow.named("set_tracking_uri") == [(("http://127.0.0.1:5000",), {})]
    assert not mlflow.named("create_experiment") and mlflow.named("start_run")[0][1]["experiment_id"] == "3"


def test_several_trackers_at_once_get_the_same_rows(tmp_path, monkeypatch):
    trackio = _fake_module(monkeypatch, "trackio")
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["optim.lr=0.01"]))
    sinks = open_sinks(compose("logging=[trackio,tensorboard]"), run_dir)
    assert [type(s) for s in sinks] == [tracking.TensorBoardSink, tracking.TrackioSink]
    _log(sinks)
    [(_, init)] = trackio.named("init")
    assert init["name"] == "run optim.lr=0.01" and init["group"] is None  # a single run: dir name + overrides
    assert [kw["step"] for _, kw in trackio.named("log")] == [1, 2] and len(trackio.named("finish")) == 1
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_logging_name_wins_and_no_tracker_means_no_sink(tmp_path):
    cfg = compose("logging.name=baseline")
    assert tracking.run_info(cfg.logging, _sweep_member(tmp_path), {}).name == "baseline"
    assert open_sinks(cfg, tmp_path) == []


def test_a_tracker_that_fails_to_start_closes_the_others_and_says_what_to_do(tmp_path, monkeypatch):
    run = Recorder()
    _fake_module(monkeypatch, "wandb", {"init": run})
    _fake_module(monkeypatch, "mlflow", {"set_tracking_uri": RuntimeError("store locked")})
    with pytest.raises(RuntimeError, match="store locked"):
        open_sinks(compose("logging=[wandb,mlflow]"), tmp_path)
    assert len(run.named("finish")) == 1
    _fake_module(monkeypatch, "wandb", {"init": RuntimeError("api_key not configured (no-tty)\nmore")})
    with pytest.raises(ConfigError, match=r"^wandb could not start a run \(api_key not configured \(no-tty\)\); "
                                          r"set WANDB_MODE=offline"):
        open_sinks(compose("logging=wandb"), tmp_path)


def test_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(UsageError, match=r"^logging=wandb needs the wandb package; install it with: "
                                         r"pip install 'rlnotes\[wandb\]'$"):
        check(["logging=[tensorboard,wandb]"], multirun=False, config_dir=None)
    assert main(["train", "logging=wandb"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlnotes: error: logging=wandb needs the wandb package; install it with: pip install 'rlnotes[wandb]'"]


def test_unknown_tracker_lists_the_choices():
    with pytest.raises(UsageError, match="^logging=neptune is not an option; choose one of: mlflow, tensorboard, "
                                         "trackio, wandb$"):
        check(["logging=[tensorboard,neptune]"], multirun=False, config_dir=None)


def test_flatten_and_scalars():
    assert tracking.flatten({"algo": {"beta": 0.1, "x": {"y": [1, 2]}}, "seed": 0}) == {
        "algo.beta": 0.1, "algo.x.y": [1, 2], "seed": 0}
    assert tracking.scalars({"step": 3, "a": 1.0, "b": None}) == {"a": 1.0}


def test_a_training_run_sends_its_metrics_rows_to_tensorboard(tmp_path):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["train", "trainer.steps=2", "logging=tensorboard", "logging.progress=false",
                 f"hydra.run.dir={tmp_path}"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("reward/mean", "loss", "kl/ref"):
        logged = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, pytest.approx(v, rel=1e-6)) for s, v in logged]
    name = events.Tensors("run/overrides/text_summary")[0].tensor_proto.string_val[0].decode()
    assert name == "trainer.steps=2 logging=tensorboard logging.progress=false"
