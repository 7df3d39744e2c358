"""Each algorithm's declaration as its runner module states it, read from the module's source
without importing it: its schema, ranges, choices and default task, for `rlnotes config`.

A runner module imports torch and transformers (seconds), and listing the settings needs none of
that. So the config command reads rlnotes/runners/*.py instead: the `ALGORITHM = Algorithm(...)`
statement; the schema's class statement, run alone with the names a schema may use (dataclasses,
typing, AlgoConfig, MISSING); `ranges=` as the literal it is; and each `choices=` table by name,
followed through the module's imports to the literal that defines it (its keys are the options).
The imported declarations (rlnotes.runners.REGISTRY) stay what runs and validates;
tests/test_config_command.py checks that both readings agree for every algorithm.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Tuple

from omegaconf import MISSING

from rlnotes.core.comments import comments, file_comments
from rlnotes.core.schema import AlgoConfig

PACKAGE = Path(__file__).resolve().parents[1]  # rlnotes/
# What the class statement of a schema may name.
SCHEMA_NAMES = {"dataclass": dataclass, "field": field, "AlgoConfig": AlgoConfig, "MISSING": MISSING,
                **{name: getattr(typing, name) for name in ("Any", "Dict", "List", "Optional", "Tuple", "Union")}}


@dataclass(frozen=True)
class Declared:
    name: str                          # algo.name
    path: Path                         # its runner module
    schema: type                       # its schema's class, made from the class statement alone
    comments: Dict[str, str]           # {field: comment}, inherited fields' included
    ranges: Dict[str, str]             # as Algorithm.ranges
    choices: Dict[str, Tuple[str, ...]]  # {key: its options}
    default_task: str


@functools.lru_cache(maxsize=None)
def declarations() -> Dict[str, Declared]:
    """{algo.name: its declaration} of every runner module that declares ALGORITHM."""
    found = {}
    for path in sorted((PACKAGE / "runners").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        call = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                     and [getattr(t, "id", None) for t in node.targets] == ["ALGORITHM"]), None)
        if call is not None:
            declared = _declared(path, tree, {k.arg: k.value for k in call.keywords})
            found[declared.name] = declared
    return found


def _declared(path: Path, tree: ast.Module, keywords: Dict[str, ast.expr]) -> Declared:
    schema = _schema(path, tree, keywords["schema"].id)
    choices = keywords.get("choices")
    return Declared(
        name=ast.literal_eval(keywords["name"]), path=path, schema=schema,
        comments={**comments(schema.__base__), **file_comments(str(path)).get(schema.__name__, {})},
        ranges=ast.literal_eval(keywords["ranges"]) if "ranges" in keywords else {},
        choices={ast.literal_eval(k): _options(path, v.id) for k, v in zip(choices.keys, choices.values)}
        if choices is not None else {},
        default_task=ast.literal_eval(keywords["default_task"]))


def _schema(path: Path, tree: ast.Module, name: str) -> type:
    """The schema class `name` of a runner module, its class statement run alone."""
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    namespace = {**SCHEMA_NAMES, "__name__": f"rlnotes.runners.{path.stem}"}
    # dont_inherit: annotations are evaluated here, as types, not left as strings to look up later.
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec", dont_inherit=True)
    try:
        exec(code, namespace)
    except NameError as e:
        raise RuntimeError(f"{path.name}: the schema {name} uses {e.name}, which `rlnotes config` cannot read "
                           f"without importing the module; a schema may use only {', '.join(SCHEMA_NAMES)}") from e
    schema = namespace[name]
    assert dataclasses.is_dataclass(schema), f"{path.name}: {name} is not a dataclass"
    return schema


def _options(path: Path, name: str) -> Tuple[str, ...]:
    """The options of the table `name` as a module defines or imports it: a tuple's items or a
    dict's keys."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            value = node.value
            return tuple(ast.literal_eval(k) for k in value.keys) if isinstance(value, ast.Dict) \
                else tuple(ast.literal_eval(value))
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = PACKAGE.parent.joinpath(*node.module.split("."))
                    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
                    return _options(source, alias.name)
    raise LookupError(f"{path.name}: cannot find the table {name} without importing the module")
