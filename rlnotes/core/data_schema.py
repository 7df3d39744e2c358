"""The data section of the typed config schema (rlnotes.core.schema): where the prompts come from
and the settings of the built-in tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from omegaconf import OmegaConf


@dataclass
class DataConfig:
    # Where rows come from (rlnotes.data.settings.SOURCES): task (a built-in task named by `name`), file
    # (`path`) or hub (the dataset `name`); data=file and data=hub set it.
    source: str = "task"
    # The task or dataset. task: the built-in task (see rlnotes.data.tasks.TASKS); "auto" picks the
    # algorithm's default task (its ALGORITHM.default_task), recorded in the run's config.yaml. hub: the
    # dataset id (org/set) or a local dataset folder.
    name: str = "auto"
    # file: the training file; the format comes from the extension (.jsonl, .json, .parquet, .csv).
    # Given without data=file, it means data=file.
    path: Optional[str] = None
    # hub: the dataset's subset (configuration) name, e.g. "main"; null = its default.
    subset: Optional[str] = None
    # hub: the split to train on.
    split: str = "train"
    # An eval file (file and hub): eval rows from a file of their own; null = hold out eval_size rows
    # (hub: or take eval_split).
    eval_path: Optional[str] = None
    # The eval split. hub: eval rows from a split of their own; null = hold out eval_size rows. A
    # built-in task: test (= null, its held-out rows) or dev (as many more, for tuning).
    eval_split: Optional[str] = None
    # Rename the source's columns, ours -> theirs: data.columns.prompt=question (any column rlnotes reads).
    columns: Dict[str, str] = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))
    # System message of prompts without a system turn; null = model.system_prompt.
    system_prompt: Optional[str] = None
    # Plain-text prompts become template.format(**row), e.g. "Question: {prompt}\nAnswer:";
    # null = the prompt as it is.
    prompt_template: Optional[str] = None
    # Longest prompt in tokens (chat template included); null = what the model's context holds
    # beside the completion (a longer prompt is then an error).
    max_prompt_len: Optional[int] = None
    # What happens to a prompt over max_prompt_len: drop the row, truncate (keep its last tokens,
    # as the question usually ends it) or error. The count is shown at the start of the run.
    overlong: str = "drop"
    # Training prompts a built-in task generates from the seed. A file or hub dataset trains on all
    # of its rows that are not held out.
    train_size: int = 1000
    # Eval prompts a task holds out. arith holds them out of training when the problem space is at
    # least 4x larger (two or more digits); small spaces (one digit, letters) are in-distribution.
    # file and hub without eval_path/eval_split: rows held out at random (with `seed`).
    # null: 200 for a built-in task; for a file or hub dataset none when the run does not evaluate
    # (TRL's default), else 10% of its rows (at most 200), said at the start of the run.
    eval_size: Optional[int] = None
    # Seed of the task generator and of the held-out rows (held fixed across run seeds so runs
    # see the same data).
    seed: int = 1234
    # Digits per operand. arith: of each operand; countdown: of each number (at most).
    digits: int = 1
    # The most digits per operand; null = data.digits. arith: operands of every size from `digits` to
    # this, in equal shares (a curriculum of easy and hard problems); each size holds out its own eval
    # rows.
    max_digits: Optional[int] = None
    # Operators to draw from. arith: of the question; countdown: of the hidden expression that
    # makes the target.
    ops: str = "+"
    # Text appended to each question (arith and countdown).
    instruction: str = "Answer with just the number."
    # Operands per problem (arith): 3 asks 'What is 347+589+123?'. Each count has its own problems, so
    # its held-out rows never appear in another count's training.
    operands: int = 2
    # arith: give each training row a `messages` column, a demonstration of one call of this built-in
    # tool (the question, the assistant's call, the tool's result, the number) for an SFT warm-up on it
    # (sft_warmup.column=messages); the held-out rows get none. calculator: {"expression": "639+142"};
    # add: {"a": 639, "b": 142} (two-operand sums). null: none.
    tool_demos: Optional[str] = None
    # arith, sums only: give each training row a `worked` column, the sum worked column by column, ones
    # first, with each carry written ('7+8=15. 4+3+1=8. 85'), for an SFT warm-up on it
    # (sft_warmup.column=worked); the number comes last, where the built-in arith reward reads it.
    worked: bool = False
    # The letters the prompts ask for (letters).
    letters: str = "a"
