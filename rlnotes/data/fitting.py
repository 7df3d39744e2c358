"""Rows fitted to the model and split: each prompt measured as the rollout engine encodes it, a
prompt over data.max_prompt_len dropped, truncated or refused (data.overlong), a row longer than
the model's positions refused, then the eval rows held out of the train rows.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from rlnotes.core.errors import ConfigError
from rlnotes.data.formats import ANSWER_COLUMNS, Table
from rlnotes.data.settings import own_eval_rows, system_prompt
from rlnotes.data.tasks import Row, Split
from rlnotes.engine.prompts import Prompt, encode_prompts

# The most rows a file or hub dataset holds out for evaluation by default (default_held_out).
DEFAULT_EVAL_ROWS = 200


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


def seen_in_training(trained, trained_evaluates: bool, d) -> bool:
    """Whether the eval rows of data config `d` are rows that a run on data config `trained` trained
    on: `d` holds them out of a file's or hub split's rows (Data.split), and the run, on those same
    rows, held none out (its eval rows came from elsewhere, data.eval_size=0, or by default because
    it did not evaluate: `trained_evaluates` false; see Data.held_out)."""
    if d.source == "task" or own_eval_rows(d) or not _same_rows(trained, d):
        return False
    return own_eval_rows(trained) or trained.eval_size == 0 or (trained.eval_size is None and not trained_evaluates)


def _same_rows(a, b) -> bool:
    """Whether data configs `a` and `b` read the same train rows: one file, or one hub split."""
    if a.source != b.source:
        return False
    if a.source == "hub":
        return (a.name, a.subset, a.split) == (b.name, b.subset, b.split)
    try:
        return os.path.samefile(a.path, b.path)
    except OSError:  # one is gone: the paths as given decide
        return os.path.abspath(a.path) == os.path.abspath(b.path)


def _key(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)  # a date in a message


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


def fit_table(table: Table, d, lengths: PromptLengths, limit: Optional[int],
              max_new_tokens: Optional[int]) -> Tuple[Table, int, int]:
    """(table, rows dropped, rows truncated): prompts over data.max_prompt_len dropped, truncated or
    an error (data.overlong, of data config `d`); a row whose prompt and completion do not fit
    `limit` positions is an error that names it (completions are sampled, `max_new_tokens` long at
    most; None: the row's own answer columns are its completions)."""
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
            _check_fits(table, i, row, size, limit, max_new_tokens, lengths.tokenizer)
        rows.append(row)
        idx.append(i)
    if not rows:
        raise ConfigError(f"{table.source}: every prompt is longer than data.max_prompt_len={d.max_prompt_len} "
                          "tokens; raise it")
    return table.keep(rows, idx), dropped, truncated


def _check_fits(table: Table, i: int, row: Row, size: int, limit: int, max_new_tokens: Optional[int],
                tokenizer) -> None:
    """Stop on a row whose prompt and longest completion exceed the model's `limit` positions."""
    samples = max_new_tokens is not None
    if samples:
        extra, what = max_new_tokens, "rollout.max_new_tokens"
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


def evaluates(cfg) -> bool:
    """Whether a training run scores held-out rows: every trainer.eval_every steps."""
    return bool(cfg.trainer.eval_every)


def fit_and_split(data: Data, cfg, tokenizer, limit: Optional[int], console=None,
                  evaluating: Optional[bool] = None, samples: bool = True, training: bool = True,
                  label: str = "data") -> Split:
    """(train rows, eval rows) that fit the model: prompts measured with the run's chat settings,
    long ones handled by data.overlong (the counts shown on `console`), then the eval rows held out
    (`evaluating`: whether they will be scored; None: whether the training run `cfg` scores them).
    `samples`: whether completions are sampled (else the rows' answer columns must fit too);
    `training`: whether batches of trainer.batch_size train rows will be drawn (not to evaluate alone);
    `label`: the settings the line on `console` names (sft_warmup.data for the warm-up's own rows)."""
    lengths = PromptLengths(tokenizer, cfg.model.chat_template, system_prompt(cfg))
    max_new_tokens = cfg.rollout.max_new_tokens if samples else None
    notes = []
    train, dropped, cut = fit_table(data.train, cfg.data, lengths, limit, max_new_tokens)
    notes += _fit_note("train", len(data.train.rows), dropped, cut, cfg.data)
    eval_table = data.eval
    if eval_table is not None:
        eval_table, dropped, cut = fit_table(eval_table, cfg.data, lengths, limit, max_new_tokens)
        notes += _fit_note("eval", len(data.eval.rows), dropped, cut, cfg.data)
    evaluating = evaluates(cfg) if evaluating is None else evaluating
    train_rows, eval_rows = replace(data, train=train, eval=eval_table).split(evaluating)
    if training and len(train_rows) < cfg.trainer.batch_size:
        raise ConfigError(f"{data.train.source} gives {len(train_rows)} training rows, fewer than "
                          f"trainer.batch_size={cfg.trainer.batch_size}; lower trainer.batch_size or data.eval_size")
    if console is not None:
        console.print(f"{label}: {data.train.source}: {len(train_rows)} train rows, {len(eval_rows)} eval rows"
                      f"{_held_out_note(data, len(eval_rows))}" + "".join(f"; {n}" for n in notes), highlight=False)
    return train_rows, eval_rows


def _held_out_note(data: Data, held: int) -> str:
    """How the eval rows came about, for the start-of-run line: a default is said, with how to change it."""
    if data.eval is not None:
        return f" (from {data.eval.source})" if data.eval.source != data.train.source else ""
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
