"""Rows from a local file (.jsonl, .json, .parquet, .csv) or a hub dataset, each failure turned
into one line that says what to change.

Text files are read as they are written: a CSV cell is text (`007` stays "007", `NA` stays "NA";
an empty cell is null), and a JSON value keeps its JSON type (a string that looks like a date or
a number stays a string), so a reward compares what the file holds. They are read with the
standard library, which also gives every mistake its line. Parquet files and hub datasets are
read by the `datasets` library, with the types their columns declare; it is imported only then.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
import os
import socket
from contextlib import contextmanager, nullcontext
from itertools import zip_longest
from pathlib import Path
from typing import Dict, Iterator, List, Optional
from urllib.parse import urlparse

from rlnotes.core.errors import ConfigError
from rlnotes.data.formats import describe
from rlnotes.data.tasks import Row

# File extension -> what reads it: the `datasets` builder (parquet) or our own reader (json, csv).
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
    if file.is_dir():
        folder = f" (a folder of data files, or a dataset saved for the hub: data=hub data.name={path})" \
            if key == "data.path" else ""
        raise ConfigError(f"{key}={path} is a directory; give a data file: .jsonl, .json, .parquet or .csv{folder}")
    if not file.is_file():
        raise ConfigError(f"{key}={path}: no such file")
    builder = FORMATS.get(file.suffix.lower())
    if builder is None:
        raise ConfigError(f"{key}={path}: unknown format {file.suffix!r}; use one of {', '.join(FORMATS)}")
    if file.stat().st_size == 0:
        raise ConfigError(f"{path} has no rows")
    if builder == "parquet":
        return _parquet_rows(file, path, key)
    text = _text(file)
    if not text.strip():
        raise ConfigError(f"{path} has no rows: it holds only blank lines")
    return _csv_rows(file, text) if builder == "csv" else _json_rows(file, text)


def _parquet_rows(file: Path, path: str, key: str) -> List[Row]:
    import pyarrow.parquet

    datasets = _datasets()
    try:
        if pyarrow.parquet.ParquetFile(file).metadata.num_rows:  # the library fails on no rows, saying nothing
            with _quiet():
                return datasets.load_dataset("parquet", data_files=str(file), split="train").to_list()
    except Exception as e:  # noqa: BLE001 - any parse error of the library becomes one line
        while e.__cause__ is not None or e.__context__ is not None:  # its "error while generating" hides why
            e = e.__cause__ or e.__context__
        raise ConfigError(f"{key}={path} could not be read as parquet: {_first_line(e)}") from None
    raise ConfigError(f"{path} has no rows")


def _text(file: Path) -> str:
    """The file's text: UTF-8 (a leading byte-order mark is dropped, as editors on Windows write one);
    any other encoding is one line naming the first line that is not UTF-8."""
    data = file.read_bytes()
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or b"\x00" in data[:4096]:
        raise ConfigError(f"{file} is not UTF-8 text (its bytes look like UTF-16, as Windows tools write); "
                          "save it in the UTF-8 encoding")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise ConfigError(f"{file} line {line}, byte {column}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the "
                          f"file in the UTF-8 encoding (from Latin-1: iconv -f latin1 -t utf-8 {file.name} > "
                          f"utf8-{file.name})") from None


def _csv_rows(file: Path, text: str) -> List[Row]:
    """A CSV file's rows, every cell as the text it holds (an empty cell is null); the first line
    that is not blank names the columns. Blank lines are skipped."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: Optional[List[str]] = None
    rows: List[Row] = []
    start = 1  # the line a record begins on (a quoted cell may hold line breaks)
    try:
        for fields in reader:
            if not fields or (len(fields) == 1 and not fields[0].strip()):
                start = reader.line_num + 1
                continue
            if header is None:
                header = _csv_header(file, fields, start)
            elif len(fields) > len(header):
                raise ConfigError(f"{file} line {start}: {len(fields)} cells, but the header names {len(header)} "
                                  f"columns ({', '.join(header)}); put a cell holding a comma in double quotes")
            else:
                rows.append({name: value if value else None for name, value in zip_longest(header, fields)})
            start = reader.line_num + 1
    except csv.Error as e:
        raise ConfigError(f"{file} line {start}: not valid CSV ({e}); a cell holding a comma, quote or line break "
                          "goes in double quotes, its quotes doubled") from None
    return rows


def _csv_header(file: Path, fields: List[str], line: int) -> List[str]:
    """Column names of a CSV header; an unnamed column is called "Unnamed: i", as pandas calls it
    (pandas writes its index column without a name)."""
    names = [name or f"Unnamed: {i}" for i, name in enumerate(fields)]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"{file} line {line}: the header names column {twice[0]!r} twice; rename one")
    return names


def _json_rows(file: Path, text: str) -> List[Row]:
    """The rows of a .json or .jsonl file, each value of the JSON type it is written as: JSON Lines
    (one object per line), or one document: a list of objects, or an object of columns. A .json
    file is tried as one document first, a .jsonl file as JSON Lines first. Every row gets every
    column (null where a row lacks it), as the `datasets` library fills them."""
    if file.suffix.lower() == ".json":
        try:
            return _filled(_document_rows(file, json.loads(text)))
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # not JSON Lines either: the document's own error
                raise ConfigError(f"{file} line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}); "
                                  "fix the file") from None
    rows, problem = _json_lines(file, text)
    if problem is None:
        return _filled(rows)
    try:  # a .jsonl file that holds one document (a list of objects), as the `datasets` library reads it
        return _filled(_document_rows(file, json.loads(text)))
    except json.JSONDecodeError:
        raise ConfigError(problem) from None


def _json_lines(file: Path, text: str) -> tuple[List[Row], Optional[str]]:
    """(rows, None) of JSON Lines text, or ([], the first bad line's one-line error)."""
    rows = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): a JSON string may hold U+2028
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            return [], f"{file} line {number}, column {e.colno}: not valid JSON ({e.msg}); fix or remove the line"
        if not isinstance(value, dict):
            return [], (f"{file} line {number}: expected one JSON object per line ({{\"prompt\": ...}}), "
                        f"got {describe(value)}")
        rows.append(value)
    return rows, None


SHAPES = ('a list of rows ([{"prompt": ...}, ...]), columns ({"prompt": [...], "answer": [...]}) '
          'or one object per line (JSON Lines)')


def _document_rows(file: Path, doc) -> List[Row]:
    """The rows of one JSON document: a list of objects; an object of columns of one length (as
    `json.dump(df.to_dict("list"))` writes them; pandas' `to_json()` writes each column as an object
    keyed by row index "0", "1", ..., and orient="index" each row under its index); or an object
    that is one row."""
    if isinstance(doc, list):
        for i, row in enumerate(doc):
            if not isinstance(row, dict):
                raise ConfigError(f"{file}: item {i + 1} of the list is {describe(row)}; give {SHAPES}")
        return doc
    if not isinstance(doc, dict) or not doc:
        raise ConfigError(f"{file} holds {describe(doc)}; give {SHAPES}")
    values = list(doc.values())
    if len(doc) == 1 and _is_records(values[0]):  # {"data": [rows]}: the rows one level down
        raise ConfigError(f"{file} is one JSON object whose {next(iter(doc))!r} holds a list of objects; if those "
                          f"are the rows, put them at the top level: give {SHAPES}")
    if all(isinstance(v, list) for v in values) and not any(_is_conversation(v) for v in values):
        lengths = {column: len(v) for column, v in doc.items()}
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{column}: {n}" for column, n in lengths.items())
            raise ConfigError(f"{file} holds columns of different lengths ({shown}); give each column one value "
                              "per row")
        return [dict(zip(doc, cells)) for cells in zip(*values)]
    if all(k.isdigit() for k in doc) and all(isinstance(v, dict) for v in values):  # pandas' orient="index"
        return values
    if all(isinstance(v, dict) and v and all(k.isdigit() for k in v) for v in values):  # pandas' to_json()
        index = list(dict.fromkeys(k for v in values for k in v))
        return [{column: v.get(i) for column, v in doc.items()} for i in index]
    return [doc]  # one row, as the `datasets` library reads a lone object


def _is_records(value) -> bool:
    """A non-empty list of objects that are not messages."""
    return isinstance(value, list) and bool(value) and all(isinstance(x, dict) for x in value) \
        and not _is_conversation(value)


def _is_conversation(value) -> bool:
    """A list of {role, ...} messages: one cell of a row, never a column of several rows' cells."""
    return bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _filled(rows: List[Row]) -> List[Row]:
    """Every row with every column of the file, in the order they first appear (null where missing)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{k: row.get(k) for k in columns} for row in rows]


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
    source = _hub_source(name)
    datasets = _datasets()
    if _saved_to_disk(Path(source)):
        return _read_saved(datasets, source, name, split, key)
    online = Path(source).is_dir() or hub_reachable()
    try:
        with nullcontext() if online else offline(), _quiet():
            return datasets.load_dataset(source, subset, split=split).to_list()
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


def _saved_to_disk(path: Path) -> bool:
    """A folder that `datasets`' save_to_disk wrote: one dataset (state.json) or one per split
    (dataset_dict.json); load_dataset refuses the first and says to use load_from_disk."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _read_saved(datasets, source: str, name: str, split: str, key: str) -> List[Row]:
    """The rows of split `split` of a folder save_to_disk wrote (_saved_to_disk). A dataset saved
    without splits is its train split: its rows are what data.split=train reads."""
    saved = datasets.load_from_disk(source)
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ConfigError(f"{key}={split}: data.name={name} has the splits {', '.join(saved)}; name one of them")
        return saved[split].to_list()
    if split != "train":
        raise ConfigError(f"{key}={split}: data.name={name} is one dataset saved without splits (save_to_disk of a "
                          "Dataset): it is the train split; cut the eval rows from it (data.eval_size) or save a "
                          "DatasetDict with a split of that name")
    return saved.to_list()


def _hub_source(name: str) -> str:
    """data.name as the `datasets` library takes it: a local dataset folder (~ expanded) or a hub id
    (name or org/name); a file, or a path to no folder, is one line (the library would look for it
    on the hub and blame the network)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ConfigError(f"data.name={name} is a file, and data=hub reads a hub dataset or a dataset folder; read "
                          f"the file with data=file data.path={name}")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ConfigError(f"data.name={name}: no such folder, and not a hub id (name or org/name)")
    return name


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
