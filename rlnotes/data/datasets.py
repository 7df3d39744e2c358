"""Rows from a built-in task, a local file or a hub dataset, in the shapes the Hugging Face
ecosystem gives them, checked and normalised to the rows the runners read (rlnotes.data.tasks).

Accepted shapes (after `data.columns` renames the source's columns to ours):
  prompt                          plain text, or a conversation: a list of {role, content} messages
  prompt + completion             SFT; the completion text, or a list with one assistant message
  messages                        SFT conversations: the last assistant turn is the completion
  text                            SFT language modeling: the whole text is the completion (empty prompt)
  prompt + chosen + rejected      preference pairs (DPO, RM), each answer text or one assistant message
  chosen + rejected (no prompt)   the implicit-prompt form: two conversations that share every turn
                                  but their last (assistant) one, which holds the answers, or two
                                  texts whose common beginning is the prompt (TRL's extract_prompt)
Every other column travels with its row: reward functions get it as a keyword argument.

Errors name the source, the row (1-based, in the source's order; a CSV's header is not a row) and
the column, and say what to change. The `datasets` library reads files and the hub; it is imported
only when one of them is used.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import random
import socket
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.errors import ConfigError
from rlnotes.data.tasks import TASKS, Row, Split, system_prompt
from rlnotes.engine.rollout import Prompt, encode_prompts
from rlnotes.rewards.loading import CALL_NAMES

# File extension -> the `datasets` builder that reads it.
FORMATS: Dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Columns each algorithm reads besides its reward's (the algorithms that sample read `prompt`).
ANSWER_COLUMNS = ("completion", "chosen", "rejected")
ROLES = ("system", "user", "assistant", "tool")
# The most rows a file or hub dataset holds out for evaluation by default (default_held_out).
DEFAULT_EVAL_ROWS = 200
# Seconds to wait for the hub before reading only the local cache.
HUB_PROBE_TIMEOUT = 3.0


@dataclass
class Table:
    """Rows of one source in its order, each with its 1-based row number there (kept through drops)."""

    source: str
    rows: List[Row]
    numbers: List[int]

    def where(self, i: int, column: str) -> str:
        return f"{self.source} row {self.numbers[i]}, column {column!r}"

    def keep(self, rows: List[Row], idx: List[int]) -> "Table":
        """A table of the rows `rows` that stand for this table's rows `idx`."""
        return Table(self.source, rows, [self.numbers[i] for i in idx])


@dataclass
class Data:
    """Train rows, and eval rows of their own or `eval_size` train rows to hold out with `seed`
    (null: `default_held_out`)."""

    train: Table
    eval: Optional[Table]
    eval_size: Optional[int]
    seed: int

    def held_out(self, evaluates: bool) -> int:
        """Train rows to hold out: data.eval_size, or by default none when nothing evaluates them."""
        if self.eval is not None:
            return 0
        if self.eval_size is not None:
            return self.eval_size
        return default_held_out(len(self.train.rows)) if evaluates else 0

    def split(self, evaluates: bool = True) -> Split:
        """(train rows, eval rows); held-out rows keep their order, and the rest train."""
        if self.eval is not None:
            return self.train.rows, self.eval.rows
        n, k = len(self.train.rows), self.held_out(evaluates)
        if evaluates and k == 0 and self.eval_size is None:
            raise ConfigError(f"{self.train.source} has {n} row, too few to hold one out for evaluation; give "
                              "data.eval_path (an eval file)")
        if k >= n:
            raise ConfigError(f"{self.train.source} has {n} rows and data.eval_size={k} would hold out all of them; "
                              f"lower data.eval_size (e.g. data.eval_size={n // 10}) or give data.eval_path")
        order = list(range(n))
        random.Random(self.seed).shuffle(order)
        held = set(order[:k])
        return ([r for i, r in enumerate(self.train.rows) if i not in held],
                [self.train.rows[i] for i in sorted(held)])


def default_held_out(n: int) -> int:
    """Rows a file or hub dataset of n rows without an eval split holds out when the run evaluates
    and data.eval_size is null: 10%, at least 1 (of 2 or more rows) and at most 200."""
    return min(DEFAULT_EVAL_ROWS, max(n // 10, 1 if n >= 2 else 0))


def evaluates(cfg) -> bool:
    """Whether a training run scores held-out rows: every trainer.eval_every steps."""
    return bool(cfg.trainer.eval_every)


# ------------------------------------------------------------------------------------ reading


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
                    f"got {_describe(value)}")
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


def read_source(cfg) -> Data:
    """The raw rows of data config `cfg`: a task's generated rows, or a file's or a hub dataset's."""
    if cfg.source == "task":
        train, eval_rows = TASKS[cfg.name](cfg)
        return Data(_table(f"task {cfg.name} (train)", train), _table(f"task {cfg.name} (eval)", eval_rows),
                    cfg.eval_size, cfg.seed)
    if cfg.source == "file":
        train = _table(cfg.path, read_file(cfg.path))
    else:
        train = _table(f"{cfg.name}[{cfg.split}]", read_hub(cfg.name, cfg.split, cfg.subset))
    if cfg.eval_path is not None:
        eval_table = _table(cfg.eval_path, read_file(cfg.eval_path, "data.eval_path"))
    elif cfg.eval_split is not None:
        eval_table = _table(f"{cfg.name}[{cfg.eval_split}]", read_hub(cfg.name, cfg.eval_split, cfg.subset,
                                                                       "data.eval_split"))
    else:
        eval_table = None
    return Data(train, eval_table, cfg.eval_size, cfg.seed)


def _table(source: str, rows: List[Row]) -> Table:
    if not rows:
        raise ConfigError(f"{source} has no rows")
    return Table(source, rows, list(range(1, len(rows) + 1)))


# ------------------------------------------------------------------------------------ normalising


def rename_columns(table: Table, columns: Dict[str, str]) -> Table:
    """Our column names for the source's: `columns` maps ours -> theirs (data.columns.prompt=question)."""
    if not columns:
        return table
    have = _columns(table)
    for ours, theirs in columns.items():
        if theirs not in have:
            raise ConfigError(f"data.columns.{ours}={theirs}: {table.source} has no column {theirs!r}; "
                              f"its columns: {', '.join(sorted(have))}")
    # A renamed column replaces one of ours of the same name; the source's own name goes.
    gone = set(columns) | set(columns.values())
    rows = [{**{k: v for k, v in row.items() if k not in gone},
             **{ours: row[theirs] for ours, theirs in columns.items()}} for row in table.rows]
    return replace(table, rows=rows)


def _columns(table: Table) -> set:
    return {k for row in table.rows for k in row}


def check_messages(value, where: str) -> List[Dict[str, str]]:
    """A conversation: a non-empty list of {role, content} messages with text content (keys whose
    value is null, as Arrow fills in for other rows' extra keys, are left out)."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a list of {{role, content}} messages, got {_describe(value)}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ConfigError(f"{where}: message {j + 1} must be {{role, content}} with role one of "
                              f"{', '.join(ROLES)} and text content, got {_describe(m)}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def check_prompt(value, where: str) -> Prompt:
    """A prompt: non-empty text, or a conversation."""
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: the prompt is empty")
        return value
    if isinstance(value, list):
        return check_messages(value, where)
    raise ConfigError(f"{where}: expected text or a list of {{role, content}} messages, got {_describe(value)}")


def answer_text(value, where: str) -> str:
    """A completion, chosen or rejected answer as text: text, or a list of one assistant message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        messages = check_messages(value, where)
        if len(messages) == 1 and messages[0]["role"] == "assistant":
            return messages[0]["content"]
    raise ConfigError(f"{where}: expected text or one assistant message, got {_describe(value)}")


def split_texts(chosen: str, rejected: str) -> Tuple[str, str, str]:
    """(prompt, chosen, rejected) of two texts with an implicit prompt, as TRL's extract_prompt
    splits them: the prompt is their longest common beginning, less a last space, which goes with
    the answers ("The sky is" + " blue.")."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def split_conversation(value, where: str) -> Tuple[List[Dict[str, str]], str]:
    """(prompt messages, reply) of a conversation whose last turn is the assistant's reply."""
    messages = check_messages(value, where)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise ConfigError(f"{where}: a conversation needs its prompt turns and a last assistant turn")
    return messages[:-1], messages[-1]["content"]


def _describe(value) -> str:
    """A short account of a wrong value for an error message: its type and its start."""
    if value is None:
        return "nothing (null)"
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def normalise_row(row: Row, table: Table, i: int) -> Row:
    """One row in the shape the runners read (see the module docstring); other columns kept."""
    row = dict(row)
    where = lambda column: table.where(i, column)  # noqa: E731
    if "prompt" not in row and "messages" in row:
        messages = check_messages(row.pop("messages"), where("messages"))
        if messages[-1]["role"] == "assistant":
            row["prompt"], row["completion"] = split_conversation(messages, where("messages"))
        else:  # a conversation still waiting for its reply: a prompt for the algorithms that sample
            row["prompt"] = messages
    elif "prompt" not in row and "chosen" in row and "rejected" in row:
        if isinstance(row["chosen"], str) and isinstance(row["rejected"], str):
            row["prompt"], row["chosen"], row["rejected"] = split_texts(row["chosen"], row["rejected"])
            if not row["prompt"]:
                raise ConfigError(f"{table.source} row {table.numbers[i]}: chosen and rejected texts share no "
                                  "beginning (the implicit prompt); give a prompt column")
        else:
            prompt, row["chosen"] = split_conversation(row["chosen"], where("chosen"))
            other, row["rejected"] = split_conversation(row["rejected"], where("rejected"))
            if prompt != other:
                raise ConfigError(f"{table.source} row {table.numbers[i]}: chosen and rejected must share every "
                                  "turn but the last (the implicit prompt), or give a prompt column")
            row["prompt"] = prompt
    elif "prompt" not in row and "completion" not in row and isinstance(row.get("text"), str):
        row["prompt"], row["completion"] = "", row.pop("text")  # language modeling: the whole text is the target
        return row
    if "prompt" in row:
        row["prompt"] = check_prompt(row["prompt"], where("prompt"))
    for column in ANSWER_COLUMNS:
        if column in row:
            row[column] = answer_text(row[column], where(column))
    return row


def apply_template(row: Row, template: Optional[str], where: str) -> Row:
    """data.prompt_template on a plain-text prompt: template.format(**row)."""
    if template is None or not row.get("prompt"):  # no prompt, or a plain-text row's empty one
        return row
    if not isinstance(row["prompt"], str):
        raise ConfigError(f"{where}: data.prompt_template applies to plain-text prompts and this one is a "
                          "conversation; put the wording in its messages or use data.system_prompt")
    try:
        return {**row, "prompt": template.format(**row)}
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"data.prompt_template={template!r} cannot be filled from {where.rpartition(',')[0]}: "
                          f"{type(e).__name__} {e}; it may name the row's columns ({', '.join(row)})") from None


def normalise(table: Table, cfg) -> Table:
    """The table with our column names, rows in our shape, and the prompt template applied."""
    table = rename_columns(table, dict(cfg.columns))
    rows = [normalise_row(row, table, i) for i, row in enumerate(table.rows)]
    rows = [apply_template(row, cfg.prompt_template, table.where(i, "prompt")) for i, row in enumerate(rows)]
    return replace(table, rows=rows)


def read(cfg) -> Data:
    """Rows of data config `cfg`, read and normalised (not yet fitted to a model; see `fit`)."""
    data = read_source(cfg)
    return replace(data, train=normalise(data.train, cfg), eval=data.eval and normalise(data.eval, cfg))


# ------------------------------------------------------------------------------------ checking


def reward_columns(fn, bound: Sequence[str] = ()) -> List[str]:
    """The columns a reward function cannot do without: its required parameters (keyword-only
    ones too) that are not among the names every call passes (rlnotes.rewards.scoring.CALL_NAMES:
    prompts, completions, ...) and not bound by reward args."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: nothing to learn
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty
            and p.name not in CALL_NAMES and p.name not in bound]


def needed_columns(algo: Optional[Algorithm], reward_fns: Sequence = ()) -> Dict[str, str]:
    """Column -> what needs it: the algorithm's columns (None: evaluation, which reads prompts), then
    each reward function's (objects with .name, .fn and .args, as rlnotes.rewards.scoring.Rewards
    holds them)."""
    needs = {c: f"algo={algo.name}" for c in algo.columns} if algo else {"prompt": "evaluation"}
    for rf in reward_fns:
        for column in reward_columns(rf.fn, tuple(rf.args)):
            needs.setdefault(column, f"reward {rf.name}")
    return needs


def require(table: Table, needs: Dict[str, str]) -> None:
    """Every row has every needed column, and the answer columns hold text."""
    have = _columns(table)
    for column, who in needs.items():
        if column not in have:
            raise ConfigError(f"{table.source} has no column {column!r}, which {who} needs; its columns: "
                              f"{', '.join(sorted(have))}; rename one with data.columns.{column}=COLUMN")
        for i, row in enumerate(table.rows):
            if column not in row or (row[column] is None and column in ("prompt",) + ANSWER_COLUMNS):
                raise ConfigError(f"{table.where(i, column)}: missing, which {who} needs")


def require_prompts(table: Table, who: str) -> None:
    """Every row has a prompt to sample from: a plain-text row ({"text": ...}) has none."""
    for i, row in enumerate(table.rows):
        if row.get("prompt") == "":
            raise ConfigError(f"{table.source} row {table.numbers[i]}: a {{\"text\": ...}} row (language modeling, "
                              f"for algo=sft) has no prompt to sample completions of, which {who} does; give a "
                              "prompt column (or messages)")


def load_checked(cfg, algo: Optional[Algorithm], reward_fns: Sequence = (), generating: Optional[str] = None) -> Data:
    """The run's rows, read and checked for what the algorithm `algo` and the reward functions need,
    and for prompts to sample from when something generates (`generating` names it; None: the
    algorithm, when it samples, or trainer.eval_every): a mistake in the data fails here, before the
    model loads. `algo` None: rows for evaluation alone."""
    data = read(cfg.data)
    needs = needed_columns(algo, reward_fns)
    if generating is None and algo is not None and algo.samples:
        generating = f"algo={cfg.algo.name}"
    elif generating is None and cfg.trainer.eval_every and cfg.eval.generate:
        generating = "eval.generate"
    for table in (data.train, data.eval):
        if table is not None:
            if generating:  # first: a file without prompts is the wrong file, whatever its columns
                require_prompts(table, generating)
            require(table, needs)
    return data


# ------------------------------------------------------------------------------------ fitting


def _key(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


class PromptLengths:
    """Token counts of prompts as the rollout engine encodes them, each distinct prompt once."""

    def __init__(self, tokenizer, chat_template: bool, system: Optional[str]):
        self.tokenizer, self.chat_template, self.system = tokenizer, chat_template, system
        self.known: Dict[str, int] = {}

    def __call__(self, prompts: Sequence[Prompt]) -> List[int]:
        new = {_key(p): p for p in prompts if _key(p) not in self.known}
        ids = encode_prompts(self.tokenizer, list(new.values()), self.chat_template, self.system)
        self.known.update({k: len(x) for k, x in zip(new, ids)})
        return [self.known[_key(p)] for p in prompts]

    def truncate(self, prompt: Prompt, max_len: int) -> Optional[Prompt]:
        """The prompt with the start of its text (its last message's, for a conversation) cut until
        it fits `max_len` tokens; None when even its template alone is longer."""
        for _ in range(4):  # decoding a cut can re-tokenize a little longer: a few rounds settle it
            excess = self([prompt])[0] - max_len
            if excess <= 0:
                return prompt
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if excess >= len(ids):
                return None
            text = self.tokenizer.decode(ids[excess:])
            prompt = text if isinstance(prompt, str) else prompt[:-1] + [{**prompt[-1], "content": text}]
        return None


def max_positions(model) -> Optional[int]:
    """The longest sequence the model takes (None when its config does not say)."""
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def fit_table(table: Table, cfg, lengths: PromptLengths, limit: Optional[int],
              samples: bool) -> Tuple[Table, int, int]:
    """(table, rows dropped, rows truncated): prompts over data.max_prompt_len dropped, truncated or
    an error (data.overlong); a row whose prompt and completion do not fit `limit` positions is an
    error that names it (`samples`: completions are sampled, rollout.max_new_tokens long at most;
    else the row's own answer columns are its completions)."""
    d = cfg.data
    sizes = lengths([r["prompt"] for r in table.rows])
    rows, idx, dropped, truncated = [], [], 0, 0
    for i, (row, size) in enumerate(zip(table.rows, sizes)):
        if d.max_prompt_len is not None and size > d.max_prompt_len:
            if d.overlong == "error":
                raise ConfigError(f"{table.where(i, 'prompt')}: {size} tokens, over data.max_prompt_len="
                                  f"{d.max_prompt_len}; shorten it, or set data.overlong=drop or truncate")
            prompt = lengths.truncate(row["prompt"], d.max_prompt_len) if d.overlong == "truncate" else None
            if prompt is None:
                dropped += 1
                continue
            row, size, truncated = {**row, "prompt": prompt}, lengths([prompt])[0], truncated + 1
        if limit is not None:
            _check_fits(table, i, row, size, limit, cfg, samples, lengths.tokenizer)
        rows.append(row)
        idx.append(i)
    if not rows:
        raise ConfigError(f"{table.source}: every prompt is longer than data.max_prompt_len={d.max_prompt_len} "
                          "tokens; raise it")
    return table.keep(rows, idx), dropped, truncated


def _check_fits(table: Table, i: int, row: Row, size: int, limit: int, cfg, samples: bool, tokenizer) -> None:
    """Stop on a row whose prompt and longest completion exceed the model's `limit` positions."""
    if samples:
        extra, what = cfg.rollout.max_new_tokens, "rollout.max_new_tokens"
    else:
        answers = {c: len(tokenizer(row[c], add_special_tokens=False)["input_ids"]) + 1
                   for c in ANSWER_COLUMNS if c in row}
        what, extra = max(answers.items(), key=lambda kv: kv[1])
        what = f"its {what} with EOS"
    if size + extra > limit:
        hint = "lower rollout.max_new_tokens, " if samples else ""
        raise ConfigError(f"{table.where(i, 'prompt')}: {size} prompt tokens + {extra} ({what}) exceed the model's "
                          f"{limit} positions; {hint}shorten it, or set data.max_prompt_len to drop or truncate "
                          "long prompts")


def fit_and_split(data: Data, cfg, tokenizer, limit: Optional[int], console=None,
                  evaluating: Optional[bool] = None, samples: bool = True) -> Split:
    """(train rows, eval rows) that fit the model: prompts measured with the run's chat settings,
    long ones handled by data.overlong (the counts shown on `console`), then the eval rows held out
    (`evaluating`: whether they will be scored; None: whether the training run `cfg` scores them).
    `samples`: whether completions are sampled (else the rows' answer columns must fit too)."""
    lengths = PromptLengths(tokenizer, cfg.model.chat_template, system_prompt(cfg))
    notes = []
    train, dropped, cut = fit_table(data.train, cfg, lengths, limit, samples)
    notes += _fit_note("train", len(data.train.rows), dropped, cut, cfg.data)
    eval_table = data.eval
    if eval_table is not None:
        eval_table, dropped, cut = fit_table(eval_table, cfg, lengths, limit, samples)
        notes += _fit_note("eval", len(data.eval.rows), dropped, cut, cfg.data)
    evaluating = evaluates(cfg) if evaluating is None else evaluating
    train_rows, eval_rows = replace(data, train=train, eval=eval_table).split(evaluating)
    if len(train_rows) < cfg.trainer.batch_size:
        raise ConfigError(f"{data.train.source} gives {len(train_rows)} training rows, fewer than "
                          f"trainer.batch_size={cfg.trainer.batch_size}; lower trainer.batch_size or data.eval_size")
    if console is not None:
        console.print(f"data: {data.train.source}: {len(train_rows)} train rows, {len(eval_rows)} eval rows"
                      f"{_held_out_note(data, len(eval_rows))}" + "".join(f"; {n}" for n in notes), highlight=False)
    return train_rows, eval_rows


def _held_out_note(data: Data, held: int) -> str:
    """How the eval rows came about, for the start-of-run line: a default is said, with how to change it."""
    if data.eval is not None:
        return ""
    if data.eval_size is not None:
        return f" (held out with data.seed={data.seed})"
    if held == 0:
        return " (by default none are held out when the run does not evaluate; data.eval_size=N or data.eval_path=FILE)"
    return (f" (held out by default, 10% of the rows, with data.seed={data.seed}; data.eval_size=N or "
            "data.eval_path=FILE to choose)")


def _fit_note(split: str, total: int, dropped: int, cut: int, d) -> List[str]:
    """What data.overlong did to a split, for the console."""
    over = f"longer than data.max_prompt_len={d.max_prompt_len} tokens"
    return ([f"{dropped} of {total} {split} prompts {over} dropped"] if dropped else []) + \
        ([f"{cut} of {total} {split} prompts {over} truncated"] if cut else [])
