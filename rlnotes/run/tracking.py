"""Experiment trackers that receive every metrics row: TensorBoard, Weights & Biases, MLflow, trackio.

metrics.jsonl is always written (rlnotes.run.logger); the trackers chosen with the `logging` group
(`logging=[tensorboard,mlflow]`) get the same rows through a sink each: `sink.log(step, row)` for
every row and `sink.close()` at the end. Every tracker records the run's name and its command-line
overrides, and in a multirun the sweep as a group, so the members of a sweep are told apart.
Each tracker's package is an optional extra of the same name (`pip install 'rlnotes[wandb]'`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol

from rlnotes.core.errors import ConfigError
from rlnotes.run.records import read_overrides, sweep_dir_of, swept_overrides

# Tracker -> the module it needs (each installed by the pip extra of the tracker's name).
BACKENDS: Dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


class Sink(Protocol):
    def log(self, step: int, row: Dict[str, Optional[float]]) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunInfo:
    """What a tracker is told about the run besides its metrics."""

    name: str                 # logging.name, or the dir name plus the overrides that set it apart
    project: str              # wandb/trackio project, MLflow experiment
    group: Optional[str]      # the sweep's dir name in a multirun, else None
    overrides: List[str]      # every command-line override of the run
    swept: List[str]          # the overrides its sweep varied (empty outside a sweep)
    config: Dict[str, Any]    # the resolved config as plain data
    run_dir: Path
    sweep_dir: Optional[Path]


def enabled(logging_cfg) -> List[str]:
    """The trackers switched on in `logging`, in BACKENDS order."""
    return [name for name in BACKENDS if getattr(logging_cfg, name, False)]


def _installed(module: str) -> bool:
    if sys.modules.get(module) is not None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_message(backend: str) -> str:
    return f"logging={backend} needs the {BACKENDS[backend]} package; install it with: pip install 'rlnotes[{backend}]'"


def check_backends(logging_cfg) -> None:
    """Fail before any model loads when a chosen tracker's package is not installed."""
    for name in enabled(logging_cfg):
        if not _installed(BACKENDS[name]):
            raise ConfigError(missing_message(name))


def _import(backend: str, module: Optional[str] = None):
    try:
        return importlib.import_module(module or BACKENDS[backend])
    except ImportError:
        raise ConfigError(missing_message(backend)) from None


def run_info(logging_cfg, run_dir: Path, config: Dict[str, Any]) -> RunInfo:
    """Name, group and overrides of the run in `run_dir`, from its `logging` config section and
    Hydra's files there; `config`: the run's resolved config as plain data, which trackers record."""
    run_dir = Path(run_dir)
    sweep_dir = sweep_dir_of(run_dir)
    overrides = read_overrides(run_dir)
    swept = swept_overrides(run_dir)
    if logging_cfg.name:
        name = logging_cfg.name
    elif sweep_dir is not None:
        name = " ".join([f"{sweep_dir.name}/{run_dir.name}", *swept])
    else:
        name = " ".join([run_dir.name, *overrides])
    return RunInfo(name=name[:128], project=logging_cfg.project, group=sweep_dir.name if sweep_dir else None,
                   overrides=overrides, swept=swept, config=config,
                   run_dir=run_dir, sweep_dir=sweep_dir)


def flatten(config: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{"algo": {"beta": 0.1}} -> {"algo.beta": 0.1}; lists stay whole."""
    flat: Dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def scalars(row: Dict[str, Optional[float]]) -> Dict[str, float]:
    """The row's metrics without `step` and without missing (null) values."""
    return {k: v for k, v in row.items() if k != "step" and v is not None}


class TensorBoardSink:
    """Event files in RUN_DIR/tensorboard; the run's name and overrides as text."""

    def __init__(self, info: RunInfo):
        _import("tensorboard")
        from torch.utils.tensorboard import (
            SummaryWriter,  # optional: needs the tensorboard extra, checked above
        )

        self.writer = SummaryWriter(log_dir=str(info.run_dir / "tensorboard"), flush_secs=10)
        self.writer.add_text("run/name", info.name)
        self.writer.add_text("run/overrides", " ".join(info.overrides) or "(none)")

    def log(self, step: int, row: Dict[str, Optional[float]]) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in RUN_DIR/wandb: project, name, the sweep as group, swept overrides as tags."""

    def __init__(self, info: RunInfo):
        wandb = _import("wandb")
        config = {**info.config, "overrides": info.overrides, "run_dir": str(info.run_dir)}
        try:
            # quiet: no history table at the end (the run's own summary has the numbers).
            self.run = wandb.init(project=info.project, name=info.name, group=info.group, config=config,
                                  tags=[t[:64] for t in info.swept], dir=str(info.run_dir),
                                  settings=wandb.Settings(quiet=True))
        except Exception as e:  # no API key, no network, ...: say how to log without them
            raise ConfigError(f"wandb could not start a run ({str(e).strip().splitlines()[0]}); set "
                              "WANDB_MODE=offline to log locally, or run `wandb login`") from None

    def log(self, step: int, row: Dict[str, Optional[float]]) -> None:
        self.run.log(scalars(row), step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_uri(info: RunInfo) -> str:
    """$MLFLOW_TRACKING_URI, else an SQLite store in the sweep dir (multirun) or the run dir."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(info.sweep_dir or info.run_dir).resolve() / 'mlflow.db'}"


class MLflowSink:
    """An MLflow run in experiment `logging.project`: the flattened config as params, the overrides as tags."""

    def __init__(self, info: RunInfo):
        mlflow = _import("mlflow")
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # database set-up chatter
        logging.getLogger("alembic").setLevel(logging.WARNING)
        self.mlflow = mlflow
        mlflow.set_tracking_uri(mlflow_uri(info))
        experiment = mlflow.get_experiment_by_name(info.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # artifacts beside the store, not in the current directory
            where = (info.sweep_dir or info.run_dir).resolve() / "mlartifacts"
            experiment_id = mlflow.create_experiment(info.project, artifact_location=where.as_uri())
        tags = {"rlnotes.run_dir": str(info.run_dir), "rlnotes.overrides": " ".join(info.overrides)}
        if info.group:
            tags["rlnotes.sweep"] = info.group
        self.run = mlflow.start_run(experiment_id=experiment_id, run_name=info.name, tags=tags)
        mlflow.log_params({k: str(v)[:500] for k, v in flatten(info.config).items()})

    def log(self, step: int, row: Dict[str, Optional[float]]) -> None:
        self.mlflow.log_metrics(scalars(row), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class TrackioSink:
    """A trackio run: project, name, the sweep as group, the config with the overrides."""

    def __init__(self, info: RunInfo):
        self.trackio = _import("trackio")
        self.trackio.init(project=info.project, name=info.name, group=info.group,
                          config={**info.config, "overrides": info.overrides})

    def log(self, step: int, row: Dict[str, Optional[float]]) -> None:
        self.trackio.log(scalars(row), step=step)

    def close(self) -> None:
        self.trackio.finish()


SINKS: Dict[str, Callable[[RunInfo], Sink]] = {"tensorboard": TensorBoardSink, "wandb": WandbSink,
                                               "mlflow": MLflowSink, "trackio": TrackioSink}


def open_sinks(logging_cfg, run_dir: Path, config: Dict[str, Any]) -> List[Sink]:
    """A sink per tracker switched on in the `logging` config section (none by default), each
    told the run's resolved `config` (plain data); if one fails to start, those already started
    are closed and the error is raised."""
    names = enabled(logging_cfg)
    if not names:
        return []
    info = run_info(logging_cfg, run_dir, config)
    sinks: List[Sink] = []
    try:
        for name in names:
            sinks.append(SINKS[name](info))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
