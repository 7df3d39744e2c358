"""The data section of the config beyond what its schema types check: where rows come from
(SOURCES), what becomes of a prompt that is too long (OVERLONG), the system prompt, and the checks
made before anything loads."""

from __future__ import annotations

from typing import Optional

from rlnotes.core.checks import check_choice
from rlnotes.core.errors import ConfigError
from rlnotes.data.tasks import TASK_EVAL_SPLITS, TASKS, TOOL_DEMOS
from rlnotes.engine.prompts import PromptFormat

# Where data.source takes its rows from: a built-in task (data.name), a local file (data.path) or
# a hub dataset (data.name = org/set); files and the hub are read by rlnotes.data.reading.
SOURCES = ("task", "file", "hub")
# What data.overlong does with a prompt longer than data.max_prompt_len tokens.
OVERLONG = ("drop", "truncate", "error")


def file_from_path(d) -> None:
    """data.path given without data=file: the default data (data=auto) becomes that file; a task or
    hub dataset chosen by name is left for check_data_config to refuse."""
    if d.path and d.source == "task" and d.name == "auto":
        d.source, d.name = "file", "file"


def system_prompt(cfg) -> Optional[str]:
    """The system message of prompts that have no system turn: data.system_prompt (it belongs to
    the data), else model.system_prompt (a default for the model), else none."""
    return cfg.data.system_prompt if cfg.data.system_prompt is not None else cfg.model.system_prompt


def prompt_format(cfg) -> PromptFormat:
    """How the run's prompts reach the model: model.chat_template and the system prompt."""
    return PromptFormat(cfg.model.chat_template, system_prompt(cfg))


def own_eval_rows(d) -> bool:
    """Whether a file or hub dataset (data config `d`) takes its eval rows from a source of their own
    (data.eval_path, a hub's data.eval_split) rather than holding them out of its train rows."""
    return d.eval_path is not None or (d.source == "hub" and d.eval_split is not None)


def check_tool_demos(d) -> None:
    """data.tool_demos names a tool whose one call answers each of the arith task's train rows."""
    if d.tool_demos is None:
        return
    check_choice("data.tool_demos", d.tool_demos, TOOL_DEMOS)
    if d.source != "task" or d.name != "arith":
        raise ConfigError(f"data.tool_demos={d.tool_demos} writes demonstrations of the arith task's problems; use "
                          "data=arith or set data.tool_demos=null (a file can hold its own messages column)")
    if d.tool_demos == "add" and (d.operands != 2 or d.ops != "+"):
        raise ConfigError(f"data.tool_demos=add demonstrates one call of add(a, b), which answers a sum of two "
                          f"numbers: set data.operands=2 and data.ops=+ (now {d.operands} and {d.ops!r})")


def check_worked(d) -> None:
    """data.worked writes sums of the arith task worked column by column."""
    if not d.worked:
        return
    if d.source != "task" or d.name != "arith" or set(d.ops) != {"+"}:
        raise ConfigError("data.worked=true writes the arith task's sums worked column by column; use data=arith "
                          f"with data.ops=+ (now {d.name if d.source == 'task' else d.source} with {d.ops!r}) or "
                          "set data.worked=false")


def check_data_config(d, trainer) -> None:
    """The data settings `d` a schema type cannot check, before anything loads, with the trainer
    settings they must agree with (trainer.batch_size, trainer.eval_every)."""
    check_choice("data.source", d.source, SOURCES)
    check_choice("data.overlong", d.overlong, OVERLONG)
    if d.source == "task":
        check_choice("data.name", d.name, TASKS)
        if d.train_size < trainer.batch_size:
            raise ConfigError(f"data.train_size={d.train_size} is smaller than trainer.batch_size="
                              f"{trainer.batch_size}; raise data.train_size or lower trainer.batch_size")
    check_tool_demos(d)
    check_worked(d)
    if d.source == "hub" and d.name in ("auto", ""):  # "auto" is the schema's default, not a dataset
        raise ConfigError("data=hub needs the dataset: data.name=org/set (or a local dataset folder)")
    if d.path and d.source != "file":
        option, what = (d.name, "a built-in task") if d.source == "task" else ("hub", "a hub dataset (data.name)")
        raise ConfigError(f"data.path={d.path} is a file to read, but data={option} reads {what}; drop data={option} "
                          "(a path alone means data=file) or drop data.path")
    if d.source == "file" and not d.path:
        raise ConfigError("data=file needs the file to read: data.path=FILE (.jsonl, .json, .parquet or .csv)")
    if d.source == "task" and d.eval_split not in (None, *TASK_EVAL_SPLITS):
        raise ConfigError(f"data.eval_split={d.eval_split}: a built-in task evaluates on its held-out rows, "
                          f"choose one of {', '.join(TASK_EVAL_SPLITS)} (test: the default; dev: for tuning)")
    if d.source == "file" and d.eval_split is not None:
        raise ConfigError("data.eval_split names a split of a hub dataset (data=hub) or of a built-in task (test, "
                          "dev); with data=file give an eval file (data.eval_path=FILE) or hold out data.eval_size rows")
    if d.eval_path is not None and d.source == "task":
        raise ConfigError("data.eval_path is for data=file and data=hub; a built-in task makes its own eval rows")
    if d.max_prompt_len is not None and d.max_prompt_len < 1:
        raise ConfigError(f"data.max_prompt_len={d.max_prompt_len} must be at least 1 (tokens), or null for none")
    if d.eval_size is not None and d.eval_size < 0:
        raise ConfigError(f"data.eval_size={d.eval_size} must be 0 or more (or null: the default)")
    if d.eval_size == 0 and not own_eval_rows(d) and trainer.eval_every:
        raise ConfigError(f"trainer.eval_every={trainer.eval_every} evaluates held-out rows and data.eval_size=0 "
                          "holds out none; set data.eval_size to 1 or more (or null), give data.eval_path (a hub "
                          "dataset: data.eval_split) or set trainer.eval_every=null")
