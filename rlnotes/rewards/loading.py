"""The configured reward functions: each `fn` resolved (a built-in name, an import path or a file),
its signature read, its metric name chosen, and the reward config checked before a model loads.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from rlnotes.core.errors import ConfigError
from rlnotes.rewards.builtin import REWARDS, check_builtin_args


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


def _split_target(name: str) -> tuple[str, str]:
    """(module or file, attribute) of 'pkg.mod:fn', 'path/to/rewards.py:fn' or 'pkg.mod.fn'."""
    where, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def resolve(name: str) -> Callable:
    """A built-in reward by name, or a user's function: 'pkg.module.fn' or 'pkg.module:fn' (found
    as `python -m` finds modules: installed, on PYTHONPATH, or in the working directory) or
    'path/to/rewards.py:fn' (a file)."""
    return resolve_callable(name, REWARDS, "reward function", ("rewards", "my_fn"))


def resolve_callable(name: str, builtins: Dict[str, Callable], noun: str, example: tuple[str, str]) -> Callable:
    """`builtins[name]`, or the callable that `name` imports as `resolve` describes. Errors are one
    line that begins with `noun` ("reward function", "rollout.tools: tool") and shows the forms
    with `example` (module, attribute): ("rewards", "my_fn") shows mypkg.rewards.my_fn and
    path/to/rewards.py:my_fn."""
    if name in builtins:
        return builtins[name]
    module, attribute = example
    where, attr = _split_target(name)
    if not where or not attr:
        raise ConfigError(f"{noun} {name!r} is not built in ({', '.join(builtins)}) and not an import path like "
                          f"mypkg.{module}.{attribute} or a file like path/to/{module}.py:{attribute}"
                          + "".join(f"; did you mean {close}?" for close in get_close_matches(name, builtins, n=1)))
    fn, found = None, []
    try:
        fn = _import_file(where, name, noun) if _is_file(where) else _import_module(where)
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


# The keyword arguments every reward function is called with besides the dataset's columns and
# its configured args, as TRL (1.16) calls them.
CALL_NAMES = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


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


def check_signature(name: str, fn) -> None:
    """A reward function is called by keyword only: a required positional-only parameter (before
    '/') can never be given. (Required parameters that no column fills are found when the data
    is read: rlnotes.data.datasets.reward_columns.)"""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    for p in params:
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty:
            raise ConfigError(f"reward function {name!r} takes {p.name!r} positional-only (before '/'), but reward "
                              "functions are called by keyword (prompts=..., completions=..., <column>=...); "
                              "remove the '/'")


def is_async(fn) -> bool:
    """Whether calling `fn` gives a coroutine to await (`async def`, also as a callable object)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def function_specs(cfg) -> List[tuple[str, float, dict, Optional[str]]]:
    """(fn, weight, args, name) of every configured function; `reward.target` adds one of weight 1."""
    if cfg.name == "custom" and not cfg.target:
        raise ConfigError("reward=custom needs the import path of your function: reward.target=mypkg.rewards.my_fn")
    specs = [(f.fn, float(f.weight), _plain(f.args), f.get("name")) for f in cfg.functions]
    specs += [(cfg.target, 1.0, {}, None)] if cfg.target else []
    if not specs and cfg.name != "env":  # reward=env: the environment's reward alone (rollout.env)
        raise ConfigError("no reward function is configured; pick a built-in (reward=arith, reward=letters) or "
                          "name yours: reward=custom reward.target=mypkg.rewards.my_fn")
    return specs


def _plain(args) -> dict:
    return OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args)


# Metrics the runners write under reward/; no function's metric may take these names.
RESERVED = ("mean", "std", "zero_std_frac", "failures", "baseline", "resample_rounds")


def _name_parts(fn: str) -> List[str]:
    """The parts of a function's path that can name it: 'a.b:c' and 'path/to/b.py:c' as 'b.c' would."""
    where, attr = _split_target(fn)
    module = Path(where).stem if _is_file(where) else where
    return [p for p in module.split(".") + attr.split(".") if p]


def metric_names(fns: Sequence[str], names: Sequence[Optional[str]]) -> List[str]:
    """Each function's metric name (reward/<name>): its configured `name`, else the last part of
    its import path, lengthened part by part while another function's name is the same ("a.score"
    and "b.score" rather than "score" twice); the same function twice gets "_2", "_3", ...
    Names the runners use under reward/ (RESERVED) are never taken."""
    given = [n for n in names if n]
    for n in given:
        if n in RESERVED or given.count(n) > 1:
            why = "a metric the runners write" if n in RESERVED else "given to two functions"
            raise ConfigError(f"reward function name {n!r} is {why}; choose another name")
    parts = [_name_parts(fn) for fn in fns]
    depth = [1] * len(fns)

    def clashes(i: int, labels: List[str]) -> bool:
        """Whether a longer label could set function i apart: its label is reserved or shared with
        a given name or another function."""
        return labels[i] in RESERVED or any(labels[j] == labels[i] and (names[j] or fns[j] != fns[i])
                                            for j in range(len(fns)) if j != i)

    while True:
        labels = [names[i] or ".".join(parts[i][-depth[i]:]) for i in range(len(fns))]
        grow = [i for i in range(len(fns)) if not names[i] and depth[i] < len(parts[i]) and clashes(i, labels)]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    taken, out = set(given) | set(RESERVED), list(labels)
    for i, label in enumerate(labels):
        if not names[i]:
            name, k = label, 2
            while name in taken:
                name, k = f"{label}_{k}", k + 1
            taken.add(name)
            out[i] = name
    return out


@dataclass
class RewardFn:
    name: str        # its metric: reward/<name>
    fn: Callable
    weight: float
    args: dict
    accepts: Optional[frozenset] = None   # the keywords fn takes; None: any (it has **kwargs)
    awaited: bool = False                  # an async function: its calls are awaited, side by side


def build(cfg) -> List[RewardFn]:
    """The configured functions, resolved, named, their signatures and built-in args checked."""
    specs = function_specs(cfg)
    names = metric_names([s[0] for s in specs], [s[3] for s in specs])
    fns = []
    for (path, weight, args, _), name in zip(specs, names):
        if path in REWARDS:
            check_builtin_args(path, args)
        fn = resolve(path)
        check_signature(path, fn)
        fns.append(RewardFn(name, fn, weight, args, accepted_names(fn), is_async(fn)))
    return fns


def check_reward_config(cfg) -> None:
    if cfg.timeout_s is not None and not cfg.timeout_s > 0:
        raise ConfigError(f"reward.timeout_s={cfg.timeout_s} must be > 0 (seconds a call may take; null: no limit)")
    build(cfg)


def first_line(error: BaseException) -> str:
    """An exception as one line for a message: its type and the first line of its text."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__

