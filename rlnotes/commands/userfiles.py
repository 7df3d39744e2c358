"""A user's own config files (a --config-name file, the group files of a --config-dir) in error
lines: a mistake found in one, or a value set by one that a check refuses, names the file and the
line, as a mistake on the command line names the override. rlnotes' own conf/ is never named (its
files are checked by the tests). Reads the files as YAML, for their lines; Hydra says which files a
composition read (rlnotes.commands.hydra.user_files)."""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlnotes.commands import hydra
from rlnotes.commands.hydra import UserFile

_INDEX = re.compile(r"\[\d+\]")
# The keys an error line names with their value: "algo.beta=-0.1 must be at least 0".
_NAMED = re.compile(r"(?<![\w.\[\]])([A-Za-z_][\w.\[\]]*)=")


def shown(path) -> str:
    """A path as an error line shows it: relative to the working directory when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@functools.lru_cache(maxsize=64)
def _keys(path: Path, mtime: float) -> Dict[str, int]:
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    out: Dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = f"{prefix}.{key.value}" if prefix else str(key.value)
                out.setdefault(name, key.start_mark.line + 1)
                walk(value, name)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{prefix}[{i}]")

    walk(root, "")
    return out


def keys(file: UserFile) -> Dict[str, int]:
    """{full key: line (from 1)} of every key the file sets, under its package (algo.beta for
    `beta:` in algo/mine.yaml); a list's items as key[0]."""
    try:
        found = _keys(file.path, file.path.stat().st_mtime)
    except OSError:
        return {}
    return {f"{file.package}.{key}" if file.package else key: line for key, line in found.items()}


def find(file: UserFile, key: str) -> Optional[Tuple[str, int]]:
    """(full key, line) of the first key of the file that ends as `key` does, list indices aside
    (OmegaConf names a key inside a list item by its last part alone: `wieght`)."""
    want = _INDEX.sub("", key).split(".")
    for full, line in keys(file).items():
        if _INDEX.sub("", full).split(".")[-len(want):] == want:
            return full, line
    return None


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def setter(files: Sequence[UserFile], overrides: Sequence[str], key: str,
           composed: Optional[DictConfig] = None) -> Optional[Tuple[UserFile, int]]:
    """The user's file, and its line, whose value of `key` the composed config holds: the last of
    `files` (in merge order) that sets it; None when the command line sets it (or a section above
    it), no file of the user's does, or `composed` holds another value than that file's (one of
    rlnotes' own configs, merged after it, set the key again)."""
    if any(key == k or key.startswith(k + ".") for k in map(_override_key, overrides)):
        return None
    found = None
    for file in files:
        line = keys(file).get(key)
        if line is not None:
            found = (file, line)
    if found is not None and composed is not None and _value(found[0], key) != _plain(
            OmegaConf.select(composed, key, default=None)):
        return None
    return found


def _value(file: UserFile, key: str):
    inside = key[len(file.package) + 1:] if file.package else key
    try:
        return _plain(OmegaConf.select(OmegaConf.load(file.path), inside, default=None))
    except (OSError, ValueError, yaml.YAMLError):
        return None


def _plain(value):
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def value_source(message: str, files: Sequence[UserFile], overrides: Sequence[str],
                 composed: Optional[DictConfig] = None) -> Optional[str]:
    """'FILE, line N' of the first key the error line names (`key=value`) whose value in `composed`
    came from a user's file; None when each came from the command line or rlnotes' own configs."""
    for key in _NAMED.findall(message):
        found = setter(files, overrides, key, composed)
        if found is not None:
            return f"{shown(found[0].path)}, line {found[1]}"
    return None


def yaml_error(error: yaml.YAMLError) -> str:
    """A YAML syntax error as one line: the file, the line, what is wrong and the line's text."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).strip().splitlines()[0]
    if mark is None:
        return f"not valid YAML: {problem}"
    text = ""
    try:
        text = Path(mark.name).read_text(encoding="utf-8").splitlines()[mark.line].rstrip()
    except (OSError, UnicodeDecodeError, IndexError):
        pass
    shown_text = f": {text!r}" if text.strip() else ""
    hint = "; check its indentation: the keys of one section start in the same column" if "indent" in problem \
        or "mapping values" in problem or "block end" in problem else ""
    return (f"{shown(mark.name)}, line {mark.line + 1}: not valid YAML ({problem}, column {mark.column + 1})"
            f"{shown_text}{hint}")


def without_defaults(file: Path) -> str:
    """A primary config of the user's that composes none of rlnotes' settings (it has no defaults
    list naming `config`, or it is named config.yaml and so hides rlnotes' own)."""
    if file.stem == "config":
        return (f"{shown(file)} hides rlnotes' own config.yaml (a --config-dir is searched first): rename it, e.g. "
                f"to mine.yaml, start it with `defaults: [config, _self_]` and run it with --config-name mine")
    return (f"{shown(file)} does not start from rlnotes' settings: put `defaults: [config, _self_]` on its first "
            "line (rlnotes' config, then this file's values over it; docs/runs.md, 'Your own config file')")



def missing_primary(name: str, config_dir: Optional[str]) -> str:
    """A --config-name that no config dir holds: the YAML files the --config-dir does hold (the names
    --config-name takes), the closest first when one is close."""
    stem = name.removesuffix(".yaml")
    if not config_dir:
        return f"--config-name {name}: no such config; add --config-dir DIR, the dir that holds {stem}.yaml"
    found = sorted(p.name for p in Path(config_dir).glob("*.yaml"))
    if not found:
        return f"--config-name {name}: no {stem}.yaml in --config-dir {config_dir}, which holds no YAML files"
    close = difflib.get_close_matches(stem, [Path(f).stem for f in found], n=1)
    hint = f"; did you mean --config-name {close[0]}?" if close else ""
    return f"--config-name {name}: no {stem}.yaml in --config-dir {config_dir}; its YAML files: {', '.join(found)}{hint}"


def _defaults(path: Path, group: str) -> List[Tuple[str, Optional[str], int]]:
    """(group, option, line) of each `group: option` entry of the file's defaults list (`override`
    and `optional` taken off, a package `@pkg` too); a group is relative to the file's own (`group`)
    unless it starts with /."""
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    items = next((v.value for k, v in root.value if k.value == "defaults" and isinstance(v, yaml.SequenceNode)), []) \
        if isinstance(root, yaml.MappingNode) else []
    out = []
    for item in items:
        if not (isinstance(item, yaml.MappingNode) and len(item.value) == 1 and isinstance(item.value[0][1],
                                                                                          yaml.ScalarNode)):
            continue
        key, value = item.value[0]
        name = key.value.split()[-1].split("@")[0]  # "optional override /algo@x" -> "/algo"
        full = name[1:] if name.startswith("/") else f"{group}/{name}" if group else name
        out.append((full, None if value.value in ("null", "~", "") else value.value, key.start_mark.line + 1))
    return out


def chooser(configs, roots: Sequence[str], group: str, option: str) -> Optional[str]:
    """'FILE, line N' of the user's defaults-list entry that chooses `option` for `group` (`- algo:
    grpoo`, `- override /algo: grpoo`): in the configs `roots` (the primary, the command line's
    choices) when they are the user's files, and in the user's files their defaults lists choose."""
    todo, seen = list(roots), set()
    while todo:
        config = todo.pop(0)
        path = hydra.user_file(configs, config)
        if path is None or path in seen:
            continue
        seen.add(path)
        for entry_group, entry_option, line in _defaults(path, config.rpartition("/")[0]):
            if (entry_group, entry_option) == (group, option):
                return f"{shown(path)}, line {line}"
            if entry_option is not None:
                todo.append(f"{entry_group}/{entry_option}")
    return None
