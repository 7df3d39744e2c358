"""Every job of a command checked before anything heavy loads: the config each job will run (each
member of a multirun sweep; composed from the command line, a --config-name file and the group
files of a --config-dir) is composed against the typed schema and validated, and a mistake is
reported as one line naming the key, what it accepts, and the file and line that set it when a
user's file did.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from omegaconf import OmegaConf

from rlnotes.commands import hydra
from rlnotes.commands.explain import explain
from rlnotes.commands.usage import UsageError
from rlnotes.commands.userfiles import missing_primary, without_defaults
from rlnotes.commands.validate import SCHEMA, register, resolve_auto, validate
from rlnotes.core.errors import ConfigError

def loader(config_dir: Optional[str]):
    """A loader of rlnotes' configs, its schema registered (--config-dir: a user's configs first)."""
    register()
    return hydra.config_loader(config_dir)


def check(overrides: List[str], multirun: bool, config_dir: Optional[str],
          settle: Optional[Callable] = None, config_name: Optional[str] = None) -> list:
    """Compose and validate every job of the command; raise UsageError with one line if one fails.
    `config_name`: the primary config (--config-name; rlnotes' `config` when None). `settle(cfg)`,
    when given, completes each composed config before it is validated (`rlnotes eval` merges in the
    settings of the run that trained its policy). Returns the composed configs (with their hydra
    node), one per job."""
    configs, name = loader(config_dir), config_name or "config"
    if not hydra.has_config(configs, name):
        raise UsageError(missing_primary(name, config_dir))
    jobs = []
    try:
        job_overrides = members(overrides, multirun, configs, name)
    except hydra.HydraException as e:  # an override that does not parse
        raise UsageError(f"{str(e).strip().splitlines()[0]} (quote a value with spaces or special characters: "
                         "'key=\"...\"')") from None
    for job in job_overrides:
        primary = hydra.user_file(configs, name)  # a primary of the user's must list rlnotes' `config`
        if primary is not None and not hydra.includes(configs, job, name, SCHEMA):
            raise UsageError(without_defaults(primary))
        cfg = None
        try:
            cfg = hydra.compose(configs, job, name)
            if settle is not None:
                cfg = settle(cfg)
            resolve_auto(cfg)
            validate(cfg)
        except (*hydra.COMPOSE_ERRORS, ConfigError) as e:
            raise UsageError(explain(e, configs, job, name, cfg)) from None
        jobs.append(cfg)
    return jobs


def check_args(args) -> list:
    """check() of a command line Hydra's parser read: its overrides, -m, --config-dir, --config-name."""
    return check(args.overrides, args.multirun, args.config_dir, config_name=args.config_name)


def members(overrides: List[str], multirun: bool, configs=None, config_name: str = "config") -> List[List[str]]:
    """The override lists of every job the command would run (one unless it is a sweep). A search
    (hydra/sweeper=optuna, an interval(...) to sample from, or a search space in a YAML file's
    hydra.sweeper.params, read through the loader `configs`) does not know its members ahead: it
    gets representatives instead, each value of a choice or range and both ends of an interval, one
    parameter at a time, so a typo or a value out of range still fails before any run."""
    if not multirun:
        return [overrides]
    parsed = hydra.parse_overrides(overrides)
    space = _yaml_search_space(configs, parsed, config_name) if configs is not None else []
    if space:
        parsed = hydra.parse_overrides(space) + parsed
    search = space or any(hydra.is_interval(o) for o in parsed) or any(
        o.key_or_group == "hydra/sweeper" and o.value() != "basic" for o in parsed)
    if not search:
        return hydra.grid(parsed)
    options = [[f"{o.get_key_element()}={v}" for v in hydra.representatives(o)] if o.is_sweep_override()
               else [o.input_line] for o in parsed]
    first = [values[0] for values in options]
    return [first] + [first[:i] + [value] + first[i + 1:] for i, values in enumerate(options) for value in values[1:]]


def _yaml_search_space(configs, parsed, config_name: str) -> List[str]:
    """hydra.sweeper.params of the configured search (an experiment file's search space) as
    overrides, less the keys the command line sets itself; empty when there is none."""
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        cfg = hydra.compose(configs, fixed, config_name)
    except hydra.COMPOSE_ERRORS:
        return []  # the command's own check reports it
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    given = {o.key_or_group for o in parsed}
    return [f"{key}={value}" for key, value in params.items() if key not in given]
