"""Built-in tasks: prompts generated from a seed, with train and held-out eval splits.

A row is a dict with a `prompt` (plain text) and the columns its reward needs (`answer`,
`letter`); reward functions receive those columns as keyword arguments.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Tuple

Row = Dict[str, str]
Split = Tuple[List[Row], List[Row]]


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
    """'What is 23+58? Answer with just the number.' with operands of `cfg.digits` digits."""
    lo, hi = (0, 9) if cfg.digits == 1 else (10 ** (cfg.digits - 1), 10**cfg.digits - 1)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    bad = set(cfg.ops) - set(ops)
    if bad or not cfg.ops:
        from rlnotes.config import ConfigError

        raise ConfigError(f"data.ops={cfg.ops!r}: use a string of the operators {', '.join(ops)}")
    rng = random.Random(cfg.seed)
    size = (hi - lo + 1) ** 2 * len(set(cfg.ops))
    if size <= 50_000:
        problems = [(a, op, b) for op in sorted(set(cfg.ops)) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    else:  # too many to list: a large random sample stands for the space
        problems = list({(rng.randint(lo, hi), rng.choice(cfg.ops), rng.randint(lo, hi)) for _ in range(50_000)})
        problems.sort()
    space = [{"prompt": f"What is {a}{op}{b}? {cfg.instruction}".strip(), "answer": str(ops[op](a, b))}
             for a, op, b in problems]
    return _split(space, cfg.train_size, cfg.eval_size, cfg.seed)


def letters(cfg) -> Split:
    """'Write the letter a:'; the reward is the share of completion characters that are that letter."""
    space = [{"prompt": f"Write the letter {c}{suffix}", "letter": c}
             for c in cfg.letters for suffix in (":", "!", " please:", " many times:", ".")]
    rng = random.Random(cfg.seed)
    eval_rows = [rng.choice(space) for _ in range(cfg.eval_size)]
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


TASKS: Dict[str, Callable] = {"arith": arith, "letters": letters, "arith_pairs": arith_pairs, "arith_sft": arith_sft,
                              "letters_pairs": letters_pairs}
# The reward (a name in rlnotes.rewards.REWARDS) that reward=auto gives each task.
TASK_REWARDS: Dict[str, str] = {"arith": "number_match", "letters": "letter_share", "arith_pairs": "number_match",
                                "arith_sft": "number_match", "letters_pairs": "letter_share"}


def load_task(cfg) -> Split:
    return TASKS[cfg.name](cfg)


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

    def next_batch(self) -> List[Row]:
        if self.pos + self.batch_size > len(self.rows):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.rows[i] for i in idx]
