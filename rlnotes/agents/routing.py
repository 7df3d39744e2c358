"""Several environments in one run: `rollout.env` as a mapping of names to environments, as TRL's
GRPOTrainer takes `environment_factory={"coding": CodingEnv, "game": GameEnv}`.

Each row names its environment in its `environment` column (TRL's field; data.columns.environment=
COLUMN takes another column's values), checked for every row when the data loads, before the model
does. The column reaches reward functions as every column does, and not `reset` (as in TRL). The G
episodes of a group are one row's, so one environment's; each episode's prompt describes, and its
turns may call, that environment's tools alone, with the tools of `rollout.tools`, which every
environment shares (TRL's standalone tools). Each environment's reward scores its own episodes.

Metrics per environment, env/NAME/...: means over the global batch's episodes of that environment
(`per_environment`), beside the run's own, which stay over every episode.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from rlnotes.agents.environments import load_environment
from rlnotes.core.errors import ConfigError

# The column that names a row's environment (TRL's).
COLUMN = "environment"
# The columns of `per_environment`'s table after the environment's index, and the metric of each
# (env/NAME/<metric>, a mean per episode): the episode's reward, the environment's own part of it,
# its model turns, its tokens of the model and of the observations, its tool calls, and the failed
# ones (not a mean: they make tool_failure_frac).
EPISODE_COLUMNS = ("reward_mean", "reward_env", "turns", "model_tokens", "env_tokens", "tool_calls", "tool_failures")


def environment_names(env) -> List[str]:
    """The names of rollout.env's mapping, in its order; [] for one environment or none."""
    return [] if env is None or isinstance(env, str) else list(env)


def load_environments(env, style: str = "auto", scored: bool = False) -> Dict[Optional[str], Callable]:
    """The factories rollout.env names, each loaded and checked (load_environment; `scored`: each must
    give a reward, reward=env): {} without an environment, {None: factory} for one, {name: factory}
    for a mapping."""
    if not env:
        return {}
    if isinstance(env, str):
        return {None: load_environment(env, style, scored=scored)}
    return {name: load_environment(spec, style, f"rollout.env.{name}", scored) for name, spec in env.items()}


def environment_of(row: dict, names: Sequence[str], where: str) -> str:
    """The environment that `row` names in its `environment` column, one of `names`; else a
    ConfigError beginning with `where` (the row: "train.jsonl row 3, column 'environment'")."""
    name = row.get(COLUMN)
    valid = ", ".join(names)
    if name is None:
        raise ConfigError(f"{where}: no environment named; rollout.env maps names to environments and each row "
                          f"picks its own in an `environment` column: one of {valid}")
    if not isinstance(name, str) or name not in names:
        raise ConfigError(f"{where}: {name!r} is not an environment of rollout.env; choose one of: {valid}")
    return name


def per_environment(names: Sequence[str], episodes: torch.Tensor) -> Dict[str, float]:
    """env/NAME/... of `episodes` [N, 1 + len(EPISODE_COLUMNS)]: each episode's environment (its
    index in `names`), then its EPISODE_COLUMNS. For each environment with episodes here: how many
    (env/NAME/episodes), the mean of each column per episode, and tool_failure_frac, the share of
    its tool calls that failed (0 without calls), in place of the failures' mean."""
    out: Dict[str, float] = {}
    for k, name in enumerate(names):
        mine = episodes[episodes[:, 0] == k, 1:].double()
        if not len(mine):
            continue
        means = dict(zip(EPISODE_COLUMNS, mine.mean(0).tolist()))
        calls, failures = mine[:, -2].sum().item(), mine[:, -1].sum().item()
        means["tool_failure_frac"] = failures / calls if calls else 0.0
        del means["tool_failures"]
        out.update({f"env/{name}/episodes": float(len(mine)), **{f"env/{name}/{m}": v for m, v in means.items()}})
    return out
