"""The rows of a run: from a built-in task (rlnotes.data.tasks), a local file or a hub dataset
(rlnotes.data.reading), normalised to one shape (rlnotes.data.formats) and checked for the columns
the algorithm and its reward functions need, before the model loads; once it has loaded,
rlnotes.data.fitting fits them to it and splits them into train and eval rows.

Errors name the source, the row (1-based, in the source's order; a CSV's header is not a row) and
the column, and say what to change.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from rlnotes.agents.routing import COLUMN, environment_of
from rlnotes.core.algorithm import Algorithm
from rlnotes.core.errors import ConfigError
from rlnotes.data.fitting import Data
from rlnotes.data.formats import ANSWER_COLUMNS, Table, check_conversation, column_names, normalise
from rlnotes.data.reading import read_file, read_hub
from rlnotes.data.tasks import TASKS, Row, Split
from rlnotes.rewards.loading import CALL_NAMES


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


def read(cfg) -> Data:
    """Rows of data config `cfg`, read and normalised (not yet fitted to a model: fitting.fit_and_split)."""
    data = read_source(cfg)
    return replace(data, train=normalise(data.train, cfg), eval=data.eval and normalise(data.eval, cfg))


def load_task(cfg) -> Split:
    """(train rows, eval rows) of the data config `cfg`: a built-in task, a file or a hub dataset,
    normalised to the rows the algorithms read."""
    return read(cfg).split()


# ------------------------------------------------------------------------------------ checking


def reward_columns(fn, bound: Sequence[str] = ()) -> List[str]:
    """The columns a reward function cannot do without: its required parameters (keyword-only
    ones too) that are not among the names every call passes (rlnotes.rewards.loading.CALL_NAMES:
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
    have = column_names(table)
    for column, who in needs.items():
        if column not in have:
            raise ConfigError(f"{table.source} has no column {column!r}, which {who} needs; its columns: "
                              f"{', '.join(sorted(have))}; rename one with data.columns.{column}=COLUMN")
        for i, row in enumerate(table.rows):
            if column not in row or (row[column] is None and column in ("prompt",) + ANSWER_COLUMNS):
                raise ConfigError(f"{table.where(i, column)}: missing, which {who} needs")


def require_demonstrations(table: Table, column: str, who: str) -> None:
    """Every row holds in `column` the demonstration that `who` (sft_warmup.steps=N) trains on: text
    (the completion of its prompt), or a conversation (check_conversation) whose assistant turns it
    learns; a wrong one is one line naming the row."""
    for i, row in enumerate(table.rows):
        value = row.get(column)
        if isinstance(value, list):
            row[column] = check_conversation(value, table.where(i, column))
        elif not isinstance(value, str):
            shown = sorted(k for k, v in row.items() if k != "prompt" and (isinstance(v, str) or (
                isinstance(v, list) and v and all(isinstance(m, dict) for m in v))))
            raise ConfigError(f"{who} trains on each row's demonstration, but {table.where(i, column)} has no text "
                              "nor conversation; set sft_warmup.column to one of: "
                              f"{', '.join(shown) or '(no text or conversation columns)'}")


def require_prompts(table: Table, who: str) -> None:
    """Every row has a prompt to sample from: a plain-text row ({"text": ...}) has none."""
    for i, row in enumerate(table.rows):
        if row.get("prompt") == "":
            raise ConfigError(f"{table.source} row {table.numbers[i]}: a {{\"text\": ...}} row (language modeling, "
                              f"for algo=sft) has no prompt to sample completions of, which {who} does; give a "
                              "prompt column (or messages)")


def refuse_call_names(table: Table) -> None:
    """No column is named like a keyword every reward call passes (CALL_NAMES): the call's own value
    would take its place, so no reward function could read it. Refused rather than warned of: a
    reward reading it would score every sample of the run from the call's values instead, a
    warning scrolls away while it does, and the fix is one setting (data.columns), made before the
    model loads."""
    taken = [name for name in CALL_NAMES if name in column_names(table)]
    if taken:
        raise ConfigError(f"{table.source} has a column named like a keyword every reward call passes itself "
                          f"({', '.join(taken)}), so no reward function would see its values; rename: "
                          + " ".join(f"data.columns.data_{name}={name}" for name in taken))


def require_environments(table: Table, names: Sequence[str]) -> None:
    """Every row names one of rollout.env's environments `names` in its `environment` column
    (rlnotes.agents.routing), each row checked now rather than when a batch first draws it."""
    if COLUMN not in column_names(table):
        raise ConfigError(f"{table.source} has no column {COLUMN!r}: rollout.env maps names to environments, and each "
                          f"row picks its own there (one of: {', '.join(names)}); or name another column with "
                          f"data.columns.{COLUMN}=COLUMN")
    for i, row in enumerate(table.rows):
        environment_of(row, names, table.where(i, COLUMN))


def load_checked(d, algo: Optional[Algorithm], reward_fns: Sequence = (), generating: Optional[str] = None,
                 environments: Sequence[str] = ()) -> Data:
    """The rows of data config `d`, read and checked for what the algorithm `algo` and the reward
    functions need, for prompts to sample from when something generates (the algorithm, when it
    samples, else what `generating` names: evaluation, eval.generate; None: nothing), and for one
    of `environments` in each row when rollout.env maps names to them. A mistake in the data fails
    here, before the model loads. `algo` None: rows for evaluation alone."""
    data = read(d)
    needs = needed_columns(algo, reward_fns)
    if generating is None and algo is not None and algo.samples:
        generating = f"algo={algo.name}"
    for table in (data.train, data.eval):
        if table is not None:
            if generating:  # first: a file without prompts is the wrong file, whatever its columns
                require_prompts(table, generating)
                refuse_call_names(table)  # its rows go to reward functions
            require(table, needs)
            if environments:
                require_environments(table, environments)
    return data
