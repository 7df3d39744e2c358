"""A user's own config files (a --config-name file, the group files of a --config-dir) in error
lines: a mistake found in one, or a value set by one that a check refuses, names the file and the
line, as a mistake on the command line names the override. rlnotes' own conf/ is never named (its
files are checked by the tests). Reads the files as YAML, for their lines; Hydra says which files a
composition read (rlnotes.commands.hydra.user_files)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

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

