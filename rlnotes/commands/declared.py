"""Each algorithm's declaration as its module (rlnotes/algos/) states it, read from the module's source
without importing it: everything the config needs of it (its schema, ranges, choices, default task,
whether it samples, its checks and batch arithmetic), for `rlnotes config` and for the check every
command runs before anything heavy loads.

An algorithm's module imports torch and transformers (seconds), and listing or checking the settings
needs none of that. So rlnotes/algos/*.py are read instead: the `ALGORITHM = Algorithm(...)`
statement; the schema's class statement, run alone with the names a schema may use (dataclasses,
typing, AlgoConfig, MISSING); `ranges=` and the other plain values as the literals they are; each
`choices=` table by name, followed through the module's imports to the literal that defines it (its
keys are the options); and the `check=` and `shape=` functions (and `group_relative=`), run alone
with what they use: the module's imports of the standard library and rlnotes.core (light), and the
module's own functions that use no more. The imported declarations (rlnotes.algos.registry.REGISTRY) stay
what trains; tests/test_config_command.py checks that both readings agree for every algorithm.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import dataclasses
import dis
import functools
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Tuple

from omegaconf import MISSING

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.checks import check_choice
from rlnotes.core.comments import comments, file_comments
from rlnotes.core.schema import AlgoConfig

PACKAGE = Path(__file__).resolve().parents[1]  # rlnotes/
# What the class statement of a schema may name.
SCHEMA_NAMES = {"dataclass": dataclass, "field": field, "AlgoConfig": AlgoConfig, "MISSING": MISSING,
                **{name: getattr(typing, name) for name in ("Any", "Dict", "List", "Optional", "Tuple", "Union")}}
# The plain values of a declaration, read as literals: (keyword, its default when left out).
LITERALS = (("samples", None), ("objective", None), ("train_objective", None), ("columns", ("prompt",)))
# Read as code: a check and the batch arithmetic (and group_relative, a lambda).
FUNCTIONS = ("check", "shape", "group_relative")


@dataclass(frozen=True)
class Declared:
    name: str                          # algo.name
    path: Path                         # its module in rlnotes/algos/
    schema: type                       # its schema's class, made from the class statement alone
    comments: Dict[str, str]           # {field: comment}, inherited fields' included
    ranges: Dict[str, str]             # as Algorithm.ranges
    choices: Dict[str, Tuple[str, ...]]  # {key: its options}
    default_task: str
    algorithm: Algorithm               # the declaration to check a config with: all but its step and evaluation


@functools.lru_cache(maxsize=None)
def declarations() -> Dict[str, Declared]:
    """{algo.name: its declaration} of every module of rlnotes/algos/ that declares ALGORITHM."""
    found = {}
    for path in sorted((PACKAGE / "algos").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        call = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                     and [getattr(t, "id", None) for t in node.targets] == ["ALGORITHM"]), None)
        if call is not None:
            declared = _declared(path, tree, {k.arg: k.value for k in call.keywords})
            found[declared.name] = declared
    return found


def algorithm(name: str) -> Algorithm:
    """The declaration of the algorithm that algo.name names, to check a config with (one line
    listing the names when it names none); rlnotes.algos.registry.algorithm gives the one that trains."""
    found = declarations()
    check_choice("algo.name", name, found)
    return found[name].algorithm


class _Schemas:
    """Each declared schema as an attribute named for its algorithm (SCHEMAS.grpo): where pickle finds
    it. A declared schema's __qualname__ says so, so a config that holds one (a sweep's config, which
    Hydra's joblib and submitit launchers send to other processes and back) refers to it by name.
    By value instead, cloudpickle rebuilds the class elsewhere and, on the way back, sets the
    original's fields to copies whose dataclasses.MISSING is no longer MISSING, breaking the schema
    for the rest of the process."""

    def __getattr__(self, name: str) -> type:
        found = declarations().get(name)
        if found is None:
            raise AttributeError(name)
        return found.schema


SCHEMAS = _Schemas()


def _declared(path: Path, tree: ast.Module, keywords: Dict[str, ast.expr]) -> Declared:
    schema = _schema(path, tree, keywords["schema"].id)
    choices = keywords.get("choices")
    name = ast.literal_eval(keywords["name"])
    schema.__module__, schema.__qualname__ = __name__, f"SCHEMAS.{name}"  # pickled by name (_Schemas)
    options = {ast.literal_eval(k): _options(path, v.id) for k, v in zip(choices.keys, choices.values)} \
        if choices is not None else {}
    ranges = ast.literal_eval(keywords["ranges"]) if "ranges" in keywords else {}
    default_task = ast.literal_eval(keywords["default_task"])
    code = _Code(path, tree)
    plain = {key: ast.literal_eval(keywords[key]) if key in keywords else default for key, default in LITERALS}
    functions = {key: code.value(keywords[key], key) for key in FUNCTIONS if key in keywords}
    declared = Algorithm(name=name, schema=schema, train_step=_not_imported, default_task=default_task,
                         ranges=ranges, choices=options, **plain, **functions)
    return Declared(
        name=name, path=path, schema=schema,
        comments={**comments(schema.__base__), **file_comments(str(path)).get(schema.__name__, {})},
        ranges=ranges, choices=options, default_task=default_task, algorithm=declared)


def _not_imported(ctx) -> Dict[str, float]:
    raise RuntimeError("a declaration read from its module's source checks configs; train with the imported "
                       "one (rlnotes.algos.registry.algorithm)")


def _schema(path: Path, tree: ast.Module, name: str) -> type:
    """The schema class `name` of an algorithm's module, its class statement run alone."""
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    namespace = {**SCHEMA_NAMES, "__name__": f"rlnotes.algos.{path.stem}"}
    # dont_inherit: annotations are evaluated here, as types, not left as strings to look up later.
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec", dont_inherit=True)
    try:
        exec(code, namespace)
    except NameError as e:
        raise RuntimeError(f"{path.name}: the schema {name} uses {e.name}, which `rlnotes config` cannot read "
                           f"without importing the module; a schema may use only {', '.join(SCHEMA_NAMES)}") from e
    schema = namespace[name]
    assert dataclasses.is_dataclass(schema), f"{path.name}: {name} is not a dataclass"
    schema.__source_file__ = str(path)  # where rlnotes.core.comments reads its comments: the module is not imported
    return schema


class _Code:
    """The code of an algorithm's module that a declaration names (its check, its shape), run alone: with
    the module's imports of the standard library and rlnotes.core, and the module's own top-level
    functions and constants that they use, as the module would run them."""

    def __init__(self, path: Path, tree: ast.Module):
        self.path, self.tree = path, tree
        self.namespace: Dict[str, Any] = {"__name__": f"rlnotes.algos.{path.stem}"}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _light(node.module) \
                    and node.module != "__future__" or isinstance(node, ast.Import) and all(
                    _light(a.name) for a in node.names):
                self._run(node)
        self.pending = set()
        self.defined: Dict[str, ast.stmt] = {}  # the module's own top-level functions and constants, by name
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined[node.name] = node
            elif isinstance(node, ast.Assign):
                self.defined.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})

    def value(self, expr: ast.expr, keyword: str):
        """The value of `keyword=expr` of the declaration: a function the module defines, or a lambda."""
        if isinstance(expr, ast.Name):
            self._define(expr.id, keyword)
            return self.namespace[expr.id]
        code = compile(ast.Expression(body=expr), str(self.path), "eval", dont_inherit=True)
        self._needs(code, keyword)
        return eval(code, self.namespace)

    def _define(self, name: str, keyword: str) -> None:
        if name in self.namespace:
            return
        if name not in self.defined:
            raise RuntimeError(f"{self.path.name}: the {keyword}= of ALGORITHM uses {name}, which cannot be read "
                               "without importing the module: it may use only the standard library, rlnotes.core "
                               "and the module's own functions that do too")
        self.pending.add(name)  # functions that call each other
        self._run(self.defined[name], keyword)

    def _run(self, node: ast.stmt, keyword: str = "") -> None:
        # Annotations stay strings (as the module's `from __future__ import annotations` has them).
        code = compile(ast.Module(body=[node], type_ignores=[]), str(self.path), "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        if keyword:
            self._needs(code, keyword)
        exec(code, self.namespace)

    def _needs(self, code, keyword: str) -> None:
        """Define what `code` uses from the module before it runs."""
        for name in sorted(_globals(code)):
            if name not in self.namespace and name not in self.pending and not hasattr(builtins, name):
                self._define(name, keyword)


def _light(module: str) -> bool:
    """Whether importing `module` costs nothing here: the standard library, or rlnotes' foundation."""
    return module.split(".")[0] in sys.stdlib_module_names or module == "rlnotes.core" or \
        module.startswith("rlnotes.core.")


def _globals(code) -> set:
    """The global names `code` reads (its nested functions' and comprehensions' too)."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _globals(const)
    return names


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
