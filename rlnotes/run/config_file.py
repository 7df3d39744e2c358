"""A run's config.yaml: the resolved config it ran with, and which rlnotes made it.

A run dir, each of its checkpoints and an eval's output dir hold one; it is read back to resume a
run (rlnotes.run.restore), to evaluate or export its policy, and by whoever asks how a result was
made. The version (VERSION_KEY) is a record of the code, not a setting: the schema has no such key,
so `rlnotes_version=...` on a command line is refused as unknown, and `+rlnotes_version=...` is
written over here. A config.yaml written before rlnotes recorded its version lacks the key.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlnotes import __version__
from rlnotes.run import files

# The key of config.yaml's first line, `rlnotes_version: X.Y.Z`.
VERSION_KEY = "rlnotes_version"


def recorded(cfg) -> DictConfig:
    """`cfg` resolved, as config.yaml records it: this rlnotes's version first, then the settings."""
    settings = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    settings.pop(VERSION_KEY, None)
    return OmegaConf.create({VERSION_KEY: __version__, **settings})


def write(path: Path, cfg) -> None:
    """Write `cfg` to `path` as a run's config.yaml (see `recorded`), aside and renamed into place
    (rlnotes.run.files.write_text)."""
    files.write_text(path, OmegaConf.to_yaml(recorded(cfg)))
