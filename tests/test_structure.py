"""The tree keeps the design the README draws: floors that import only downward (a foundation that
imports nothing of rlnotes), no import circle, no function-local import of an rlnotes module
except to defer a heavy optional dependency (said in a comment on that line), no comparison of
algo.name outside the registry, and files and functions short enough to read.

Figures it prints besides: each algorithm's import closure (the rlnotes modules importing it runs, and
their share of the package's lines), the longest signatures, the modules that import the sampler
only for a type, and the fields of the Context the algorithms' steps share.

Run as a script for the figures: python tests/test_structure.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rlnotes"
# Floor of each top-level part, from the foundation up: a module may import its own floor and below.
FLOORS = {"core": 0, "notes": 1, "engine": 2, "rewards": 3, "agents": 4, "data": 5, "run": 6, "training": 7,
          "algos": 8, "commands": 9, "__main__": 10, "__init__": 0}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 10  # a function's, outside rlnotes/notes (whose public equations take their symbols)
MAX_CLOSURE = 0.5  # the share of the package's lines that importing an algorithm's module may run
# A function-local import of an rlnotes module must say why on its line: it defers this.
DEFER_MARK = "optional"
# The modules that sample: the shared types (a batch of samples, a prompt) must not live here.
SAMPLER = "rlnotes.engine.sampling"
# The engine's own floors: the shared types and the hardware, then the model, the policy and its
# passes, the sampler; a room of the engine imports only its own floor and those below.
ENGINE_FLOORS = {"prompts": 0, "rollout": 0, "sequences": 0, "hardware": 0, "model": 1, "policy": 2, "sampling": 3}


def modules() -> dict[str, Path]:
    return {".".join(("rlnotes", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): p
            for p in sorted(ROOT.rglob("*.py"))}


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def imports(path: Path, module: str):
    """(imported rlnotes module, line, whether inside a function) of every import in `path`."""
    tree = ast.parse(path.read_text())
    known = modules()
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("rlnotes") and name in known and name != module:
                yield name, node.lineno, id(node) in local


def graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in imports(p, m)} for m, p in modules().items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def engine_room(module: str) -> str:
    return module.split(".")[2]


def engine_upward() -> list[str]:
    """Imports from a room of the engine to a room on a higher engine floor."""
    return [f"{m} -> {t}" for m, targets in graph().items() if part(m) == "engine" and m != "rlnotes.engine"
            for t in sorted(targets) if part(t) == "engine" and t != "rlnotes.engine"
            and ENGINE_FLOORS[engine_room(t)] > ENGINE_FLOORS[engine_room(m)]]


def upward() -> list[str]:
    return [f"{m} -> {t}" for m, targets in graph().items() for t in sorted(targets)
            if FLOORS[part(t)] > FLOORS[part(m)] and part(m) != "__init__"]


def undeferred_local_imports() -> list[str]:
    out = []
    for m, p in modules().items():
        lines = p.read_text().splitlines()
        for target, line, local in imports(p, m):
            if local and DEFER_MARK not in lines[line - 1]:
                out.append(f"{p.relative_to(ROOT.parent)}:{line} imports {target} inside a function")
    return out


def local_imports() -> int:
    return sum(local for m, p in modules().items() for _, _, local in imports(p, m))


def algo_name_comparisons() -> list[str]:
    out = []
    for m, p in modules().items():
        if m.startswith("rlnotes.algos"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "name" and isinstance(x.value, ast.Attribute)
                    and x.value.attr == "algo" for x in [node.left, *node.comparators]):
                out.append(f"{p.relative_to(ROOT.parent)}:{node.lineno}")
    return out


def long_files() -> list[str]:
    return [f"{p.relative_to(ROOT.parent)}: {n} lines" for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]


def long_functions() -> list[str]:
    out = []
    for p in modules().values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{p.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {n} lines")
    return out


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or \
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"


def _run_at_import(tree: ast.Module):
    """The import statements a module runs when it is imported: module level, not under TYPE_CHECKING."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _type_checking(node):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]


def loaded(module: str) -> set[str]:
    """The rlnotes modules that `import module` runs: its packages, what each imports at module level
    (not inside a function, not under TYPE_CHECKING) and, for a package that imports every module of
    its folder (pkgutil.iter_modules), those modules."""
    known, seen, todo = modules(), set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in known:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        source = known[m].read_text()
        for node in _run_at_import(ast.parse(source)):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif node.module and node.level == 0:
                todo += [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names]
        if known[m].name == "__init__.py" and "iter_modules(__path__)" in source:
            todo += [k for k in known if k.rsplit(".", 1)[0] == m]
    return seen


def algorithms() -> list[str]:
    """The algorithms' modules (rlnotes.algos, but its package and its registry of them all)."""
    return sorted(m for m, p in modules().items()
                  if p.parent.name == "algos" and p.stem not in ("__init__", "registry"))


def closure_share(module: str) -> float:
    """The share of the package's lines that importing `module` runs."""
    known = modules()
    return sum(lines(known[m]) for m in loaded(module)) / sum(lines(p) for p in known.values())


def signatures() -> list[tuple[int, str]]:
    """(parameters, where) of every function, longest first; self and cls are not counted."""
    out = []
    for p in modules().values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + \
                    [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                n = len(names) - (names[:1] in (["self"], ["cls"]))
                out.append((n, f"{p.relative_to(ROOT.parent)}:{node.lineno} {node.name}"))
    return sorted(out, key=lambda x: -x[0])


def long_signatures() -> list[str]:
    return [f"{where}: {n} parameters" for n, where in signatures()
            if n > MAX_PARAMETERS and not where.startswith("rlnotes/notes/")]


def _annotation_only(tree: ast.Module) -> set[str]:
    """The names a module uses in annotations and nowhere else."""
    annotations = [n for n in ast.walk(tree) if isinstance(n, ast.arg) and n.annotation] + \
        [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns] + \
        [n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
    inside = set()
    for node in annotations:
        annotation = node.returns if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else node.annotation
        inside |= {id(n) for n in ast.walk(annotation)}
    used = [n for n in ast.walk(tree) if isinstance(n, ast.Name)]
    return {n.id for n in used if id(n) in inside} - {n.id for n in used if id(n) not in inside}


def sampler_type_imports() -> list[str]:
    """Modules outside the sampler (rlnotes.engine.sampling) that import from it, when imported
    (not under TYPE_CHECKING), only names they use in annotations."""
    known, out = modules(), []
    for m, p in known.items():
        if m.startswith(SAMPLER):
            continue
        tree = ast.parse(p.read_text())
        types_only = _annotation_only(tree)
        for node in _run_at_import(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(SAMPLER + "."):
                names = {a.asname or a.name for a in node.names}
                if names <= types_only:
                    out.append(f"{p.relative_to(ROOT.parent)}:{node.lineno} imports {', '.join(sorted(names))} "
                               f"from {node.module} for annotations only")
    return out


def context_fields() -> dict[str, list[str]]:
    """The fields of training.context.Context and of each dataclass of that module it holds."""
    tree = ast.parse((ROOT / "training" / "context.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> list[tuple[str, str]]:
        return [(n.target.id, ast.unparse(n.annotation)) for n in classes[name].body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]

    out = {"Context": [f for f, _ in fields("Context")]}
    for _, annotation in fields("Context"):
        if annotation in classes:
            out[annotation] = [f for f, _ in fields(annotation)]
    return out


def test_every_module_is_on_a_floor():
    assert {part(m) for m in modules()} <= set(FLOORS)


def test_every_room_of_the_engine_is_on_an_engine_floor_and_imports_only_down():
    assert {engine_room(m) for m in modules() if part(m) == "engine" and m != "rlnotes.engine"} <= set(ENGINE_FLOORS)
    assert engine_upward() == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_imports_only_go_down_and_the_foundation_imports_nothing_of_rlnotes():
    assert upward() == []
    assert all(part(t) == "core" for m, targets in graph().items() if part(m) == "core" for t in targets)


def test_no_function_local_import_of_rlnotes_but_to_defer_an_optional_dependency():
    assert undeferred_local_imports() == []


def test_no_algo_name_comparison_outside_the_registry():
    assert algo_name_comparisons() == []


def test_an_algorithm_can_be_imported_without_most_of_the_package():
    """Importing an algorithm's module runs at most half the package's lines: it needs the notes,
    the engine and the training helpers it calls, not the data loaders, the reward functions, the
    agents, the run dir's files, the other algorithms or the commands."""
    assert algorithms() and {a: f"{closure_share(a):.0%}" for a in algorithms() if closure_share(a) > MAX_CLOSURE} == {}


def test_no_function_takes_more_than_ten_parameters_outside_the_notes():
    """A function that reads more wants a small typed bundle (the notes' public equations take their symbols)."""
    assert long_signatures() == []


def test_no_module_imports_the_sampler_only_for_a_type():
    """The types every floor needs (a batch of samples, a prompt) live outside the sampler."""
    assert sampler_type_imports() == []


def test_files_and_functions_are_short():
    assert long_files() == []
    assert long_functions() == []


if __name__ == "__main__":
    largest = max(modules().values(), key=lambda p: len(p.read_text().splitlines()))
    print(f"modules: {len(modules())}; import circles: {len(circles(graph()))} "
          f"({', '.join(str(len(c)) for c in circles(graph())) or 'none'} modules)")
    print(f"upward imports: {len(upward())} (in the engine: {len(engine_upward())}); function-local imports of "
          f"rlnotes modules: {local_imports()} ({len(undeferred_local_imports())} not deferring an optional "
          "dependency)")
    print(f"algo.name comparisons outside the registry: {len(algo_name_comparisons())}")
    print(f"largest file: {largest.relative_to(ROOT.parent)} ({len(largest.read_text().splitlines())} lines); "
          f"files over {MAX_FILE_LINES}: {len(long_files())}; functions over {MAX_FUNCTION_LINES}: {len(long_functions())}")
    package = sum(lines(p) for p in modules().values())
    for algo in algorithms():
        found = loaded(algo)
        print(f"import {algo}: {len(found)} modules, {sum(lines(modules()[m]) for m in found):,} of the "
              f"package's {package:,} lines ({closure_share(algo):.0%})")
    print("longest signatures: " + "; ".join(f"{where.split(' ')[-1]} {n}" for n, where in signatures()[:6])
          + f"; over {MAX_PARAMETERS} outside rlnotes/notes: {len(long_signatures())}")
    print(f"modules importing the sampler only for a type: {len(sampler_type_imports())}")
    print("context: " + "; ".join(f"{name} {len(f)} fields" for name, f in context_fields().items()))
    if "-v" in sys.argv:
        for line in [*upward(), *engine_upward(), *undeferred_local_imports(), *algo_name_comparisons(), *long_files(),
                     *long_functions(), *map(str, circles(graph())), *long_signatures(), *sampler_type_imports()]:
            print(" ", line)
