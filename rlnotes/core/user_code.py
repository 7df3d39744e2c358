"""A user's own callables (reward functions, tools, environments, tool-call parsers), named by a
built-in name, an import path ('pkg.module.fn', 'pkg.module:fn', found as `python -m` finds modules:
installed, on PYTHONPATH, or in the working directory) or a file ('path/to/rewards.py:fn'), and what
their signatures take. The rewards and the agents load theirs here; standard library only, so the
config check resolves them before torch is imported.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from difflib import get_close_matches
from pathlib import Path
from typing import Callable, Dict, Optional

from rlnotes.core.errors import ConfigError


def _import_file(path: str, target: str, noun: str = "reward function"):
    """The module in file `path` (relative to the working directory), its folder on sys.path (as
    `python path/to/rewards.py` would have it) so that it can import its neighbours. `noun` names
    what `target` is in the error of a missing file."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"{noun} {target!r}: no file {path} (paths are relative to {os.getcwd()})")
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve() == file:
        return loaded
    if loaded is not None:  # another module has that name: keep both
        name = f"{name}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(name: str):
    """`importlib.import_module(name)`, also from the working directory as `python -m` would find
    it: when the module is not found, the working directory joins the end of sys.path (so an
    installed package of the same name still wins) and the import is tried again."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if not (e.name and name.startswith(e.name)) or any(os.path.abspath(p or ".") == cwd for p in sys.path):
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(name)


def split_target(name: str) -> tuple[str, str]:
    """(module or file, attribute) of 'pkg.mod:fn', 'path/to/rewards.py:fn' or 'pkg.mod.fn'."""
    where, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    return where, attr


def is_file_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def resolve_callable(name: str, builtins: Dict[str, Callable], noun: str, example: tuple[str, str]) -> Callable:
    """`builtins[name]`, or the callable that `name` imports (the module docstring's forms). Errors are one
    line that begins with `noun` ("reward function", "rollout.tools: tool") and shows the forms
    with `example` (module, attribute): ("rewards", "my_fn") shows mypkg.rewards.my_fn and
    path/to/rewards.py:my_fn."""
    if name in builtins:
        return builtins[name]
    module, attribute = example
    where, attr = split_target(name)
    if not where or not attr:
        raise ConfigError(f"{noun} {name!r} is not built in ({', '.join(builtins)}) and not an import path like "
                          f"mypkg.{module}.{attribute} or a file like path/to/{module}.py:{attribute}"
                          + "".join(f"; did you mean {close}?" for close in get_close_matches(name, builtins, n=1)))
    fn, found = None, []
    try:
        fn = _import_file(where, name, noun) if is_file_path(where) else _import_module(where)
        for part in attr.split("."):
            fn = getattr(fn, part)
            found.append(part)
    except (ConfigError, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - a user's module may raise anything while it loads, sys.exit() too
        hint = _import_hint(e, where, example)
        if isinstance(e, AttributeError) and fn is not None:  # the module loaded; a name in it is wrong
            missing = attr.split(".")[len(found)]
            close = get_close_matches(missing, [n for n in dir(fn) if not n.startswith("_")], n=1)
            sep = ":" if ":" in name else "."
            hint = f"did you mean {where}{sep}{'.'.join(found + close)}?" if close else hint
        raise ConfigError(f"{noun} {name!r} could not be imported ({first_line(e)}); {hint}") from None
    if not callable(fn):
        raise ConfigError(f"{noun} {name!r} is not callable")
    return fn


def _import_hint(error: BaseException, where: str, example: tuple[str, str]) -> str:
    """What to do about an import that raised `error`."""
    module, attribute = example
    if isinstance(error, ModuleNotFoundError):
        return f"put its module in the directory you run rlnotes from, install it, or name its file: " \
               f"path/to/{module}.py:{attribute}"
    if isinstance(error, AttributeError):
        return "check the name"
    if isinstance(error, SystemExit):
        return (f"its module {where} exits while it is imported (sys.exit(), or argparse reading the command line): "
                "move that code under `if __name__ == '__main__':`")
    return "its module failed to load"


def accepted_names(fn) -> Optional[frozenset]:
    """The keyword arguments `fn` can take; None when it takes any (**kwargs, or a signature that
    cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in kinds)


def is_async(fn) -> bool:
    """Whether calling `fn` gives a coroutine to await (`async def`, also as a callable object)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def first_line(error: BaseException) -> str:
    """An exception as one line for a message: its type and the first line of its text."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__

