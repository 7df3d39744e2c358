"""A preset that restates a schema default says so, and stays equal to it.

A conf/ file may repeat a schema default for readability (conf/algo/grpo.yaml lists GRPO's settings,
which are its defaults). The rule, for every value a conf/ file sets:

  1. a line marked `# default` (at its end) holds the schema's default for its key;
  2. a value equal to the schema's default is marked `# default`.

So changing a default in a schema fails here until every file that restates it changes too, or
drops the mark where it means to keep its own value (then it is an override, and unmarked). Changing
a restated value in a file fails until its mark goes (it is an override now) or the default moves
with it. Equality is decided afresh on every run, from the schema and the file, and the only record
of which values are restatements is the mark beside each one: nothing to rewrite when an unrelated
default changes, and no list kept anywhere else.

"The schema's default" is the dataclass field's (rlnotes/core/schema.py and its sections; the algo
section's is the schema of the algorithm the file pulls in with /algo_<name>_schema), not what
another preset sets. Not checked: conf/experiment/ (a recipe's values are its own, measured, and must
not follow a default), `algo.name` (the algorithm the file chooses, the schema's own name) and keys
inside a dict-valued setting (reward.functions[].args, eval.data, data.columns), which have no
schema default.
"""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlnotes.algos.registry import REGISTRY
from rlnotes.core.comments import field_type
from rlnotes.core.schema import TrainConfig

CONF = Path(__file__).resolve().parents[1] / "conf"
MARK = re.compile(r"#\s*default\b")
FILES = sorted(p for p in CONF.rglob("*.yaml") if p.parent.name != "experiment")
NO_DEFAULT = object()


def default(schema, name):
    f = next(f for f in dataclasses.fields(schema) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return NO_DEFAULT if f.default in (dataclasses.MISSING, "???") else f.default


def same(a, b) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def settings(path: Path, conf: Path = CONF):
    """(key, line number, value, marked, the schema's default) of every value `path` sets."""
    text = path.read_text()
    lines, values = text.splitlines(), OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    package = "_global_" if "# @package _global_" in text or path.parent == conf else path.parent.name
    algo = re.search(r"/algo_(\w+)_schema", text)
    algo = REGISTRY[algo.group(1)].schema if algo else None
    root, prefix = (TrainConfig, "") if package == "_global_" else (algo, "algo.") if package == "algo" \
        else (field_type(TrainConfig, package), f"{package}.")

    def walk(node, value, schema, key, top=False):
        for k, v in node.value:
            name, sub = k.value, f"{key}{k.value}"
            if top and name in ("defaults", "hydra"):  # the file's defaults list, Hydra's own settings
                continue
            kind = algo if (schema is TrainConfig and name == "algo") else field_type(schema, name)
            item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
            if dataclasses.is_dataclass(kind) and isinstance(v, yaml.MappingNode):
                yield from walk(v, value[name], kind, sub + ".")
            elif dataclasses.is_dataclass(item) and isinstance(v, yaml.SequenceNode):
                for i, element in enumerate(v.value):
                    yield from walk(element, value[name][i], item, f"{sub}[{i}].")
            elif typing.get_origin(kind) is not dict and sub != "algo.name":
                line = lines[k.start_mark.line]
                comment = line[v.end_mark.column:] if v.end_mark.line == k.start_mark.line else line[k.end_mark.column:]
                yield sub, k.start_mark.line + 1, value[name], bool(MARK.search(comment)), default(schema, name)

    yield from walk(yaml.compose(text), values, root, prefix, top=True)


def problems(path: Path, conf: Path = CONF):
    """A line for each value of `path` that breaks the rule."""
    out = []
    for key, line, value, marked, schema_default in settings(path, conf):
        where = f"conf/{path.relative_to(conf)}:{line} {key}: {value!r}"
        if marked and not same(value, schema_default):
            shown = "none (required)" if schema_default is NO_DEFAULT else repr(schema_default)
            out.append(f"{where} is marked `# default`, but the schema's default is {shown}: change the value "
                       "with the default, or drop the mark to keep it as this file's own")
        if same(value, schema_default) and not marked:
            out.append(f"{where} is the schema's default: mark it `# default` if it restates it, or drop the line")
    return out


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(CONF)) for p in FILES])
def test_a_value_that_restates_a_schema_default_is_marked_and_equal_to_it(path):
    found = problems(path)
    assert not found, "\n".join(found)


def test_the_rule_finds_an_unmarked_restatement_and_a_stale_mark(tmp_path):
    """Top-level and nested keys, a list, a mark followed by more comment, algo keys by the schema
    the file pulls in."""
    (tmp_path / "model").mkdir()
    (tmp_path / "algo").mkdir()
    model = tmp_path / "model" / "x.yaml"
    model.write_text("chat_template: true  # default, as most models want\nsystem_prompt: null\n"
                     "name_or_path: tiny\nlora:\n  r: 8  # default\n"
                     "  target_modules: [q_proj, k_proj, v_proj, o_proj]  # default\n")
    algo = tmp_path / "algo" / "x.yaml"
    algo.write_text("defaults:\n  - /algo_ppo_schema@_here_\n  - _self_\nname: ppo\nbeta: 0.05\nlam: 0.9  # default\n")
    found = [line.split(" is ")[0] for path in (model, algo) for line in problems(path, tmp_path)]
    assert found == ["conf/model/x.yaml:2 model.system_prompt: None", "conf/model/x.yaml:3 model.name_or_path: 'tiny'",
                     "conf/model/x.yaml:5 model.lora.r: 8", "conf/algo/x.yaml:5 algo.beta: 0.05",
                     "conf/algo/x.yaml:6 algo.lam: 0.9"]
