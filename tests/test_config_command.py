"""`rlnotes config`: every key of the config a run would get, with its value, type, range or
options and meaning, without importing torch; docs/config.md is what it writes."""

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from rlnotes.algos.registry import REGISTRY
from rlnotes.commands import config
from rlnotes.commands.check import check, loader
from rlnotes.commands.cli import main
from rlnotes.commands.declared import declarations
from rlnotes.commands.hydra import compose, group_options
from rlnotes.commands.usage import UsageError
from rlnotes.core.comments import comments

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
OPTIONS = group_options(loader(None), "algo")


def test_a_config_holding_a_declared_schema_pickles_it_by_name_and_leaves_it_as_it_was():
    """A sweep's config travels to joblib's or submitit's processes and back (cloudpickle). Its algo
    node's class, the declared schema, must go by name: by value, the way back sets the class's
    fields to copies in which dataclasses.MISSING is no longer MISSING (every later composition in
    the process then reads garbage defaults)."""
    cloudpickle = pytest.importorskip("cloudpickle")
    import pickle

    for name in ("grpo", "ppo"):
        _, cfg = config.compose([f"algo={name}"])
        schema = OmegaConf.get_type(cfg.algo)
        assert schema is declarations()[name].schema
        before = [(f.default, f.default_factory) for f in dataclasses.fields(schema)]
        for module in (pickle, cloudpickle):
            back = module.loads(module.dumps(cfg))
            assert OmegaConf.get_type(back.algo) is schema and back == cfg
        assert all(a is b and c is d for (a, c), (b, d) in
                   zip(before, [(f.default, f.default_factory) for f in dataclasses.fields(schema)]))


def test_each_declaration_read_from_its_source_is_the_imported_one():
    """The config command reads the runner modules without importing them; what it reads must be
    what rlnotes.algos.registry.REGISTRY holds, for every algorithm."""
    found = declarations()
    assert set(found) == set(REGISTRY)
    for name, algo in REGISTRY.items():
        read = found[name]
        fields = lambda schema: [(f.name, typing.get_type_hints(schema)[f.name], f.default,  # noqa: E731
                                  f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                                 for f in dataclasses.fields(schema)]
        assert fields(read.schema) == fields(algo.schema), name
        assert read.ranges == algo.ranges, name
        assert read.choices == {key: tuple(table) for key, table in algo.choices.items()}, name
        assert read.default_task == algo.default_task, name
        assert read.comments == comments(algo.schema), name
        declared = read.algorithm  # what the check before any load validates with
        for key in ("samples", "objective", "train_objective", "columns"):
            assert getattr(declared, key) == getattr(algo, key), (name, key)
        for key in ("check", "shape", "group_relative"):  # run alone from the same statements
            mine, theirs = getattr(declared, key).__code__, getattr(algo, key).__code__
            assert (mine.co_code, mine.co_consts, mine.co_names) == (theirs.co_code, theirs.co_consts,
                                                                     theirs.co_names), (name, key)


@pytest.mark.parametrize("option", OPTIONS)
def test_each_declaration_checks_and_shapes_a_config_as_the_imported_one(option):
    from tests.conftest import compose as composed

    cfg = composed(f"algo={option}")
    declared, imported = declarations()[cfg.algo.name].algorithm, REGISTRY[cfg.algo.name]
    assert declared.shape(cfg) == imported.shape(cfg)
    assert declared.group_relative(cfg.algo) == imported.group_relative(cfg.algo)
    cfg.trainer.steps = 3  # refused by some algorithms' own checks (GRPO's epochs, PPO's minibatches...)
    if "group_size" in cfg.algo:
        cfg.algo.group_size = 1
    outcomes = []
    for algo in (declared, imported):
        try:
            outcomes.append(algo.check(cfg))
        except Exception as e:  # noqa: BLE001 - the same refusal, whatever it is
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("option", OPTIONS)
def test_it_composes_what_train_composes_and_lists_every_key(option):
    _, listed = config.compose([f"algo={option}"])
    real = compose(loader(None), [f"algo={option}"])  # with the imported schemas, as `rlnotes train` does
    for cfg in (listed, real):
        with open_dict(cfg):
            del cfg["hydra"]
    assert OmegaConf.to_container(listed) == OmegaConf.to_container(real)
    keys = {s.key for section in config.sections(listed, declarations()[listed.algo.name]) for s in section.settings}
    plain = OmegaConf.to_container(listed)

    def leaves(node, prefix):  # every key whose value is not a section
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            nested = dataclasses.is_dataclass(OmegaConf.get_type(OmegaConf.select(listed, dotted))) \
                if isinstance(value, dict) else False
            yield from leaves(value, dotted + ".") if nested else [dotted]

    assert set(leaves(plain, "")) <= keys, "keys of the composed config that `rlnotes config` does not list"


@pytest.mark.parametrize("key", sorted(config.CHOICES))
def test_the_options_it_lists_are_the_ones_the_checks_accept(key):
    with pytest.raises(UsageError) as err:
        check([f"{key}=bogus"], multirun=False, config_dir=None)
    assert f"choose one of: {', '.join(config.CHOICES[key])}" in str(err.value)


def test_it_lists_value_type_range_and_meaning(capsys):
    assert main(["config", "algo=ppo", "algo.beta=0.2", "algo", "trainer.steps"]) == 0
    out = capsys.readouterr().out
    assert "algo.beta = 0.2  (float, at least 0)\n      The weight of the KL penalty; 0 turns it off." in out
    assert "algo.kl_estimator = k3  (str, one of: k1, k2, k3)" in out
    assert "trainer.steps = 60  (int, at least 1)" in out and "optim.lr" not in out and "config groups" not in out


def test_a_mistake_is_one_line(capsys):
    for argv, expected in ((["trainer.stpes=1"], "did you mean trainer.steps?"),
                           (["algo=foo"], "algo=foo is not an option"),
                           (["trainr"], "no setting is trainr; did you mean trainer? sections: algo, model"),
                           (["trainer.stpes"], "no setting is trainer.stpes; did you mean trainer.steps? sections:"),
                           (["nothing_here"], "no setting is nothing_here; sections: algo, model"),
                           (["--markdown", "algo"], "--markdown writes the whole page")):
        assert main(["config", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("rlnotes: error: ") and expected in err and "\n" not in err, err


def test_it_imports_neither_torch_nor_transformers():
    probe = ("import sys; from rlnotes.commands.cli import main; main(['config', 'algo=ppo']); "
             "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]" and "algo.minibatch_size = 16" in out.stdout


def test_docs_config_md_is_what_the_command_writes():
    assert DOC.read_text() == config.markdown(), (
        f"docs/config.md is not what `rlnotes config --markdown` writes now (a schema comment, default, range "
        f"or preset changed); regenerate it: {config.REGENERATE}")
