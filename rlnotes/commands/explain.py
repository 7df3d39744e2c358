"""One line for a mistake in a command's config: what was wrong and what is accepted, and where it
was made: the override, or the user's file and line (a --config-name file, a group file of a
--config-dir). Shared by the commands that compose a config (`rlnotes train` and `eval` through
rlnotes.commands.check, `rlnotes config`), and light: it needs Hydra's error reading, not the checks
behind a run."""

from __future__ import annotations

import difflib
import os
import re
import shlex
from typing import List, Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from rlnotes.commands import hydra, userfiles
from rlnotes.core.errors import ConfigError
from rlnotes.core.overrides import override_value

# Said when a sweeper or launcher is not an option: the Hydra plugins rlnotes documents.
SWEEP_EXTRA = (" (hydra/sweeper=optuna and hydra/launcher=joblib, submitit_local, submitit_slurm come with "
               "pip install 'rlnotes[sweep]')")


def explain(exc: BaseException, configs, overrides: List[str], config_name: str = "config",
            composed: Optional[DictConfig] = None) -> str:
    """One line for an error composing or checking the config of `overrides` (primary config
    `config_name`; `composed`: the config a check refused, when it was composed): what was wrong and
    what is accepted."""
    if isinstance(exc, yaml.YAMLError):  # a user's file that is not YAML (Hydra lets PyYAML's error through)
        return userfiles.yaml_error(exc)
    if isinstance(exc, ConfigError):
        where = _value_source(str(exc), configs, overrides, config_name, composed)
        return f"{where}: {exc}" if where else str(exc)
    problem = hydra.read_error(exc)
    if problem.kind == "missing_option":
        return _not_an_option(problem, configs, overrides, config_name)
    file = hydra.user_file(configs, problem.config) if problem.config else None
    if file is not None:
        return _in_file(problem, file, configs, overrides, config_name)
    key = problem.key
    if problem.kind == "unknown_key":
        parent, _, _ = key.rpartition(".")
        named = lambda o: o.lstrip("+~").split("=", 1)[0]  # noqa: E731  (the key an override sets)
        try:  # the config without the override at fault, or one that sets a dict above the key
            base = hydra.compose(configs, [o for o in overrides if not (named(o).startswith(key)
                                                                        or key.startswith(named(o) + "."))],
                                 config_name)
        except hydra.COMPOSE_ERRORS:
            return problem.line
        node = OmegaConf.select(base, parent) if parent else base
        keys = [k for k in node.keys() if k != "hydra"] if node is not None and hasattr(node, "keys") else []
        return not_a_setting(key, list(map(str, keys)))
    if problem.kind == "bad_value":
        return f"{key or 'a value'}: {problem.line}"
    if problem.kind == "ambiguous":
        return f"{problem.line}; to sweep over the values add -m (rlnotes train -m ...)"
    if problem.kind == "missing_value":
        return f"{key} is required; set it on the command line ({key}=...)"
    if problem.kind == "unreadable":
        return unreadable(problem.line, overrides)
    return problem.line + (f" (key: {key})" if key else "")


# The key that takes a name or path where a config group takes a preset's name.
PATH_KEYS = {"model": "model.name_or_path", "data": "data.path"}


def _path_given_as_preset(group: str, value: str, options: List[str]) -> str:
    """`group=a/b`: a preset's name was expected; the key that takes a hub id or a path, if any."""
    key = PATH_KEYS.get(group)
    to = f"; to load {value} give {key}={value}" if key else ""
    return f"{group}={value}: {group}= takes a preset, one of: {', '.join(options)}{to}"


def _not_an_option(problem: hydra.Problem, configs, overrides: List[str], config_name: str) -> str:
    """An option a group lacks, with the group's options; where a defaults list of the user's chose it
    (not the command line), that file and line first."""
    options = hydra.group_options(configs, problem.group)
    top, _, rest = problem.group.partition("/")
    presets = hydra.group_options(configs, top) if rest and not options else []
    if presets:  # group=ORG/NAME: Hydra reads a sub-group of `top`; a hub id or a path goes to a key
        return _path_given_as_preset(top, f"{rest}/{problem.option}", presets)
    extra = SWEEP_EXTRA if problem.group in ("hydra/sweeper", "hydra/launcher") else ""
    close = difflib.get_close_matches(problem.option, options, n=1)
    hint = f"did you mean {problem.group}={close[0]}? " if close else ""
    line = f"{problem.group}={problem.option} is not an option; {hint}choose one of: {', '.join(options)}{extra}"
    chosen = [o.lstrip("+~").split("=", 1) for o in overrides if "=" in o]
    if [problem.group, problem.option] in chosen:
        return line
    roots = [config_name] + [f"{group}/{option}" for group, option in chosen]
    where = userfiles.chooser(configs, roots, problem.group, problem.option)
    return f"{where}: {line}" if where else line


def unreadable(line: str, overrides: List[str]) -> str:
    """An override Hydra's grammar cannot read: where its value holds a character that may not stand
    unquoted (a letter beyond ASCII, ~, a space), the override as the shell should pass it."""
    named = next((o for o in overrides if o in line), None)
    key, equals, value = (named or "").partition("=")
    if value.startswith("~"):  # no shell expands ~ after key=: the home dir it meant
        value = os.path.expanduser(value)
    if not equals or (override_value(value) == value and not named.partition("=")[2].startswith("~")):
        return f"{line.split(': ', 1)[-1] if named else line}: Hydra cannot read this override; see " \
               "https://hydra.cc/docs/advanced/override_grammar/basic"
    hydra_form = f"{key}={override_value(value)}"
    # For the shell: in double quotes where nothing in it means something there, else shlex's form.
    shell_form = f'"{hydra_form}"' if not re.search(r'["$`\\!]', hydra_form) else shlex.quote(hydra_form)
    why = "Hydra reads a value with such characters only in quotes" if override_value(value) != value else \
        "Hydra reads ~ only in quotes, and then as a dir named ~"
    return f"{named}: {why}; give it as {shell_form}"


def not_a_setting(key: str, valid: List[str]) -> str:
    """`key` is not a setting: the closest valid key, and every valid key of its section."""
    parent, _, last = key.rpartition(".")
    close = difflib.get_close_matches(last, valid, n=1)
    hint = f" did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    where = f"under {parent}" if parent else "at the top level"
    return f"{key} is not a setting;{hint} valid keys {where}: {', '.join(valid)}"


def _in_file(problem: hydra.Problem, file, configs, overrides: List[str], config_name: str) -> str:
    """A composition error in the user's file `file` (Hydra names the config it was merging): the
    file, the line of the key at fault, and what is wrong."""
    package = ""
    try:
        package = next((f.package for f in hydra.user_files(configs, overrides, config_name)
                        if f.config == problem.config), "")
    except hydra.COMPOSE_ERRORS:
        pass  # a defaults list that does not compose: the key is found under the file's own names
    found = userfiles.find(hydra.UserFile(problem.config, file, package), problem.key) if problem.key else None
    key, where = (found[0], f"{userfiles.shown(file)}, line {found[1]}") if found else (problem.key,
                                                                                       userfiles.shown(file))
    if problem.kind == "unknown_key" and problem.valid is not None:
        return f"{where}: {not_a_setting(key, problem.valid)}"
    if problem.kind == "bad_value":
        return f"{where}: {key or 'a value'}: {problem.line}"
    return f"{where}: {problem.line}" + (f" (key: {key})" if key else "")


def _value_source(message: str, configs, overrides: List[str], config_name: str,
                  composed: Optional[DictConfig]) -> Optional[str]:
    """'FILE, line N' when a key the check's message names got its value from a user's file."""
    try:
        files = hydra.user_files(configs, overrides, config_name)
    except hydra.COMPOSE_ERRORS:
        return None
    group = lambda o: o.lstrip("+~").split("=", 1)[0].split("@", 1)[0]  # noqa: E731  (reward=mix: a choice)
    values = [o for o in overrides if not hydra.group_options(configs, group(o))]
    return userfiles.value_source(message, files, values, composed) if files else None
