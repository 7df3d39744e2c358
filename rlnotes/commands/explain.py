"""One line for a mistake in a command's overrides: what was wrong and what is accepted. Shared by
the commands that compose a config (`rlnotes train` and `eval` through rlnotes.commands.check,
`rlnotes config`), and light: it needs Hydra's error reading, not the checks behind a run."""

from __future__ import annotations

import difflib
from typing import List

from omegaconf import OmegaConf

from rlnotes.commands import hydra
from rlnotes.core.errors import ConfigError

# Said when a sweeper or launcher is not an option: the Hydra plugins rlnotes documents.
SWEEP_EXTRA = (" (hydra/sweeper=optuna and hydra/launcher=joblib, submitit_local, submitit_slurm come with "
               "pip install 'rlnotes[sweep]')")


def explain(exc: BaseException, configs, overrides: List[str]) -> str:
    """One line for a composition error: what was wrong and what is accepted."""
    if isinstance(exc, ConfigError):
        return str(exc)
    problem = hydra.read_error(exc)
    key = problem.key
    if problem.kind == "missing_option":
        options = hydra.group_options(configs, problem.group)
        extra = SWEEP_EXTRA if problem.group in ("hydra/sweeper", "hydra/launcher") else ""
        return f"{problem.group}={problem.option} is not an option; choose one of: {', '.join(options)}{extra}"
    if problem.kind == "unknown_key":
        parent, _, _ = key.rpartition(".")
        named = lambda o: o.lstrip("+~").split("=", 1)[0]  # noqa: E731  (the key an override sets)
        try:  # the config without the override at fault, or one that sets a dict above the key
            base = hydra.compose(configs, [o for o in overrides if not (named(o).startswith(key)
                                                                        or key.startswith(named(o) + "."))])
        except hydra.COMPOSE_ERRORS:
            return problem.line
        node = OmegaConf.select(base, parent) if parent else base
        keys = [k for k in node.keys() if k != "hydra"] if node is not None and hasattr(node, "keys") else []
        where = f"under {parent}" if parent else "at the top level"
        close = difflib.get_close_matches(key.rpartition(".")[2], list(map(str, keys)), n=1)
        hint = f" did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        return f"{key} is not a setting;{hint} valid keys {where}: {', '.join(map(str, keys))}"
    if problem.kind == "bad_value":
        return f"{key or 'a value'}: {problem.line}"
    if problem.kind == "ambiguous":
        return f"{problem.line}; to sweep over the values add -m (rlnotes train -m ...)"
    if problem.kind == "missing_value":
        return f"{key} is required; set it on the command line ({key}=...)"
    return problem.line + (f" (key: {key})" if key else "")
