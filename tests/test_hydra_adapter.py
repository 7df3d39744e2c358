"""What rlnotes/commands/hydra.py takes from Hydra beyond its public API, checked against the Hydra
installed: the private names exist, accept what the adapter passes, and the error texts it reads
still say what it expects (each error made with real Hydra). A failure names the Hydra internal
that changed; nothing else in rlnotes may use Hydra's internals."""

import inspect
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import hydra as hydra_package
import pytest
import yaml
from omegaconf import OmegaConf

from rlnotes.commands import hydra
from rlnotes.commands.check import loader

ROOT = Path(__file__).resolve().parent.parent


def changed(internal: str, what: str) -> str:
    return (f"Hydra {hydra_package.__version__} changed {internal}: {what}. rlnotes/commands/hydra.py relies on "
            "it; adapt the adapter (and this test) to the installed Hydra")


def accepts(function, internal: str, *args, **kwargs) -> None:
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError as e:
        pytest.fail(changed(internal, f"it no longer accepts the arguments the adapter passes ({e})"))


def test_the_private_names_exist_and_accept_what_the_adapter_passes():
    internals = {}
    for module, name in [("hydra._internal.config_loader_impl", "ConfigLoaderImpl"),
                         ("hydra._internal.core_plugins.basic_sweeper", "BasicSweeper"),
                         ("hydra._internal.utils", "create_automatic_config_search_path"),
                         ("hydra._internal.utils", "get_args_parser"),
                         ("hydra._internal.hydra", "Hydra")]:
        try:
            internals[name] = getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            pytest.fail(changed(f"{module}.{name}", "it is gone"))
    Loader = internals["ConfigLoaderImpl"]
    search = internals["create_automatic_config_search_path"](None, None, f"pkg://{hydra.CONFIG_MODULE}")
    accepts(search.prepend, "ConfigSearchPath.prepend", "command-line", "file:///tmp")
    accepts(Loader, "ConfigLoaderImpl.__init__", config_search_path=search)
    accepts(Loader.load_configuration, "ConfigLoaderImpl.load_configuration", None, "config", [], hydra.RunMode.RUN)
    accepts(Loader.get_group_options, "ConfigLoaderImpl.get_group_options", None, "algo")
    accepts(internals["BasicSweeper"].split_arguments, "BasicSweeper.split_arguments", [], None)
    accepts(internals["Hydra"].get_mode, "Hydra.get_mode", None, config_name="config", overrides=[])
    args = internals["get_args_parser"]().parse_args(["-m", "--config-dir", "x", "seed=1"])
    for flag in ("overrides", "multirun", "config_dir", "help", "hydra_help", "cfg", "info", "shell_completion"):
        assert hasattr(args, flag), changed("hydra._internal.utils.get_args_parser", f"its result has no {flag}")
    assert hasattr(hydra.HydraConfig.instance(), "cfg"), changed("HydraConfig.instance().cfg", "it is gone")


def test_the_adapter_composes_and_splits_as_hydra_runs(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  steps: 7\n")
    cfg = hydra.compose(loader(str(tmp_path)), ["experiment=mine"])
    assert cfg.trainer.steps == 7 and "hydra" in cfg  # --config-dir searched, the hydra node composed
    assert "grpo" in hydra.group_options(loader(None), "algo")
    assert hydra.grid(hydra.parse_overrides(["seed=0,1", "algo=grpo,ppo"])) == [
        ["seed=0", "algo=grpo"], ["seed=0", "algo=ppo"], ["seed=1", "algo=grpo"], ["seed=1", "algo=ppo"]]
    held = hydra.HydraConfig.instance().cfg
    jobs = [hydra.compose(loader(None), ["hydra.run.dir=out/${hydra.job.num}"]) for _ in range(2)]
    assert hydra.job_dirs(jobs, ("hydra.run.dir",)) == [Path("out/0"), Path("out/1")]
    assert hydra.HydraConfig.instance().cfg is held  # put back as it was


def error(overrides):
    """The error composing `overrides` raises with real Hydra."""
    with pytest.raises(hydra.COMPOSE_ERRORS) as caught:
        hydra.compose(loader(None), overrides)
    return caught.value


@pytest.mark.parametrize("overrides, kind, fields", [
    (["algo=nope"], "missing_option", {"group": "algo", "option": "nope"}),
    (["logging=[tensorboard,nope]"], "missing_option", {"group": "logging", "option": "nope"}),
    (["hydra/sweeper=nope"], "missing_option", {"group": "hydra/sweeper", "option": "nope"}),
    (["trainer.stpes=1"], "unknown_key", {"key": "trainer.stpes"}),
    (["algo.nope.x=1"], "unknown_key", {"key": "algo.nope"}),
    (["trainer.steps=abc"], "bad_value",
     {"key": "trainer.steps", "line": "Value 'abc' of type 'str' could not be converted to Integer"}),
    (["seed=1,2"], "ambiguous", {"line": "Ambiguous value for argument 'seed=1,2'"}),
])
def test_hydra_composition_errors_read_as_the_adapter_expects(overrides, kind, fields):
    problem = hydra.read_error(error(overrides))
    assert problem.kind == kind, changed("the text of its composition errors",
                                         f"{overrides} now reads as {problem} instead of a {kind}")
    for field, value in fields.items():
        assert getattr(problem, field) == value, changed("the text of its composition errors",
                                                         f"{overrides}: {field} {getattr(problem, field)!r}")


def test_omegaconf_value_errors_read_as_the_adapter_expects():
    cfg = hydra.compose(loader(None), ["model.name_or_path=???"])
    with pytest.raises(hydra.COMPOSE_ERRORS) as caught:
        cfg.model.name_or_path
    problem = hydra.read_error(caught.value)
    assert (problem.kind, problem.key) == ("missing_value", "model.name_or_path"), changed(
        "OmegaConf's missing-value error text", str(problem))

    class Mode(Enum):
        a = 1

    @dataclass
    class Settings:
        mode: Mode = Mode.a

    with pytest.raises(hydra.COMPOSE_ERRORS) as caught:
        OmegaConf.structured(Settings).mode = "b"
    problem = hydra.read_error(caught.value)
    assert problem.kind == "bad_value" and problem.line.startswith("Invalid value 'b'"), changed(
        "OmegaConf's invalid-value error text", str(problem))


def test_an_override_that_does_not_parse_is_a_hydra_exception():
    with pytest.raises(hydra.HydraException):
        hydra.parse_overrides(["trainer.steps=["])


def test_only_the_adapter_uses_hydra_internals():
    users = [str(p.relative_to(ROOT)) for p in (ROOT / "rlnotes").rglob("*.py")
             if re.search(r"hydra\._internal", p.read_text()) and p != ROOT / "rlnotes/commands/hydra.py"]
    assert users == []


def test_a_run_in_process_leaves_the_callers_command_line_as_it_was(monkeypatch, tmp_path):
    """Hydra reads sys.argv; the adapter sets it for the call and puts the caller's back."""
    import sys

    from rlnotes.commands.validate import register

    register()  # the schemas, as `rlnotes train` registers them before its run
    monkeypatch.setattr(sys, "argv", ["my_script.py", "out.json"])
    seen = []
    argv = ["seed=3", f"hydra.run.dir={tmp_path}"]
    hydra.run(lambda cfg: seen.append(sys.argv[1:]), argv)
    assert seen == [argv] and sys.argv == ["my_script.py", "out.json"]


def test_a_config_composed_already_spares_hydra_a_composition_and_names_the_run_mode(monkeypatch, tmp_path):
    """Given the command's config, composed already (rlnotes.commands.check), Hydra composes once
    (for the run) where it composes twice (first only to read hydra.mode), and runs in the mode that
    config names: a sweep for hydra.mode=MULTIRUN without -m, as Hydra's own reading would."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from rlnotes.commands.check import loader

    configs = loader(None)  # registers the schemas, as `rlnotes train` does before its run
    load, calls, seen = ConfigLoaderImpl.load_configuration, [], []
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", lambda self, *a, **k: calls.append(1) or load(self, *a, **k))
    for composed in (None, hydra.compose(configs, ["seed=3"])):
        calls.clear()
        hydra.run(lambda cfg: seen.append(cfg.seed), ["seed=3", f"hydra.run.dir={tmp_path / str(len(seen))}"], composed)
        seen.append(len(calls))
    assert seen == [3, 2, 3, 1]
    sweep = ["seed=1,2", "hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    composed = hydra.compose(configs, ["seed=1", *sweep[1:]])
    assert composed.hydra.mode == hydra.RunMode.MULTIRUN
    hydra.run(lambda cfg: seen.append(cfg.seed), sweep, composed)
    assert seen[4:] == [1, 2]


def test_the_users_files_and_their_errors_read_as_the_adapter_expects(tmp_path):
    """What rlnotes.commands.userfiles relies on: a composition's defaults list names each config
    with its package, a --config-dir is a file source, an error while merging a file names it
    ("In 'experiment/port': ...") with OmegaConf's section keys, and PyYAML's error comes through."""
    (tmp_path / "experiment").mkdir()
    port = tmp_path / "experiment" / "port.yaml"
    port.write_text("# @package _global_\ntrainer:\n  steps: 7\n")
    configs = loader(str(tmp_path))
    files = hydra.user_files(configs, ["experiment=port"], "config")
    assert files == [hydra.UserFile("experiment/port", port, "")], changed(
        "ConfigLoader.compute_defaults_list or get_sources", f"the user's files read as {files}")
    assert hydra.user_file(configs, "algo/grpo") is None and hydra.includes(configs, [], "config", "train_schema")
    port.write_text("# @package _global_\ntrainer:\n  stpes: 7\n")
    with pytest.raises(hydra.COMPOSE_ERRORS) as caught:
        hydra.compose(configs, ["experiment=port"])
    problem = hydra.read_error(caught.value)
    assert (problem.kind, problem.key, problem.config) == ("unknown_key", "trainer.stpes", "experiment/port") \
        and "steps" in problem.valid, changed("the text of an error in a config file, or its cause", str(problem))
    port.write_text("# @package _global_\ntrainer:\n  steps: 3\n   batch_size: 2\n")
    with pytest.raises(hydra.COMPOSE_ERRORS) as caught:
        hydra.compose(configs, ["experiment=port"])
    assert isinstance(caught.value, yaml.YAMLError) and caught.value.problem_mark.line == 3, changed(
        "how a YAML syntax error in a config file comes out", repr(caught.value))
