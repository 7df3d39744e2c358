"""The configured reward functions: each `fn` resolved (a built-in name, an import path or a file),
its signature read, its metric name chosen, and the reward config checked before a model loads.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from rlnotes.core.errors import ConfigError
from rlnotes.core.user_code import accepted_names, is_async, is_file_path, resolve_callable, split_target
from rlnotes.rewards.builtin import REWARDS, check_builtin_args


def resolve(name: str) -> Callable:
    """A built-in reward by name, or a user's function: 'pkg.module.fn' or 'pkg.module:fn' (found
    as `python -m` finds modules: installed, on PYTHONPATH, or in the working directory) or
    'path/to/rewards.py:fn' (a file)."""
    return resolve_callable(name, REWARDS, "reward function", ("rewards", "my_fn"))

# The keyword arguments every reward function is called with besides the dataset's columns and
# its configured args, as TRL (1.16) calls them.
CALL_NAMES = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


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


# Metrics the algorithms write under reward/; no function's metric may take these names.
RESERVED = ("mean", "std", "zero_std_frac", "failures", "baseline", "resample_rounds")


def _name_parts(fn: str) -> List[str]:
    """The parts of a function's path that can name it: 'a.b:c' and 'path/to/b.py:c' as 'b.c' would."""
    where, attr = split_target(fn)
    module = Path(where).stem if is_file_path(where) else where
    return [p for p in module.split(".") + attr.split(".") if p]


def metric_names(fns: Sequence[str], names: Sequence[Optional[str]]) -> List[str]:
    """Each function's metric name (reward/<name>): its configured `name`, else the last part of
    its import path, lengthened part by part while another function's name is the same ("a.score"
    and "b.score" rather than "score" twice); the same function twice gets "_2", "_3", ...
    Names the algorithms use under reward/ (RESERVED) are never taken."""
    given = [n for n in names if n]
    for n in given:
        if n in RESERVED or given.count(n) > 1:
            why = "a metric the algorithms write" if n in RESERVED else "given to two functions"
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
