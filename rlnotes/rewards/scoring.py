"""Reward functions and their weighted sum.

Every reward function is called as TRL (1.16) calls it, by keyword, so a function written for
TRL works unchanged:

    fn(prompts=..., completions=..., completion_ids=..., <column>=... for every other dataset
       column, trainer_state=..., log_extra=..., log_metric=..., <its configured args>)
       -> list[float | None], one value per completion

`def reward_len(completions, **kwargs)`, `def accuracy(completions, ground_truth, **kwargs)` and
keyword-only signatures all work; a function without **kwargs gets only the names it takes. A
configured arg named like a column replaces it. `completion_ids` are each completion's sampled
token ids, EOS included (None where no tokens are known). `trainer_state` has global_step,
max_steps and epoch; `log_metric(name, value)` logs reward/<function>/<name>; `log_extra(column,
values)` adds a column to the samples table. A prompt is a string, or a list of {role, content}
messages for conversational data; a completion then comes as [{"role": "assistant", "content":
text}], as TRL passes it, and as plain text otherwise. `async def` functions are awaited, side by
side. Functions are named by built-in name, import path ('pkg.mod.fn' or 'pkg.mod:fn', found
from the working directory as `python -m` would) or file ('path/to/rewards.py:fn').

The reward of a sample is the weighted sum sum_k w_k r_k over the functions k that gave it a
number. None means "no opinion" and leaves that function out of the sum; a sample on which every
function says None gets 0, the empty sum (a warning names the first such row, once: it usually
means a column is missing). A function that raises (SystemExit included), or gives NaN, inf or a
non-number, does not stop the run: a batched call that raises is retried sample by sample, every
failing sample gets `reward.fallback` and is counted in reward/failures, and the first traceback
is shown once. A function that fails on every sample it scores in a batch, or returns other than
one value per completion, stops the run (RewardFailure). `reward.timeout_s` bounds a call (see
Rewards).
"""

from __future__ import annotations

import ast
import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import operator
import os
import re
import statistics
import sys
import threading
import time
import traceback
import unicodedata
from collections import Counter, deque
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from rich.markup import escape

# ---------------------------------------------------------------------------------------------
# completions as text


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or its messages' contents one after another."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def answer_section(text: str) -> str:
    """What is inside the last <answer>...</answer> of `text`, or all of it when there is none."""
    tags = _ANSWER_TAG.findall(text)
    return tags[-1] if tags else text


def in_prompt_format(prompt, text: str):
    """A completion shaped like its prompt: [assistant message] for a conversation, else text."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


# ---------------------------------------------------------------------------------------------
# built-in reward functions

# A number: an optional sign, digits with or without thousands commas ("1,234" but not "1,2,3"),
# optional decimals ("3.5"; the period of "is 12." is not a decimal point).
_NUMBER = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def last_number(text: str) -> Optional[str]:
    """The last number in `text` as plain digits ("1,234" -> "1234"), or None. A minus sign right
    after a letter, digit or ")" is a subtraction, not a sign: "4-3" ends in 3, "x = -3" in -3."""
    found = list(_NUMBER.finditer(text))
    if not found:
        return None
    match = found[-1]
    number = match.group()
    before = text[match.start() - 1] if match.start() else " "
    if number[0] in "-\u2212" and (before.isalnum() or before == ")"):
        number = number[1:]
    return number.replace(",", "").replace("\u2212", "-")


def _as_number(value) -> Optional[float]:
    """A dataset answer ("12", "-3", "1,234", 7) as a float, or None when it is not a number."""
    try:
        return float(str(value).strip().replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None


def number_match(prompts, completions, answer, **_) -> List[float]:
    """1.0 when the last number in the completion equals the `answer` column as a number ("3.0"
    equals "3", "1,234" equals "1234", text after the number is ignored), else 0.0."""
    out = []
    for completion, ans in zip(completions, answer):
        got, want = last_number(completion_text(completion)), _as_number(ans)
        out.append(float(got is not None and want is not None and float(got) == want))
    return out


def letter_share(prompts, completions, letter, **_) -> List[float]:
    """Share of the completion's characters that are the row's `letter` (0 for an empty one)."""
    texts = [completion_text(c) for c in completions]
    return [text.count(c) / len(text) if text else 0.0 for text, c in zip(texts, letter)]


def normalize_text(text: str) -> str:
    """Lower case, punctuation (Unicode category P) removed, whitespace runs made one space."""
    kept = "".join(ch for ch in text.lower() if not unicodedata.category(ch).startswith("P"))
    return " ".join(kept.split())


def exact_match(prompts, completions, answer, normalize=False, **_) -> List[float]:
    """1.0 when the completion equals the `answer` column (or any of a row's answers, when it is a
    list), else 0.0. Surrounding whitespace never counts; normalize=true also ignores case,
    punctuation and runs of whitespace (normalize_text: "The Cat." equals "the cat")."""
    fix = normalize_text if normalize else str.strip
    out = []
    for completion, ans in zip(completions, answer):
        accepted = {fix(str(a)) for a in (ans if isinstance(ans, (list, tuple)) else [ans])}
        out.append(float(fix(completion_text(completion)) in accepted))
    return out


def format_match(prompts, completions, pattern, **_) -> List[float]:
    """1.0 when the whole completion (surrounding whitespace aside) matches the regular expression
    `pattern`, else 0.0; "." also matches newlines. DeepSeek-R1's format reward is
    pattern: '<think>.*?</think>\\s*<answer>.*?</answer>'."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.fullmatch(completion_text(c).strip()) is not None) for c in completions]


LENGTH_UNITS = ("chars", "tokens")


def length_penalty(prompts, completions, target, slope=0.01, max_penalty=1.0, unit="chars", completion_ids=None,
                   **_) -> List[float]:
    """-min(slope * max(0, L - target), max_penalty): 0 up to `target`, then `slope` less for each
    unit of length beyond it, never below -max_penalty (null: no floor). L counts characters
    (unit=chars) or the completion's sampled tokens, EOS included (unit=tokens, from the
    completion_ids training passes). DAPO's overlong penalty (Yu et al. 2025, Eq. 13) is
    target = L_max - L_cache, slope = 1 / L_cache, max_penalty = 1."""
    if unit == "tokens":
        if completion_ids is None:
            raise ValueError("length_penalty with unit=tokens needs completion_ids, which training passes; "
                             "use unit=chars to score plain text")
        lengths = [len(ids) for ids in completion_ids]
    else:
        lengths = [len(completion_text(c)) for c in completions]
    penalties = [slope * max(0, n - target) for n in lengths]
    return [0.0 - (p if max_penalty is None else min(p, max_penalty)) for p in penalties]


MATH_HINT = 'the math_match reward needs the math-verify package: pip install "rlnotes[math]"'


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError(MATH_HINT) from None
    return math_verify


def math_match(prompts, completions, answer, timeout=5, **_) -> List[Optional[float]]:
    """1.0 when the completion's final answer equals the `answer` column mathematically, else 0.0,
    as the math-verify package decides (parse both, then verify: LaTeX, \\boxed{}, fractions,
    sets, 0.5 = \\frac{1}{2}). The `answer` column is the final answer, bare ("3\\pi", "(1, 2)",
    "x^2+1") or, when it holds $...$ or \\boxed{}, a text to parse as it stands. The completion's
    answer is read from its last <answer>...</answer> when it has one (answer_section), else from
    all of it. None (no opinion) for a row whose answer math-verify cannot parse.
    `timeout`: seconds per parse and per check, enforced on the main thread only (the library
    uses SIGALRM). An optional extra: pip install "rlnotes[math]"."""
    mv = _math_verify()
    seconds = timeout if threading.current_thread() is threading.main_thread() else None
    golds: Dict[str, list] = {}
    out: List[Optional[float]] = []
    for completion, ans in zip(completions, answer):
        key = str(ans).strip()
        if key not in golds:  # a bare answer ("3\\pi", "(1, 2)") is one expression: read it as a boxed one
            text = key if "$" in key or "\\boxed" in key else f"\\boxed{{{key}}}"
            golds[key] = mv.parse(text, parsing_timeout=seconds)
        if not golds[key]:
            out.append(None)
            continue
        got = mv.parse(answer_section(completion_text(completion)), parsing_timeout=seconds)
        out.append(float(bool(got) and mv.verify(golds[key], got, timeout_seconds=seconds)))
    return out


_ANSWER_COLON = re.compile(r"answer\s*:(.*)", re.IGNORECASE)
_OPERATOR_SPELLINGS = {"\u00d7": "*", "\u00b7": "*", "\u2217": "*", "\\times": "*", "\\cdot": "*", "\u00f7": "/",
                       "\\div": "/", "\u2212": "-", "$": "", "`": ""}
_COUNTDOWN_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_expression(text: str) -> str:
    """The expression a countdown completion proposes: inside its last <answer>...</answer>, else
    after its last "answer:" (to the end of that line), else its last non-empty line; of an
    equation, the left side ("(3+5)*2 = 16" -> "(3+5)*2"); a final period dropped."""
    tags = _ANSWER_TAG.findall(text)
    colons = _ANSWER_COLON.findall(text)
    lines = [line for line in text.splitlines() if line.strip()]
    expr = tags[-1] if tags else colons[-1] if colons else lines[-1] if lines else ""
    for spelling, op in _OPERATOR_SPELLINGS.items():
        expr = expr.replace(spelling, op)
    return expr.split("=")[0].strip().rstrip(".").strip()


def evaluate_arithmetic(expr: str) -> tuple[Fraction, List[int]]:
    """(exact value, integers used) of an expression of integers, + - * /, unary minus and
    parentheses, read with `ast` (never eval). Anything else raises ValueError; x/0 raises
    ZeroDivisionError."""
    if len(expr) > 200:
        raise ValueError("expression too long")
    used: List[int] = []

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _COUNTDOWN_OPS:
            left, right = value(node.left), value(node.right)
            return _COUNTDOWN_OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"{type(node).__name__} is not allowed in an arithmetic expression")

    return value(ast.parse(expr, mode="eval").body), used


def countdown(prompts, completions, numbers, target, **_) -> List[float]:
    """1.0 when the completion's expression (countdown_expression) uses only the row's `numbers`,
    each at most as often as it is given, and equals `target` exactly; else 0.0 (also for an
    expression that does not parse or divides by zero)."""
    out = []
    for completion, given, goal in zip(completions, numbers, target):
        try:
            result, used = evaluate_arithmetic(countdown_expression(completion_text(completion)))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
            out.append(0.0)
            continue
        allowed = not Counter(used) - Counter(int(n) for n in given)
        out.append(float(bool(used) and allowed and result == int(goal)))
    return out


_SCORERS: Dict[tuple, Callable] = {}   # (path, device, batch size) -> loaded reward model, once per process


def reward_model(prompts, completions, path, device="cpu", batch_size=16, **_) -> List[float]:
    """r(x, y) of the reward model at `path`: the final/ dir of an algo=rm run, or a local Hugging
    Face sequence-classification model dir with one label (rlnotes.rewards.model). Loaded once on
    `device` (reward=model passes hardware.device: the training device), scored without
    gradients, `batch_size` sequences a pass."""
    from rlnotes.engine.models import resolve_device
    from rlnotes.rewards.model import load_scorer

    dev = resolve_device(device)
    key = (str(path), str(dev), int(batch_size))
    if key not in _SCORERS:
        _SCORERS[key] = load_scorer(path, dev, int(batch_size))
    return _SCORERS[key](list(prompts), [completion_text(c) for c in completions]).tolist()


REWARDS: Dict[str, Callable] = {"number_match": number_match, "letter_share": letter_share,
                                "exact_match": exact_match, "format_match": format_match,
                                "length_penalty": length_penalty, "math_match": math_match, "countdown": countdown,
                                "reward_model": reward_model}


# ---------------------------------------------------------------------------------------------
# checks of the built-ins' args, before a model loads


def _check_format(args: dict) -> None:
    from rlnotes.core.errors import ConfigError

    try:
        re.compile(args["pattern"])
    except re.error as e:
        raise ConfigError(f"format_match args.pattern={args['pattern']!r} is not a regular expression ({e})") from None


def _check_length(args: dict) -> None:
    from rlnotes.core.checks import check_choice
    from rlnotes.core.errors import ConfigError

    check_choice("length_penalty args.unit", args.get("unit", "chars"), LENGTH_UNITS)
    if args["target"] < 0 or (args.get("slope") or 0) < 0:
        raise ConfigError(f"length_penalty args.target={args['target']} and args.slope={args.get('slope')} "
                          "must be >= 0 (the penalty grows with length beyond target)")


def _check_math(args: dict) -> None:
    from rlnotes.core.errors import ConfigError

    if importlib.util.find_spec("math_verify") is None:
        raise ConfigError(MATH_HINT)


def _check_model(args: dict) -> None:
    from rlnotes.rewards.model import kind

    kind(args["path"])


# Built-in args that must be set (and why), then each built-in's own checks.
REQUIRED_ARGS = {"format_match": {"pattern": "a regular expression the whole completion must match"},
                 "length_penalty": {"target": "the length that costs nothing"},
                 "reward_model": {"path": "reward=model: reward.path=RUN_DIR/final or a Hugging Face model dir"}}
ARG_CHECKS = {"format_match": _check_format, "length_penalty": _check_length, "math_match": _check_math,
              "reward_model": _check_model}


def check_builtin_args(name: str, args: dict) -> None:
    """A built-in's args: known names, required ones set, values that can work."""
    from rlnotes.core.errors import ConfigError

    params = [p for p in list(inspect.signature(REWARDS[name]).parameters)[2:] if p != "_"]
    unknown = [a for a in args if a not in params]
    if unknown:
        raise ConfigError(f"reward function {name} has no argument {unknown[0]!r}; its arguments: {', '.join(params)}")
    for arg, meaning in REQUIRED_ARGS.get(name, {}).items():
        if args.get(arg) is None:
            raise ConfigError(f"reward function {name} needs args.{arg} ({meaning})")
    ARG_CHECKS.get(name, lambda _: None)(args)


# ---------------------------------------------------------------------------------------------
# the configured functions


def _import_file(path: str, target: str):
    """The module in file `path` (relative to the working directory), its folder on sys.path (as
    `python path/to/rewards.py` would have it) so that it can import its neighbours."""
    from rlnotes.core.errors import ConfigError

    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"reward function {target!r}: no file {path} (paths are relative to {os.getcwd()})")
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve() == file:
        return loaded
    if loaded is not None:  # another module has that name: keep both
        name = f"{name}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(name: str):
    """`importlib.import_module(name)`, also from the working directory as `python -m` would find
    it: when the module is not found, the working directory joins the end of sys.path (so an
    installed package of the same name still wins) and the import is tried again."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if not (e.name and name.startswith(e.name)) or any(os.path.abspath(p or ".") == cwd for p in sys.path):
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(name)


def _split_target(name: str) -> tuple[str, str]:
    """(module or file, attribute) of 'pkg.mod:fn', 'path/to/rewards.py:fn' or 'pkg.mod.fn'."""
    where, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    return where, attr


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def resolve(name: str) -> Callable:
    """A built-in reward by name, or a user's function: 'pkg.module.fn' or 'pkg.module:fn' (found
    as `python -m` finds modules: installed, on PYTHONPATH, or in the working directory) or
    'path/to/rewards.py:fn' (a file)."""
    from rlnotes.core.errors import ConfigError

    if name in REWARDS:
        return REWARDS[name]
    where, attr = _split_target(name)
    if not where or not attr:
        raise ConfigError(f"reward function {name!r} is not built in ({', '.join(REWARDS)}) "
                          "and not an import path like mypkg.rewards.my_fn or a file like path/to/rewards.py:my_fn")
    try:
        fn = _import_file(where, name) if _is_file(where) else _import_module(where)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's module may raise anything while it loads
        hint = ("put its module in the directory you run rlnotes from, install it, or name its file: "
                "path/to/rewards.py:my_fn" if isinstance(e, ModuleNotFoundError)
                else "check the name" if isinstance(e, AttributeError) else "its module failed to load")
        raise ConfigError(f"reward function {name!r} could not be imported ({_first_line(e)}); {hint}") from None
    if not callable(fn):
        raise ConfigError(f"reward function {name!r} is not callable")
    return fn


# The keyword arguments every reward function is called with besides the dataset's columns and
# its configured args, as TRL (1.16) calls them.
CALL_NAMES = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def accepted_names(fn) -> Optional[frozenset]:
    """The keyword arguments `fn` can take; None when it takes any (**kwargs, or a signature that
    cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in kinds)


def check_signature(name: str, fn) -> None:
    """A reward function is called by keyword only: a required positional-only parameter (before
    '/') can never be given. (Required parameters that no column fills are found when the data
    is read: rlnotes.data.datasets.reward_columns.)"""
    from rlnotes.core.errors import ConfigError

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    for p in params:
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty:
            raise ConfigError(f"reward function {name!r} takes {p.name!r} positional-only (before '/'), but reward "
                              "functions are called by keyword (prompts=..., completions=..., <column>=...); "
                              "remove the '/'")


def is_async(fn) -> bool:
    """Whether calling `fn` gives a coroutine to await (`async def`, also as a callable object)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def function_specs(cfg) -> List[tuple[str, float, dict, Optional[str]]]:
    """(fn, weight, args, name) of every configured function; `reward.target` adds one of weight 1."""
    from rlnotes.core.errors import ConfigError

    if cfg.name == "custom" and not cfg.target:
        raise ConfigError("reward=custom needs the import path of your function: reward.target=mypkg.rewards.my_fn")
    specs = [(f.fn, float(f.weight), _plain(f.args), f.get("name")) for f in cfg.functions]
    specs += [(cfg.target, 1.0, {}, None)] if cfg.target else []
    if not specs:
        raise ConfigError("no reward function is configured; pick a built-in (reward=arith, reward=letters) or "
                          "name yours: reward=custom reward.target=mypkg.rewards.my_fn")
    return specs


def _plain(args) -> dict:
    return OmegaConf.to_container(args, resolve=True) if isinstance(args, DictConfig) else dict(args)


# Metrics the runners write under reward/; no function's metric may take these names.
RESERVED = ("mean", "std", "zero_std_frac", "failures", "baseline", "resample_rounds")


def _name_parts(fn: str) -> List[str]:
    """The parts of a function's path that can name it: 'a.b:c' and 'path/to/b.py:c' as 'b.c' would."""
    where, attr = _split_target(fn)
    module = Path(where).stem if _is_file(where) else where
    return [p for p in module.split(".") + attr.split(".") if p]


def metric_names(fns: Sequence[str], names: Sequence[Optional[str]]) -> List[str]:
    """Each function's metric name (reward/<name>): its configured `name`, else the last part of
    its import path, lengthened part by part while another function's name is the same ("a.score"
    and "b.score" rather than "score" twice); the same function twice gets "_2", "_3", ...
    Names the runners use under reward/ (RESERVED) are never taken."""
    from rlnotes.core.errors import ConfigError

    given = [n for n in names if n]
    for n in given:
        if n in RESERVED or given.count(n) > 1:
            why = "a metric the runners write" if n in RESERVED else "given to two functions"
            raise ConfigError(f"reward function name {n!r} is {why}; choose another name")
    parts = [_name_parts(fn) for fn in fns]
    depth = [1] * len(fns)

    def clashes(i: int, labels: List[str]) -> bool:
        """Whether a longer label could set function i apart: its label is reserved or shared with
        a given name or another function."""
        return labels[i] in RESERVED or any(labels[j] == labels[i] and (names[j] or fns[j] != fns[i])
                                            for j in range(len(fns)) if j != i)

    while True:
        labels = [names[i] or ".".join(parts[i][-depth[i]:]) for i in range(len(fns))]
        grow = [i for i in range(len(fns)) if not names[i] and depth[i] < len(parts[i]) and clashes(i, labels)]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    taken, out = set(given) | set(RESERVED), list(labels)
    for i, label in enumerate(labels):
        if not names[i]:
            name, k = label, 2
            while name in taken:
                name, k = f"{label}_{k}", k + 1
            taken.add(name)
            out[i] = name
    return out


@dataclass
class RewardFn:
    name: str        # its metric: reward/<name>
    fn: Callable
    weight: float
    args: dict
    accepts: Optional[frozenset] = None   # the keywords fn takes; None: any (it has **kwargs)
    awaited: bool = False                  # an async function: its calls are awaited, side by side


def build(cfg) -> List[RewardFn]:
    """The configured functions, resolved, named, their signatures and built-in args checked."""
    specs = function_specs(cfg)
    names = metric_names([s[0] for s in specs], [s[3] for s in specs])
    fns = []
    for (path, weight, args, _), name in zip(specs, names):
        if path in REWARDS:
            check_builtin_args(path, args)
        fn = resolve(path)
        check_signature(path, fn)
        fns.append(RewardFn(name, fn, weight, args, accepted_names(fn), is_async(fn)))
    return fns


def check_reward_config(cfg) -> None:
    from rlnotes.core.errors import ConfigError

    if cfg.timeout_s is not None and not cfg.timeout_s > 0:
        raise ConfigError(f"reward.timeout_s={cfg.timeout_s} must be > 0 (seconds a call may take; null: no limit)")
    build(cfg)


# ---------------------------------------------------------------------------------------------
# the weighted sum


class RewardFailure(RuntimeError):
    """A reward function broke its contract (a wrong number of values), gave no usable value for
    any sample of a batch, or timed out on several calls in a row: the run cannot learn."""


@dataclass
class TrainerState:
    """The `trainer_state` a reward function gets (the fields of TRL's TrainerState that reward
    shaping reads): optimizer steps taken, the run's trainer.steps, and epochs of the training
    rows sampled so far."""
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


# Columns of the samples table a reward function's log_extra cannot take.
SAMPLE_FIELDS = ("step", "prompt", "completion", "reward")
# Calls of a function whose times make its usual time (the median) for the slow-call warning;
# a call warns when it takes SLOW_FACTOR times that and at least SLOW_MIN_S seconds.
SLOW_WINDOW, SLOW_FACTOR, SLOW_MIN_S = 20, 10.0, 1.0
# A function that times out on this many calls in a row stops the run.
TIMEOUTS_IN_A_ROW = 3


@dataclass
class _Outcome:
    """What one call of a reward function gave: its result or the exception it raised, and its time."""
    result: object = None
    error: Optional[BaseException] = None
    seconds: float = 0.0
    timed_out: bool = False


class _Log:
    """What the functions of one scoring call log: extra samples-table columns (log_extra) and
    scalars (log_metric), the latter as reward/<function>/<name>."""

    def __init__(self, n: int):
        self.n = n
        self.columns: Dict[str, list] = {}
        self.metrics: Dict[str, List[float]] = {}

    def extra(self, offset: int, count: int) -> Callable[[str, list], None]:
        """log_extra for a call on samples offset..offset+count (a per-sample retry scores one)."""
        def log_extra(column: str, values) -> None:
            values = list(values)
            if len(values) != count:
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {count} completions")
            if column in SAMPLE_FIELDS:
                raise ValueError(f"log_extra({column!r}, ...): {column!r} is a column of the samples table already")
            self.columns.setdefault(column, [None] * self.n)[offset:offset + count] = values
        return log_extra

    def metric(self, fn_name: str) -> Callable[[str, float], None]:
        def log_metric(name: str, value: float) -> None:
            self.metrics.setdefault(f"reward/{fn_name}/{name}", []).append(float(value))
        return log_metric


def _own_copy(value):
    """A deep copy of `value`, quick for the common lists of strings and numbers."""
    if isinstance(value, list):
        return [v if isinstance(v, (str, int, float, type(None))) else _own_copy(v) for v in value]
    return copy.deepcopy(value)


def _number(value) -> Optional[float]:
    """`value` as a finite float; None for NaN, inf, a string, a list or anything else."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _brief(value, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 1] + "…"


class Rewards:
    """The weighted sum of the configured reward functions, robust to a function that fails.

    Each function is called by keyword, as TRL calls it: prompts=, completions=, completion_ids=,
    one keyword per dataset column, trainer_state= (a TrainerState; set `state` before a call),
    log_extra=, log_metric=, then its configured args (a function without **kwargs gets only
    the names it takes). Each call gets its own deep copies of these inputs, so a function that
    edits them changes nothing another function or the samples table sees. Sync functions run one
    after another, then the async ones are awaited together (asyncio.gather) on one event loop
    that the Rewards keeps (run in the calling thread).

    `reward.timeout_s` bounds each call. A sync function then runs in a worker thread that is
    abandoned at the time-out: Python cannot stop a thread, so it runs on in the background until
    it returns (its result dropped), and may overlap with the next call of the same function. An
    async function is cancelled at its next await; one that blocks without awaiting holds up the
    others until it returns. A call past the time-out gives every one of its samples the fallback
    and is not retried; TIMEOUTS_IN_A_ROW such calls in a row stop the run.
    """

    def __init__(self, cfg, console=None):
        self.fns = build(cfg)
        self.fallback = float(cfg.fallback)
        self.timeout = cfg.timeout_s
        self.console = console
        self.state = TrainerState()
        # The samples-table columns the functions logged with log_extra in the last call.
        self.extra: Dict[str, list] = {}
        self._said: set = set()
        self._times: Dict[str, deque] = {rf.name: deque(maxlen=SLOW_WINDOW) for rf in self.fns}
        self._timeouts: Dict[str, int] = {rf.name: 0 for rf in self.fns}
        self._loop: Optional[asyncio.AbstractEventLoop] = None   # runs the async functions

    def _once(self, key: str, message: str) -> None:
        """Print `message` the first time `key` comes up in this run."""
        if key not in self._said and self.console is not None:
            self.console.print(message)
        self._said.add(key)

    # -- calling ---------------------------------------------------------------------------------

    def _kwargs(self, rf: RewardFn, inputs: dict, log: _Log, offset: int) -> dict:
        """rf's own copies of its keyword arguments for a call on samples offset.. of the batch."""
        n = len(inputs["completions"])
        kwargs = {**{k: _own_copy(v) for k, v in inputs.items()}, "trainer_state": replace(self.state),
                  "log_extra": log.extra(offset, n), "log_metric": log.metric(rf.name), **_own_copy(rf.args)}
        return kwargs if rf.accepts is None else {k: v for k, v in kwargs.items() if k in rf.accepts}

    def _call_sync(self, rf: RewardFn, kwargs: dict) -> _Outcome:
        start = time.perf_counter()
        if self.timeout is None:
            try:
                return _Outcome(rf.fn(**kwargs), seconds=time.perf_counter() - start)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's function may raise anything
                return _Outcome(error=e, seconds=time.perf_counter() - start)
        box: Dict[str, object] = {}

        def work() -> None:
            try:
                box["result"] = rf.fn(**kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e

        worker = threading.Thread(target=work, name=f"reward {rf.name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        seconds = time.perf_counter() - start
        if worker.is_alive():
            return _Outcome(seconds=seconds, timed_out=True)
        if isinstance(box.get("error"), KeyboardInterrupt):
            raise box["error"]
        return _Outcome(box.get("result"), box.get("error"), seconds)

    async def _call_async(self, rf: RewardFn, kwargs: dict) -> _Outcome:
        start = time.perf_counter()
        task = asyncio.ensure_future(rf.fn(**kwargs))
        done, _ = await asyncio.wait({task}, timeout=self.timeout)
        seconds = time.perf_counter() - start
        if not done:
            task.cancel()
            return _Outcome(seconds=seconds, timed_out=True)
        try:
            return _Outcome(task.result(), seconds=seconds)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's function may raise anything
            return _Outcome(error=e, seconds=seconds)

    def _outcomes(self, fns: Sequence[RewardFn], inputs: dict, log: _Log, offset: int = 0) -> List[_Outcome]:
        """One call of each of `fns` on `inputs`: the sync ones in turn, then the async ones together."""
        out: Dict[int, _Outcome] = {}
        for i, rf in enumerate(fns):
            if not rf.awaited:
                out[i] = self._call_sync(rf, self._kwargs(rf, inputs, log, offset))
        awaited = [i for i, rf in enumerate(fns) if rf.awaited]
        if awaited:
            async def together():
                return await asyncio.gather(*[self._call_async(fns[i], self._kwargs(fns[i], inputs, log, offset))
                                              for i in awaited])
            # One loop for the whole run, as TRL keeps: an async client a function made on its first
            # call (an HTTP session, a rate limiter) stays bound to a loop that is still open.
            self._loop = self._loop or asyncio.new_event_loop()
            out.update(zip(awaited, self._loop.run_until_complete(together())))
        return [out[i] for i in range(len(fns))]

    # -- checking what came back -------------------------------------------------------------

    @staticmethod
    def _values(rf: RewardFn, result, n: int) -> list:
        """The list a call returned; anything but one value per completion breaks the contract."""
        try:
            values = list(result)
        except TypeError:
            raise RewardFailure(f"reward function {rf.name!r} returned {type(result).__name__}, not a list of one "
                                f"value (a number or None) per completion") from None
        if len(values) != n:
            raise RewardFailure(f"reward function {rf.name!r} returned {len(values)} values for {n} completions; "
                                "it must return one value (a number or None) per completion")
        return values

    def _sample(self, rf: RewardFn, inputs: dict, log: _Log, i: int):
        """rf's value for sample i alone; NaN when it raises or times out."""
        one = {k: v[i:i + 1] if v is not None else None for k, v in inputs.items()}
        (outcome,) = self._outcomes([rf], one, log, offset=i)
        if outcome.error is not None or outcome.timed_out:
            return float("nan")
        return self._values(rf, outcome.result, 1)[0]

    def _watch_time(self, rf: RewardFn, seconds: float) -> None:
        """Warn (once per function) about a call far slower than the function's usual calls."""
        times = self._times[rf.name]
        if len(times) >= 3:
            usual = statistics.median(times)
            if seconds > SLOW_FACTOR * usual and seconds > SLOW_MIN_S:
                self._once(f"slow:{rf.name}", f"[yellow]reward function {rf.name!r} took {seconds:.1f} s on this "
                                              f"batch, {seconds / max(usual, 1e-9):.0f}x its usual {usual:.2g} s; "
                                              "reward.timeout_s=SECONDS bounds a call[/]")
        times.append(seconds)

    def _settle(self, rf: RewardFn, outcome: _Outcome, inputs: dict, log: _Log) -> tuple[List[Optional[float]], int]:
        """One number or None per sample, failing samples replaced by the fallback, and their count."""
        n = len(inputs["completions"])
        if outcome.timed_out:
            self._timeouts[rf.name] += 1
            if self._timeouts[rf.name] >= TIMEOUTS_IN_A_ROW:
                raise RewardFailure(f"reward function {rf.name!r} took longer than reward.timeout_s={self.timeout} "
                                    f"s on {TIMEOUTS_IN_A_ROW} calls in a row; make it faster or raise the limit")
            self._once(f"timeout:{rf.name}", f"[yellow]reward function {rf.name!r} took longer than "
                                             f"reward.timeout_s={self.timeout} s; its {n} samples get "
                                             f"{self.fallback}[/]")
            return [self.fallback] * n, n
        self._timeouts[rf.name] = 0
        self._watch_time(rf, outcome.seconds)
        error = None
        if outcome.error is None:
            values = self._values(rf, outcome.result, n)
        else:
            error = _first_line(outcome.error)
            trace = "".join(traceback.format_exception(outcome.error))
            self._once("traceback", f"[yellow]reward function {rf.name!r} raised; retrying sample by sample "
                                    f"(failures get {self.fallback}). First traceback:[/]\n{trace}")
            values = [self._sample(rf, inputs, log, i) for i in range(n)]
        failed = [v for v in values if v is not None and _number(v) is None]
        if failed and len(failed) == sum(v is not None for v in values):
            why = error or f"it returned {failed[0]!r}"
            raise RewardFailure(f"reward function {rf.name!r} gave no finite number for any sample of the batch "
                                f"({why}); fix it or remove it from reward.functions")
        if failed and error is None:
            self._once(f"bad:{rf.name}", f"[yellow]reward function {rf.name!r} returned {failed[0]!r} for "
                                         f"{len(failed)} samples; they get {self.fallback}[/]")
        return [None if v is None else (self.fallback if _number(v) is None else _number(v)) for v in values], \
            len(failed)

    # -- scoring -------------------------------------------------------------------------------

    def score_groups(self, rows: Sequence[dict], completions: Sequence[str],
                     completion_ids: Optional[Sequence[Sequence[int]]] = None,
                     group_size: int = 1) -> tuple[torch.Tensor, Dict[str, float]]:
        """Rewards and metrics of `group_size` completions per row, each row's next to each other: the
        row's prompt and other columns are repeated for each of its completions."""
        prompts = [r["prompt"] for r in rows for _ in range(group_size)]
        columns = {k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
        return self(prompts, completions, columns, completion_ids=completion_ids)

    def __call__(self, prompts: Sequence, completions: Sequence[str], columns: Dict[str, list],
                 completion_ids: Optional[Sequence[Sequence[int]]] = None) -> tuple[torch.Tensor, Dict[str, float]]:
        """Total rewards [N] of the text `completions` and metrics: reward/<name> (the mean of each
        function over the samples it scored), reward/failures (samples that got the fallback) and
        the functions' own log_metric scalars, reward/<name>/<metric> (their mean over the call).
        The columns the functions logged with log_extra are in `self.extra` afterwards."""
        prompts = list(prompts)
        shaped = [in_prompt_format(p, c) for p, c in zip(prompts, completions)]
        ids = [list(i) for i in completion_ids] if completion_ids is not None else None
        inputs = {**columns, "prompts": prompts, "completions": shaped, "completion_ids": ids}
        log = _Log(len(shaped))
        totals, scored = [0.0] * len(shaped), [0] * len(shaped)
        metrics: Dict[str, float] = {}
        failures = 0
        for rf, outcome in zip(self.fns, self._outcomes(self.fns, inputs, log)):
            values, failed = self._settle(rf, outcome, inputs, log)
            failures += failed
            for i, v in enumerate(values):
                if v is not None:
                    totals[i] += rf.weight * v
                    scored[i] += 1
            given = [v for v in values if v is not None]
            metrics[f"reward/{rf.name}"] = sum(given) / len(given) if given else float("nan")
        if 0 in scored:
            self._warn_unscored(scored, prompts, shaped, columns)
        metrics["reward/failures"] = failures
        metrics.update({name: sum(v) / len(v) for name, v in log.metrics.items()})
        self.extra = log.columns
        return torch.tensor(totals), metrics

    def _warn_unscored(self, scored: List[int], prompts: list, completions: list, columns: Dict[str, list]) -> None:
        """Once a run: the samples no function scored, and the first of them with its row."""
        i = scored.index(0)
        row = ", ".join(f"{k}={_brief(v[i], 40)}" for k, v in columns.items())
        self._once("unscored", f"[yellow]every reward function said None (no opinion) for {scored.count(0)} of "
                               f"{len(scored)} samples; they get 0. The first is sample {i}: prompt "
                               f"{escape(_brief(prompts[i]))}, completion {escape(_brief(completions[i]))}"
                               + (f", {escape(row)}" if row else "") + ". Check the columns your functions read.[/]")
