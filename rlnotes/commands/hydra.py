"""Everything the commands ask of Hydra, in one place: composing `conf/` (and a user's
--config-name file) before a run, which of a user's files a composition reads, reading Hydra's own
flags and overrides, a sweep's members, the dirs a job will write, a config as --cfg prints it,
running the task, and reading Hydra's composition errors.

Most of it is Hydra's public API. What Hydra does not expose is used here alone, each use marked
`# private:` with why; tests/test_hydra_adapter.py fails, naming the internal, if an installed
Hydra changes one of them (a name, a signature, the text of an error read below).
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import hydra
import yaml
from hydra._internal.config_loader_impl import (
    ConfigLoaderImpl,  # private: see config_loader
)
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # private: see grid
from hydra._internal.hydra import Hydra  # private: see run
from hydra._internal.utils import (  # private: see below
    create_automatic_config_search_path,
    get_args_parser,
)
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.core.utils import setup_globals
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from rlnotes.commands.usage import UsageError

CONFIG_MODULE = "rlnotes.conf"
# What composing a config raises for a mistake in it (ValueError: a group set to null, logging=null;
# YAMLError: a user's file that is not YAML, let through by Hydra).
COMPOSE_ERRORS = (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError)


def config_loader(config_dir: Optional[str]) -> ConfigLoaderImpl:
    """A loader of rlnotes' configs as hydra.main finds them (a --config-dir first)."""
    # private: Hydra's public compose() needs initialize()'s global state around each use and has
    # no --config-dir; its config loader composes standalone on the search path hydra.main builds
    # (Hydra's configs, a --config-dir, ours), the hydra node included, and lists a group's options.
    search = create_automatic_config_search_path(None, None, f"pkg://{CONFIG_MODULE}")
    if config_dir and not os.path.isdir(config_dir):  # Hydra's own check comes late, after the run dir is made
        what = "not a directory" if os.path.exists(config_dir) else "no such directory"
        raise UsageError(f"--config-dir: {what}: {config_dir}")
    if config_dir:
        search.prepend("command-line", f"file://{os.path.abspath(config_dir)}")
    return ConfigLoaderImpl(config_search_path=search)


def compose(loader: ConfigLoaderImpl, overrides: List[str], config_name: str = "config") -> DictConfig:
    """The config of one run of `overrides` (a sweep member's), with its hydra node; `config_name`:
    the primary config (--config-name), rlnotes' own `config` unless a user names theirs."""
    return loader.load_configuration(config_name, overrides, RunMode.RUN)


@dataclass(frozen=True)
class UserFile:
    """A config file of the user's that a composition reads (a --config-name file, a group file of
    a --config-dir): not rlnotes' own conf/ nor Hydra's."""

    config: str    # its config path: mine, experiment/port
    path: Path     # the file
    package: str   # where its keys go: "" (the top), "algo", "reward"...


def user_file(loader: ConfigLoaderImpl, config: str) -> Optional[Path]:
    """The file that holds config `config` (mine, experiment/port) when it is a user's: the first
    source on the search path that has it is a dir (file://), not a package."""
    for source in loader.get_sources():
        if source.is_config(config):
            return Path(source.path) / f"{config}.yaml" if source.scheme() == "file" else None
    return None


def has_config(loader: ConfigLoaderImpl, config: str) -> bool:
    """Whether some source on the search path holds config `config` (mine, or mine.yaml as Hydra
    takes it too)."""
    name = config.removesuffix(".yaml")
    return any(source.is_config(name) for source in loader.get_sources())


def includes(loader: ConfigLoaderImpl, overrides: List[str], config_name: str, config: str) -> bool:
    """Whether composing `overrides` onto `config_name` reads `config` (train_schema: rlnotes' settings);
    True when the defaults lists themselves fail (the composition's own error then speaks), False
    when one of them lists itself (Hydra recurses until Python stops it)."""
    try:
        defaults = loader.compute_defaults_list(config_name, overrides, RunMode.RUN).defaults
    except COMPOSE_ERRORS:
        return True
    except RecursionError:
        return False
    return any(d.config_path == config for d in defaults)


def user_files(loader: ConfigLoaderImpl, overrides: List[str], config_name: str) -> List[UserFile]:
    """The user's files a composition reads, in the order it merges them (a later one's value wins;
    the command line's wins over all)."""
    out = []
    for default in loader.compute_defaults_list(config_name, overrides, RunMode.RUN).defaults:
        path = user_file(loader, default.config_path) if default.config_path else None
        if path is not None and all(f.path != path for f in out):
            out.append(UserFile(default.config_path, path, default.package or ""))
    return out


def group_options(loader: ConfigLoaderImpl, group: str) -> List[str]:
    """The options of a config group (`algo`, `hydra/sweeper`)."""
    return loader.get_group_options(group)


def parse_args(argv: List[str]):
    """Hydra's flags and overrides of a command line (args.overrides, .multirun, .config_dir, .help...).
    A flag it does not know, or a value its flag does not take, is a UsageError of one line with the
    closest flag, instead of argparse's usage block and exit."""
    # private: hydra.main's own parser, so the command reads its flags (-m, --cfg, --config-dir) as
    # Hydra will when it runs the command line.
    parser = get_args_parser()
    flags = sorted(set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", parser.format_usage())))

    def error(message: str):
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        close = difflib.get_close_matches(unknown.group(1), flags, n=1) if unknown else []
        hint = f"; did you mean {close[0]}?" if close else ""
        raise UsageError(f"{message}{hint} (rlnotes train --help lists the flags)")

    parser.error = error
    return parser.parse_args(argv)


def parse_overrides(overrides: Sequence[str]) -> List[Override]:
    return OverridesParser.create().parse_overrides(list(overrides))


def grid(parsed: List[Override]) -> List[List[str]]:
    """The override lists of every member of a basic (grid) sweep, in Hydra's order."""
    # private: Hydra's basic sweeper's own split, so the members checked are the ones it will run.
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def is_interval(override: Override) -> bool:
    """An interval(...) to sample from, which only a search sweeper can run."""
    return isinstance(override.value(), IntervalSweep)


def representatives(override: Override) -> List[str]:
    """Values that stand for a search parameter: a choice's or range's values, an interval's ends."""
    value = override.value()
    if isinstance(value, IntervalSweep):
        return [str(value.start), str(value.end)]
    return list(override.sweep_string_iterator())


def job_dirs(jobs: List[DictConfig], keys: Sequence[str]) -> List[Optional[Path]]:
    """For each composed job (job number i), the path its `keys` (hydra.run.dir, or hydra.sweep.dir
    and hydra.sweep.subdir) resolve to, as Hydra resolves them when it runs the job; None where
    they read what only Hydra's launcher sets."""
    setup_globals()  # the resolvers Hydra registers for its own start (hydra:, now:); not documented
    previous, out = HydraConfig.instance().cfg, []
    try:
        for num, cfg in enumerate(jobs):
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.job.num = num
            HydraConfig.instance().set_config(cfg)
            try:
                out.append(Path(*[str(OmegaConf.select(cfg, key, throw_on_missing=True)) for key in keys]))
            except OmegaConfBaseException:
                out.append(None)
    finally:
        # private: HydraConfig has no public way back to the config it held (the hydra: resolver's).
        HydraConfig.instance().cfg = previous
    return out


def show(cfg: DictConfig, part: str, package: Optional[str], resolve: bool) -> str:
    """The text `--cfg job|hydra|all [--package P] [--resolve]` prints, of a composed config: Hydra's
    own show_cfg, given the config the run will have instead of composing one itself."""
    cfg = copy.deepcopy(cfg)
    previous = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)  # what ${hydra:...} reads, as Hydra sets it for show_cfg
    try:
        with read_write(cfg), open_dict(cfg):
            if part == "job":
                del cfg["hydra"]
            elif part == "hydra":
                cfg = OmegaConf.create({"hydra": cfg.hydra})
        node = cfg if package in (None, "_global_") else OmegaConf.select(cfg, package)
        if node is None:
            raise ValueError(f"--package {package}: no such section; sections: {', '.join(map(str, cfg.keys()))}")
        if not isinstance(node, (DictConfig, ListConfig)):
            return f"{node}\n"
        if resolve:
            OmegaConf.resolve(node)
        return (f"# @package {package}\n" if package not in (None, "_global_") else "") + OmegaConf.to_yaml(node)
    finally:
        HydraConfig.instance().cfg = previous  # private: as in job_dirs


def run(task: Callable[[DictConfig], Optional[float]], argv: List[str], composed: Optional[DictConfig] = None) -> None:
    """Hydra runs `task` for the command line `argv` (once, or for each member of a sweep). Hydra reads
    its command line from sys.argv; the caller's is put back after, so an in-process call leaves none
    of it behind. `composed`: a config of the command (a job's, with its hydra node) that the caller
    composed already (rlnotes.commands.check), whose hydra.mode Hydra would compose the whole config
    again to read."""
    saved, sys.argv = sys.argv, ["rlnotes train", *argv]
    get_mode = Hydra.get_mode
    if composed is not None:
        # private: Hydra.get_mode composes the config once more before the run composes it, only to read
        # hydra.mode (set by a config file or an override, never swept): about 0.1 s of every command.
        Hydra.get_mode = lambda self, config_name, overrides: composed.hydra.mode
    try:
        hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")(task)()
    finally:
        sys.argv, Hydra.get_mode = saved, get_mode


def job_dir() -> Path:
    """The dir of the job Hydra is running."""
    return Path(HydraConfig.get().runtime.output_dir)


def in_sweep() -> bool:
    """Whether the job Hydra is running is a member of a multirun."""
    return HydraConfig.get().mode == RunMode.MULTIRUN


def job_overrides() -> List[str]:
    """The command-line overrides of the job Hydra is running."""
    return list(HydraConfig.get().overrides.task)


# ---------------------------------------------------------------------------------------------
# Hydra's composition errors, read. Hydra raises them with a message and no fields, so their
# text is parsed; each pattern is checked against real Hydra by tests/test_hydra_adapter.py.

# private (error text): MissingConfigException for an option a group lacks ("find"), or one of a
# list of options ("load"): "Could not find 'algo/nope'", "Could not load 'logging/nope'".
MISSING_OPTION = re.compile(r"Could not (?:find|load) '([^']+)/([^']+)'")
# private (error text): OmegaConf names the key of an error on a line "full_key: trainer.steps".
FULL_KEY = re.compile(r"full_key: (\S+)")
# private (error text): an override of a key the schema lacks: "Could not override 'trainer.stpes'".
NOT_OVERRIDDEN = re.compile(r"Could not override '([^']+)'")
# private (error text): an error while merging one of the configs: "In 'experiment/port': ConfigKeyError
# raised while composing config:" names that config.
IN_CONFIG = re.compile(r"^In '([^']+)': ")
# private (error text): OmegaConf's refusal of a value: "Value 'x' of type 'str' could not be
# converted to Integer", or "Invalid value 'x', expected one of [...]" for a choice.
BAD_VALUE = re.compile(r"(Value '.*?' (?:of type '\w+' )?could not be converted to \w+|Invalid value '.*?'.*"
                       r"|Value '.*?' is not a valid bool)")


@dataclass
class Problem:
    """What a composition error says: its `kind` ("missing_option", "unknown_key", "bad_value",
    "ambiguous", "missing_value", "unreadable" (an override Hydra's grammar cannot read) or "other"),
    the key or group and option it names, and a line."""

    kind: str
    line: str                      # the error's first line, or the part of it that says what is wrong
    key: Optional[str] = None      # the full key (trainer.steps) where the error names one
    group: Optional[str] = None    # missing_option: the group and the option it lacks
    option: Optional[str] = None
    config: Optional[str] = None   # the config being merged when it failed (mine, experiment/port)
    valid: Optional[List[str]] = None  # unknown_key: the keys the section at fault has, where OmegaConf says


def read_error(exc: BaseException) -> Problem:
    """The Problem of a composition error (a HydraException or OmegaConf error, with its cause)."""
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    full = f"{text}\n{cause}" if cause else text
    first = text.strip().splitlines()[0] if text.strip() else ""
    config = IN_CONFIG.match(text)
    if config and cause is not None and str(cause).strip():  # the first line says only where
        first = str(cause).strip().splitlines()[0]
    if isinstance(exc, OverrideParseException):  # its context is the parser's own, less telling, error
        return Problem("unreadable", first)
    problem = _problem(text, full, first, cause or exc)
    problem.config = config.group(1) if config else None
    parent = getattr(cause or exc, "parent_node", None)  # an OmegaConf error's section
    if problem.kind == "unknown_key" and isinstance(parent, DictConfig):
        problem.valid = [str(k) for k in parent.keys() if k != "hydra"]
    return problem


def _problem(text: str, full: str, first: str, error: BaseException) -> Problem:
    missing = MISSING_OPTION.search(full)
    if missing:
        return Problem("missing_option", first, group=missing.group(1), option=missing.group(2))
    key = FULL_KEY.search(full)
    key = key.group(1) if key else None
    if "not in struct" in full or "not in '" in full or re.search(r"Key '[^']+' is not in", full):
        named = NOT_OVERRIDDEN.search(full)
        return Problem("unknown_key", first, key=key or (named.group(1) if named else "?"))
    if "could not be converted" in full or "Invalid value" in full or "ValidationError" in type(error).__name__:
        what = BAD_VALUE.search(full)
        line = what.group(1) if what else text.splitlines()[0]
        return Problem("bad_value", line + (" (true or false)" if line.endswith("valid bool") else ""), key=key)
    if "Ambiguous value" in full:
        return Problem("ambiguous", first, key=key)
    if "Missing mandatory value" in full or "missing value" in full.lower():
        return Problem("missing_value", first, key=key)
    return Problem("other", first, key=key)
