"""Built-in tasks: prompts generated from a seed, with train and held-out eval splits.

A row is a dict with a `prompt` (plain text, or a list of {role, content} messages) and the
columns its reward needs (`answer`, `letter`, `numbers` and `target`); reward functions receive
those columns as keyword arguments. Preference rows add `chosen` and `rejected`, demonstrations
`completion`. Rows from files and the hub (rlnotes.data.datasets) take the same shape.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Dict, List, Tuple

from rlnotes.core.errors import ConfigError

Row = Dict[str, Any]
Split = Tuple[List[Row], List[Row]]


# The operators of arith and countdown.
_OPS: Dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                              "*": lambda a, b: a * b}


def _check_ops(ops: str) -> Dict[str, Callable[[int, int], int]]:
    """The operators named by data.ops."""
    if not ops or set(ops) - set(_OPS):
        raise ConfigError(f"data.ops={ops!r}: use a string of the operators {', '.join(_OPS)}")
    return {op: _OPS[op] for op in ops}


# The eval rows of a built-in task when data.eval_size is null.
TASK_EVAL_SIZE = 200


def task_eval_size(cfg) -> int:
    """A built-in task's eval rows: data.eval_size, null meaning TASK_EVAL_SIZE."""
    return TASK_EVAL_SIZE if cfg.eval_size is None else cfg.eval_size


# data.eval_split of a built-in task: its held-out test rows (null means test) or its dev rows.
TASK_EVAL_SPLITS = ("test", "dev")


def wants_dev(cfg) -> bool:
    """Whether data config `cfg` evaluates on the task's dev rows (data.eval_split=dev)."""
    return cfg.eval_split == "dev"


def _split(space: List[Row], train_size: int, eval_size: int, seed: int, dev: bool = False) -> Split:
    """Held-out eval rows first; train rows are drawn from what is left when the problem space is
    large enough (at least 4x the eval set), otherwise from the whole space (in-distribution).

    A space of at least 8x the eval set also holds out a dev split of the same size, disjoint from
    the test rows and from training, for tuning (data.eval_split=dev); `dev` returns it as the eval
    rows. The test rows are the same whether or not dev is asked for. In a smaller space the dev
    rows are the test rows, as everything there is in-distribution anyway."""
    rng = random.Random(seed)
    eval_rows = rng.sample(space, min(eval_size, len(space)))
    held = {r["prompt"] for r in eval_rows}
    dev_rows = eval_rows
    if len(space) >= 8 * len(eval_rows):
        dev_rows = rng.sample([r for r in space if r["prompt"] not in held], len(eval_rows))
        held |= {r["prompt"] for r in dev_rows}
    pool = [r for r in space if r["prompt"] not in held] if len(space) >= 4 * len(eval_rows) else space
    train_rows = [rng.choice(pool) for _ in range(train_size)]
    return train_rows, dev_rows if dev else eval_rows


def arith(cfg) -> Split:
    """'What is 23+58? Answer with just the number.' with operands of `cfg.digits` digits, or of
    every size from `cfg.digits` to `cfg.max_digits` in equal shares, `cfg.operands` of them
    ('What is 347+589+123?'). Each size holds out its own eval rows, the same ones a run with
    data.digits=<that size> holds out, so a model trained on a mix can be scored on exactly the
    held-out two-digit problems (eval.data={digits: 2}). With `cfg.tool_demos` each train row (never
    a held-out one) has a `messages` column too: a demonstration of that tool (TOOL_DEMOS)."""
    if cfg.max_digits is None or cfg.max_digits == cfg.digits:
        train, eval_rows = _arith(cfg, cfg.digits, cfg.train_size)
    elif cfg.max_digits < cfg.digits:
        raise ConfigError(f"data.max_digits={cfg.max_digits} is below data.digits={cfg.digits}; raise it or set "
                          "it to null (one operand size)")
    else:
        sizes = range(cfg.digits, cfg.max_digits + 1)
        per_size = -(-cfg.train_size // len(sizes))
        splits = [_arith(cfg, d, per_size) for d in sizes]
        train = [splits[i % len(sizes)][0][i // len(sizes)] for i in range(cfg.train_size)]
        eval_rows = [row for _, rows in splits for row in rows]
    if cfg.tool_demos:
        demo = TOOL_DEMOS[cfg.tool_demos]
        train = [{**row, "messages": demo(row)} for row in train]
    if cfg.worked:
        train = [{**row, "worked": worked_sum(row)} for row in train]
    return train, eval_rows


def worked_sum(row: Row) -> str:
    """A sum of an arith row worked column by column, ones first, each column's digits and the carry
    into it written out, then the number: 47+38 -> '7+8=15. 4+3+1=8. 85'; 42+13 -> '2+3=5. 4+1+0=5. 55';
    3+4 -> '3+4=7. 7'. Every step is a one-digit sum (SmolLM2 writes each digit as a token of its own)."""
    operands = _expression(row).split("+")
    width = max(map(len, operands))
    digits = [o.rjust(width, "0") for o in operands]
    steps, carry = [], 0
    for col in range(width - 1, -1, -1):
        terms = [d[col] for d in digits] + ([str(carry)] if col < width - 1 else [])
        total = sum(map(int, terms))
        steps.append(f"{'+'.join(terms)}={total}")
        carry = total // 10
    return ". ".join(steps + [row["answer"]])


def _expression(row: Row) -> str:
    """The arithmetic of an arith row's question: '347+589' of 'What is 347+589? ...'."""
    return row["prompt"].removeprefix("What is ").split("?")[0]


def _tool_demo(row: Row, name: str, arguments: str) -> List[Dict[str, str]]:
    """The conversation that answers an arith row with one call of the built-in tool `name`: the
    question, the assistant's call (`arguments`: its JSON), the tool's result (the answer), then the
    number alone."""
    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, arguments)
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": call},
            {"role": "tool", "name": name, "content": row["answer"]},
            {"role": "assistant", "content": row["answer"]}]


def calculator_demo(row: Row) -> List[Dict[str, str]]:
    """An arith row answered with one call of the built-in calculator tool, in the form the
    calculator experiment's system prompt shows: {"expression": "639+142"}."""
    return _tool_demo(row, "calculator", '{"expression": "%s"}' % _expression(row))


def add_demo(row: Row) -> List[Dict[str, str]]:
    """A two-operand sum answered with one call of the built-in add tool: {"a": 347, "b": 589}."""
    a, b = _expression(row).split("+")
    return _tool_demo(row, "add", '{"a": %s, "b": %s}' % (a, b))


# data.tool_demos: the demonstration each train row gets, by the built-in tool it calls.
TOOL_DEMOS: Dict[str, Callable[[Row], List[Dict[str, str]]]] = {"calculator": calculator_demo, "add": add_demo}


def _value(numbers: Tuple[int, ...], ops: Tuple[str, ...]) -> int:
    """The value of numbers[0] ops[0] numbers[1] ops[1] ...: * before + and -, then left to right."""
    terms = [numbers[0]]  # the summands, each with its sign
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n if op == "+" else -n)
    return sum(terms)


def _arith(cfg, digits: int, train_size: int) -> Split:
    lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
    # Read once: an OmegaConf attribute costs far more than a local name, and the loops below run up to
    # 50,000 times.
    op_chars, instruction, n = cfg.ops, cfg.instruction, cfg.operands
    _check_ops(op_chars)
    rng = random.Random(cfg.seed)
    size = (hi - lo + 1) ** n * len(set(op_chars)) ** (n - 1)
    # A problem is (a, op, b, op, c, ...): two operands keep the order and draws they always had.
    if size <= 50_000:
        numbers = list(itertools.product(range(lo, hi + 1), repeat=n))
        problems = [tuple(x for pair in itertools.zip_longest(ns, os) for x in pair if x is not None)
                    for os in itertools.product(sorted(set(op_chars)), repeat=n - 1) for ns in numbers]
    else:  # too many to list: a large random sample stands for the space
        problems = list({tuple(rng.randint(lo, hi) if i % 2 == 0 else rng.choice(op_chars) for i in range(2 * n - 1))
                         for _ in range(50_000)})
        problems.sort()
    space = [{"prompt": f"What is {''.join(map(str, p))}? {instruction}".strip(),
              "answer": str(_value(p[::2], p[1::2]))} for p in problems]
    return _split(space, train_size, task_eval_size(cfg), cfg.seed, wants_dev(cfg))


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
    answer. Problems are distinct; the test problems and the dev problems (data.eval_split=dev)
    never appear in train."""
    ops = "".join(op for op in _OPS if op in _check_ops(cfg.ops))
    rng = random.Random(cfg.seed)
    hi = 10**cfg.digits - 1
    size = task_eval_size(cfg)
    wanted = 2 * size + cfg.train_size  # test rows, dev rows, train rows
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
        raise ConfigError(f"data.train_size + 2 x data.eval_size (test and dev rows) = {wanted} is more than the "
                          f"{len(space)} distinct countdown problems found; lower them or raise data.digits")
    return space[2 * size:], space[size:2 * size] if wants_dev(cfg) else space[:size]


TASKS: Dict[str, Callable] = {"arith": arith, "letters": letters, "countdown": countdown, "arith_pairs": arith_pairs,
                              "arith_sft": arith_sft, "letters_pairs": letters_pairs}
# The reward (a name in rlnotes.rewards.builtin.REWARDS) that reward=auto gives each task.
TASK_REWARDS: Dict[str, str] = {"arith": "number_match", "letters": "letter_share", "countdown": "countdown",
                                "arith_pairs": "number_match", "arith_sft": "number_match",
                                "letters_pairs": "letter_share"}
