"""Rows of a file or hub dataset in the shapes the Hugging Face ecosystem gives them (TRL's
dataset formats), checked and normalised to the rows the algorithms read (rlnotes.data.tasks).

Accepted shapes (after `data.columns` renames the source's columns to ours):
  prompt                          plain text, or a conversation: a list of {role, content} messages
  prompt + completion             SFT; the completion text, or a list with one assistant message
  messages                        SFT conversations: every assistant turn is learnt, the turns before the
                                  first are the prompt (the last turn is also the `completion`)
  text                            SFT language modeling: the whole text is the completion (empty prompt)
  prompt + chosen + rejected      preference pairs (DPO, RM), each answer text or one assistant message
  chosen + rejected (no prompt)   the implicit-prompt form: two conversations that share every turn
                                  but their last (assistant) one, which holds the answers, or two
                                  texts whose common beginning is the prompt (TRL's extract_prompt)
Every other column travels with its row: reward functions get it as a keyword argument.

Errors name the source, the row (1-based, in the source's order; a CSV's header is not a row) and
the column, and say what to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from rlnotes.core.errors import ConfigError
from rlnotes.data.tasks import Row
from rlnotes.engine.prompts import Prompt, tool_call_parts

# Columns each algorithm reads besides its reward's (the algorithms that sample read `prompt`).
ANSWER_COLUMNS = ("completion", "chosen", "rejected")
ROLES = ("system", "user", "assistant", "tool")


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


def rename_columns(table: Table, columns: Dict[str, str]) -> Table:
    """Our column names for the source's: `columns` maps ours -> theirs (data.columns.prompt=question)."""
    if not columns:
        return table
    have = column_names(table)
    for ours, theirs in columns.items():
        if theirs not in have:
            raise ConfigError(f"data.columns.{ours}={theirs}: {table.source} has no column {theirs!r}; "
                              f"its columns: {', '.join(sorted(have))}")
    # A renamed column replaces one of ours of the same name; the source's own name goes.
    gone = set(columns) | set(columns.values())
    rows = [{**{k: v for k, v in row.items() if k not in gone},
             **{ours: row[theirs] for ours, theirs in columns.items()}} for row in table.rows]
    return replace(table, rows=rows)


def column_names(table: Table) -> set:
    return {k for row in table.rows for k in row}


def check_messages(value, where: str) -> List[Dict[str, str]]:
    """A conversation: a non-empty list of {role, content} messages with text content (keys whose
    value is null, as Arrow fills in for other rows' extra keys, are left out). An assistant message
    may hold `tool_calls` (TRL's {"type": "function", "function": {"name", "arguments"}}) instead of
    content, or besides it."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a list of {{role, content}} messages, got {describe(value)}")
    out = []
    for j, m in enumerate(value):
        m = {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if calls is not None:
            _check_tool_calls(calls, f"{where}: message {j + 1}")
            m = {"content": "", **m}
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ConfigError(f"{where}: message {j + 1} must be {{role, content}} with role one of "
                              f"{', '.join(ROLES)} and text content, got {describe(m)}")
        out.append(m)
    return out


def _check_tool_calls(calls, where: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise ConfigError(f"{where}: tool_calls must be a non-empty list of calls, got {describe(calls)}")
    for k, call in enumerate(calls):
        try:
            tool_call_parts(call)
        except ValueError as e:
            raise ConfigError(f"{where}, tool call {k + 1}: {e}, got {describe(call)}") from None


def check_conversation(value, where: str) -> List[Dict[str, str]]:
    """A demonstration conversation (check_messages) with at least one assistant turn to learn."""
    messages = check_messages(value, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: a demonstration needs an assistant turn to learn from; its roles are "
                          f"{', '.join(m['role'] for m in messages)}")
    return messages


def check_prompt(value, where: str) -> Prompt:
    """A prompt: non-empty text, or a conversation."""
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: the prompt is empty")
        return value
    if isinstance(value, list):
        return check_messages(value, where)
    raise ConfigError(f"{where}: expected text or a list of {{role, content}} messages, got {describe(value)}")


def answer_text(value, where: str) -> str:
    """A completion, chosen or rejected answer as text: text, or a list of one assistant message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        messages = check_messages(value, where)
        if len(messages) == 1 and messages[0]["role"] == "assistant":
            return messages[0]["content"]
    raise ConfigError(f"{where}: expected text or one assistant message, got {describe(value)}")


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


def describe(value) -> str:
    """A short account of a wrong value for an error message: its type and its start."""
    if value is None:
        return "nothing (null)"
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def normalise_row(row: Row, table: Table, i: int) -> Row:
    """One row in the shape the algorithms read (see the module docstring); other columns kept."""
    row = dict(row)
    where = lambda column: table.where(i, column)  # noqa: E731
    if "prompt" not in row and "messages" in row:
        messages = check_messages(row.pop("messages"), where("messages"))
        if messages[-1]["role"] == "assistant":  # a demonstration: SFT trains on each of its assistant turns
            row["prompt"], row["completion"] = split_conversation(messages, where("messages"))
            row["messages"] = messages
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
