"""Built-in tasks: prompts generated from a seed, with train and held-out eval splits.

A row is a dict with a `prompt` (plain text, or a list of {role, content} messages) and the
columns its reward needs (`answer`, `letter`, `numbers` and `target`); reward functions receive
those columns as keyword arguments. Preference rows add `chosen` and `rejected`, demonstrations
`completion`. Rows from files and the hub (rlnotes.data.datasets) take the same shape.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Tuple

Row = Dict[str, Any]
Split = Tuple[List[Row], List[Row]]


# The operators of arith and countdown.
_OPS: Dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                              "*": lambda a, b: a * b}


def _check_ops(ops: str) -> Dict[str, Callable[[int, int], int]]:
    """The operators named by data.ops."""
    if not ops or set(ops) - set(_OPS):
        from rlnotes.core.errors import ConfigError

        raise ConfigError(f"data.ops={ops!r}: use a string of the operators {', '.join(_OPS)}")
    return {op: _OPS[op] for op in ops}


# The eval rows of a built-in task when data.eval_size is null.
TASK_EVAL_SIZE = 200


def task_eval_size(cfg) -> int:
    """A built-in task's eval rows: data.eval_size, null meaning TASK_EVAL_SIZE."""
    return TASK_EVAL_SIZE if cfg.eval_size is None else cfg.eval_size


def _split(space: List[Row], train_size: int, eval_size: int, seed: int) -> Split:
    """Held-out eval rows first; train rows are drawn from what is left when the problem space is
    large enough (at least 4x the eval set), otherwise from the whole space (in-distribution)."""
    rng = random.Random(seed)
    eval_rows = rng.sample(space, min(eval_size, len(space)))
    held = {r["prompt"] for r in eval_rows}
    pool = [r for r in space if r["prompt"] not in held] if len(space) >= 4 * len(eval_rows) else space
    train_rows = [rng.choice(pool) for _ in range(train_size)]
    return train_rows, eval_rows


def arith(cfg) -> Split:
    """'What is 23+58? Answer with just the number.' with operands of `cfg.digits` digits, or of
    every size from `cfg.digits` to `cfg.max_digits` in equal shares. Each size holds out its own
    eval rows, the same ones a run with data.digits=<that size> holds out, so a model trained on a
    mix can be scored on exactly the held-out two-digit problems (eval.data={digits: 2})."""
    if cfg.max_digits is None or cfg.max_digits == cfg.digits:
        return _arith(cfg, cfg.digits, cfg.train_size)
    if cfg.max_digits < cfg.digits:
        from rlnotes.core.errors import ConfigError

        raise ConfigError(f"data.max_digits={cfg.max_digits} is below data.digits={cfg.digits}; raise it or set "
                          "it to null (one operand size)")
    sizes = range(cfg.digits, cfg.max_digits + 1)
    per_size = -(-cfg.train_size // len(sizes))
    splits = [_arith(cfg, d, per_size) for d in sizes]
    train = [splits[i % len(sizes)][0][i // len(sizes)] for i in range(cfg.train_size)]
    return train, [row for _, eval_rows in splits for row in eval_rows]


def _arith(cfg, digits: int, train_size: int) -> Split:
    lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
    ops = _check_ops(cfg.ops)
    rng = random.Random(cfg.seed)
    size = (hi - lo + 1) ** 2 * len(set(cfg.ops))
    if size <= 50_000:
        problems = [(a, op, b) for op in sorted(set(cfg.ops)) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    else:  # too many to list: a large random sample stands for the space
        problems = list({(rng.randint(lo, hi), rng.choice(cfg.ops), rng.randint(lo, hi)) for _ in range(50_000)})
        problems.sort()
    space = [{"prompt": f"What is {a}{op}{b}? {cfg.instruction}".strip(), "answer": str(ops[op](a, b))}
             for a, op, b in problems]
    return _split(space, train_size, task_eval_size(cfg), cfg.seed)


def letters(cfg) -> Split:
    """'Write the letter a:'; the reward is the share of completion characters that are that letter."""
    space = [{"prompt": f"Write the letter {c}{suffix}", "letter": c}
             for c in cfg.letters for suffix in (":", "!", " please:", " many times:", ".")]
    rng = random.Random(cfg.seed)
    eval_rows = [rng.choice(space) for _ in range(task_eval_size(cfg))]
    train_rows = [rng.choice(space) for _ in range(cfg.train_size)]
    return train_rows, eval_rows


def _wrong_answer(cfg, row: Row) -> str:
    """A wrong answer near the right one, the same for a prompt on every call (seeded by it)."""
    rng = random.Random(f"{cfg.seed}:{row['prompt']}")
    return str(int(row["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3]))


def arith_pairs(cfg) -> Split:
    """arith as preference pairs: `chosen` is the right answer, `rejected` a wrong one (DPO, RM)."""
    return tuple([{**r, "chosen": r["answer"], "rejected": _wrong_answer(cfg, r)} for r in rows]
                 for rows in arith(cfg))


def arith_sft(cfg) -> Split:
    """arith as demonstrations: `completion` is the right answer (SFT)."""
    return tuple([{**r, "completion": r["answer"]} for r in rows] for rows in arith(cfg))


def letters_pairs(cfg) -> Split:
    """letters as preference pairs: `chosen` is the asked letter 4 times, `rejected` another letter
    4 times. Far easier to separate than arith_pairs: what tests of DPO and RM learn on the tiny model."""
    rng = random.Random(cfg.seed)
    others = lambda c: [o for o in "abcdefghijklmnopqrstuvwxyz" if o != c]  # noqa: E731
    return tuple([{**r, "chosen": r["letter"] * 4, "rejected": rng.choice(others(r["letter"])) * 4} for r in rows]
                 for rows in letters(cfg))


def hidden_expression(numbers: List[int], ops: str, rng: random.Random) -> Tuple[str, int]:
    """(text, value) of a random expression that uses each of `numbers` exactly once: neighbours in
    a shuffled order are joined by a random operator until one term is left (any tree shape)."""
    terms = [(str(n), n) for n in rng.sample(numbers, len(numbers))]
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        op = rng.choice(ops)
        (a, x), (b, y) = terms[i], terms[i + 1]
        terms[i:i + 2] = [(f"({a} {op} {b})", _OPS[op](x, y))]
    text, value = terms[0]
    return (text[1:-1] if text.startswith("(") else text), value


def countdown(cfg) -> Split:
    """'Using the numbers [3, 7, 2], write an expression that equals 23.' with 3 or 4 numbers of
    `cfg.digits` digits (at most) and a target from 1 to 999. The target is the value of a hidden
    random expression over the numbers (kept in the `solution` column), so every problem has an
    answer. Problems are distinct and the eval problems never appear in train."""
    ops = "".join(op for op in _OPS if op in _check_ops(cfg.ops))
    rng = random.Random(cfg.seed)
    hi = 10**cfg.digits - 1
    wanted = task_eval_size(cfg) + cfg.train_size
    rows: Dict[str, Row] = {}
    misses = 0
    while len(rows) < wanted and misses < 2000:  # 2000 draws in a row with nothing new: the space is spent
        numbers = [rng.randint(1, hi) for _ in range(rng.choice((3, 4)))]
        solution, target = hidden_expression(numbers, ops, rng)
        prompt = (f"Using the numbers {numbers}, write an expression that equals {target}. Use {' '.join(ops)} "
                  f"and parentheses, each number at most once. {cfg.instruction}").strip()
        new = 1 <= target <= 999 and prompt not in rows
        if new:
            rows[prompt] = {"prompt": prompt, "numbers": numbers, "target": target, "solution": solution}
        misses = 0 if new else misses + 1
    space = list(rows.values())
    if len(space) < wanted:
        from rlnotes.core.errors import ConfigError

        raise ConfigError(f"data.train_size + data.eval_size = {wanted} is more than the {len(space)} distinct "
                          "countdown problems found; lower them or raise data.digits")
    return space[task_eval_size(cfg):], space[:task_eval_size(cfg)]


TASKS: Dict[str, Callable] = {"arith": arith, "letters": letters, "countdown": countdown, "arith_pairs": arith_pairs,
                              "arith_sft": arith_sft, "letters_pairs": letters_pairs}
# The reward (a name in rlnotes.rewards.scoring.REWARDS) that reward=auto gives each task.
TASK_REWARDS: Dict[str, str] = {"arith": "number_match", "letters": "letter_share", "countdown": "countdown",
                                "arith_pairs": "number_match", "arith_sft": "number_match",
                                "letters_pairs": "letter_share"}
# Where data.source takes its rows from: a built-in task (data.name), a local file (data.path) or
# a hub dataset (data.name = org/set); files and the hub are read by rlnotes.data.datasets.
SOURCES = ("task", "file", "hub")
# What data.overlong does with a prompt longer than data.max_prompt_len tokens.
OVERLONG = ("drop", "truncate", "error")


def load_task(cfg) -> Split:
    """(train rows, eval rows) of the data config `cfg`: a built-in task, a file or a hub dataset,
    normalised to the row shape above (rlnotes.data.datasets, which builds on the tasks here)."""
    from rlnotes.data.datasets import read

    return read(cfg).split()


def file_from_path(d) -> None:
    """data.path given without data=file: the default data (data=auto) becomes that file; a task or
    hub dataset chosen by name is left for check_data_config to refuse."""
    if d.path and d.source == "task" and d.name == "auto":
        d.source, d.name = "file", "file"


def system_prompt(cfg) -> Optional[str]:
    """The system message of prompts that have no system turn: data.system_prompt (it belongs to
    the data), else model.system_prompt (a default for the model), else none."""
    return cfg.data.system_prompt if cfg.data.system_prompt is not None else cfg.model.system_prompt


def check_data_config(cfg) -> None:
    """The data settings a schema type cannot check, before anything loads."""
    from rlnotes.core.checks import check_choice
    from rlnotes.core.errors import ConfigError

    d = cfg.data
    check_choice("data.source", d.source, SOURCES)
    check_choice("data.overlong", d.overlong, OVERLONG)
    if d.source == "task":
        check_choice("data.name", d.name, TASKS)
        if d.train_size < cfg.trainer.batch_size:
            raise ConfigError(f"data.train_size={d.train_size} is smaller than trainer.batch_size="
                              f"{cfg.trainer.batch_size}; raise data.train_size or lower trainer.batch_size")
    if d.source == "hub" and d.name in ("auto", ""):  # "auto" is the schema's default, not a dataset
        raise ConfigError("data=hub needs the dataset: data.name=org/set (or a local dataset folder)")
    if d.path and d.source != "file":
        option, what = (d.name, "a built-in task") if d.source == "task" else ("hub", "a hub dataset (data.name)")
        raise ConfigError(f"data.path={d.path} is a file to read, but data={option} reads {what}; drop data={option} "
                          "(a path alone means data=file) or drop data.path")
    if d.source == "file" and not d.path:
        raise ConfigError("data=file needs the file to read: data.path=FILE (.jsonl, .json, .parquet or .csv)")
    if d.source != "hub" and d.eval_split is not None:
        raise ConfigError(f"data.eval_split names a split of a hub dataset (data=hub); with data.source={d.source} "
                          "give an eval file (data.eval_path=FILE) or hold out data.eval_size rows")
    if d.eval_path is not None and d.source == "task":
        raise ConfigError("data.eval_path is for data=file and data=hub; a built-in task makes its own eval rows")
    if d.max_prompt_len is not None and d.max_prompt_len < 1:
        raise ConfigError(f"data.max_prompt_len={d.max_prompt_len} must be at least 1 (tokens), or null for none")
    if d.eval_size is not None and d.eval_size < 0:
        raise ConfigError(f"data.eval_size={d.eval_size} must be 0 or more (or null: the default)")
    held_out = d.eval_path is not None or d.eval_split is not None
    if d.eval_size == 0 and not held_out and cfg.trainer.eval_every:
        raise ConfigError(f"trainer.eval_every={cfg.trainer.eval_every} evaluates held-out rows and data.eval_size=0 "
                          "holds out none; set data.eval_size to 1 or more (or null), give data.eval_path (a hub "
                          "dataset: data.eval_split) or set trainer.eval_every=null")


class PromptSampler:
    """Epoch-wise shuffled batches of rows, deterministic in the seed; its position is its state."""

    def __init__(self, rows: List[Row], batch_size: int, seed: int):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> List[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def state_dict(self) -> Dict[str, int]:
        """The data position: the epoch (its shuffle is seeded by seed and epoch) and the row within it."""
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "rows": len(self.rows)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()

    def next_batch(self) -> List[Row]:
        if self.pos + self.batch_size > len(self.rows):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.rows[i] for i in idx]
