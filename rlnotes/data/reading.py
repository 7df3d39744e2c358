"""Rows from a local file (.jsonl, .json, .parquet, .csv) or a hub dataset, as the `datasets`
library reads them, each failure turned into one line that says what to change. The library is
imported only when a file or the hub is read.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Dict, Iterator, List, Optional
from urllib.parse import urlparse

from rlnotes.core.errors import ConfigError
from rlnotes.data.formats import describe
from rlnotes.data.tasks import Row

# File extension -> the `datasets` builder that reads it.
FORMATS: Dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Seconds to wait for the hub before reading only the local cache.
HUB_PROBE_TIMEOUT = 3.0


def _datasets():
    """The `datasets` library, quiet: its progress bars mean nothing to a user of rlnotes."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


def read_file(path: str, key: str = "data.path") -> List[Row]:
    """The rows of a .jsonl, .json, .parquet or .csv file (`key` names the setting in errors)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}={path}: no such file")
    builder = FORMATS.get(file.suffix.lower())
    if builder is None:
        raise ConfigError(f"{key}={path}: unknown format {file.suffix!r}; use one of {', '.join(FORMATS)}")
    if file.stat().st_size == 0:
        raise ConfigError(f"{path} has no rows")
    datasets = _datasets()
    try:
        with _quiet():
            rows = datasets.load_dataset(builder, data_files=str(file), split="train").to_list()
    except Exception as e:  # noqa: BLE001 - any parse error of the library becomes one line
        bad = _bad_json(file) if builder == "json" else None
        raise ConfigError(bad or f"{key}={path} could not be read as {builder}: {_first_line(e)}") from None
    return rows


@contextmanager
def _quiet() -> Iterator[None]:
    """The `datasets` library's own error log off for one call: its failure becomes our one line
    (it would print the same error twice, once through its handler and once through Hydra's)."""
    library = logging.getLogger("datasets")
    level = library.level
    library.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        library.setLevel(level)


def _bad_json(file: Path) -> Optional[str]:
    """Where a .json or .jsonl file stops being JSON: its line (and column) and what is wrong, or None
    when every line parses (the library failed for another reason). A .json file may be one document
    or JSON Lines."""
    text = file.read_text(encoding="utf-8", errors="replace")
    if file.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # not JSON Lines either: the document's own error
                return f"{file} line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); fix the file"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            return f"{file} line {number}, column {e.colno}: not valid JSON ({e.msg}); fix or remove the line"
        if not isinstance(value, dict):
            return (f"{file} line {number}: expected one JSON object per line ({{\"prompt\": ...}}), "
                    f"got {describe(value)}")
    return None


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT) -> bool:
    """Whether the hub's host answers a TCP connection (False in offline mode): one cheap probe
    instead of the library's retries, which take most of a minute on a machine without network."""
    import datasets.config
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE or HF_DATASETS_OFFLINE
        return False
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True  # only the proxy knows; let the library try
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


@contextmanager
def offline() -> Iterator[None]:
    """Offline mode of the hub libraries for one call: `datasets` reads its local cache only."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def read_hub(name: str, split: str, subset: Optional[str] = None, key: str = "data.split") -> List[Row]:
    """The rows of split `split` of hub dataset `name` (or of a local dataset folder); without
    network only the local cache is read, and a dataset not in it fails at once."""
    datasets = _datasets()
    online = Path(name).expanduser().is_dir() or hub_reachable()
    try:
        with nullcontext() if online else offline(), _quiet():
            return datasets.load_dataset(name, subset, split=split).to_list()
    except ValueError as e:  # an unknown split or subset
        raise ConfigError(f"{key}={split} (data.name={name}, data.subset={subset}): {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - not found, no network, bad files: one line each
        if not online:
            stem = name.rstrip("/").rpartition("/")[2]
            args = ", ".join([repr(name)] + ([repr(subset)] if subset else []) + [f"split={split!r}"])
            raise ConfigError(
                f"data=hub data.name={name}: the hub cannot be reached from here and the dataset is not in the local "
                f"cache; download it where there is network (datasets.load_dataset({args})"
                f".to_json('{stem}.jsonl')), then use data=file data.path={stem}.jsonl") from None
        raise ConfigError(f"data.name={name}: could not load it from the hub: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
