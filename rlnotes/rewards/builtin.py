"""The built-in reward functions, chosen by name (REWARDS), and the checks of their configured args
before a model loads.

Each is called as every reward function is (rlnotes.rewards.scoring): by keyword, prompts=,
completions= and the dataset's columns, and returns one value per completion. A completion is
text, or [{"role": "assistant", "content": text}] for conversational data.

Light, as the check of a config that names them must be (rlnotes.commands.validate): torch and
transformers are imported by the reward that needs them, reward_model, when it is configured.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import operator
import re
import threading
import unicodedata
from collections import Counter
from fractions import Fraction
from typing import Callable, Dict, List, Optional

from rlnotes.core.checks import check_choice
from rlnotes.core.errors import ConfigError

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)



def reply_text(completion) -> str:
    """The text a built-in reward scores: the completion itself, or of a conversation its final
    reply (the messages after the last one that is not the assistant's: in a multi-turn episode,
    the model's last turn, not the tool results or observations before it)."""
    if isinstance(completion, str):
        return completion
    last = max((i for i, m in enumerate(completion) if m.get("role") != "assistant"), default=-1)
    return "".join(m["content"] for m in completion[last + 1:])

def answer_section(text: str) -> str:
    """What is inside the last <answer>...</answer> of `text`, or all of it when there is none."""
    tags = _ANSWER_TAG.findall(text)
    return tags[-1] if tags else text


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
        got, want = last_number(reply_text(completion)), _as_number(ans)
        out.append(float(got is not None and want is not None and float(got) == want))
    return out


def letter_share(prompts, completions, letter, **_) -> List[float]:
    """Share of the completion's characters that are the row's `letter` (0 for an empty one)."""
    texts = [reply_text(c) for c in completions]
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
        out.append(float(fix(reply_text(completion)) in accepted))
    return out


def format_match(prompts, completions, pattern, **_) -> List[float]:
    """1.0 when the whole completion (surrounding whitespace aside) matches the regular expression
    `pattern`, else 0.0; "." also matches newlines. DeepSeek-R1's format reward is
    pattern: '<think>.*?</think>\\s*<answer>.*?</answer>'."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.fullmatch(reply_text(c).strip()) is not None) for c in completions]


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
        lengths = [len(reply_text(c)) for c in completions]
    penalties = [slope * max(0, n - target) for n in lengths]
    return [0.0 - (p if max_penalty is None else min(p, max_penalty)) for p in penalties]


MATH_HINT = 'the math_match reward needs the math-verify package: pip install "rlnotes[math]"'


def _math_verify():
    try:
        import math_verify  # optional: pip install "rlnotes[math]"
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
        got = mv.parse(answer_section(reply_text(completion)), parsing_timeout=seconds)
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
            result, used = evaluate_arithmetic(countdown_expression(reply_text(completion)))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
            out.append(0.0)
            continue
        allowed = not Counter(used) - Counter(int(n) for n in given)
        out.append(float(bool(used) and allowed and result == int(goal)))
    return out


# (path, device, batch size) -> the reward model loaded once per process, or why it failed to load
_SCORERS: Dict[tuple, object] = {}


def reward_model(prompts, completions, path, device="cpu", batch_size=16, **_) -> List[float]:
    """r(x, y) of the reward model at `path`: the final/ dir of an algo=rm run, or a local Hugging
    Face sequence-classification model dir with one label (rlnotes.rewards.model). Loaded once on
    `device` (reward=model passes hardware.device: the training device), scored without
    gradients, `batch_size` sequences a pass."""
    from rlnotes.engine.hardware.devices import resolve_device  # optional: torch and transformers, for a reward model only
    from rlnotes.rewards.model import load_scorer  # optional: as above

    dev = resolve_device(device)
    key = (str(path), str(dev), int(batch_size))
    if key not in _SCORERS:
        try:
            _SCORERS[key] = load_scorer(path, dev, int(batch_size))
        except Exception as e:
            _SCORERS[key] = e  # each per-sample retry of the failed call would load it again: fail at once
            raise
    if isinstance(_SCORERS[key], Exception):
        raise _SCORERS[key]
    return _SCORERS[key](list(prompts), [reply_text(c) for c in completions]).tolist()


REWARDS: Dict[str, Callable] = {"number_match": number_match, "letter_share": letter_share,
                                "exact_match": exact_match, "format_match": format_match,
                                "length_penalty": length_penalty, "math_match": math_match, "countdown": countdown,
                                "reward_model": reward_model}


# ---------------------------------------------------------------------------------------------
# checks of the built-ins' args, before a model loads


def _check_format(args: dict) -> None:
    try:
        re.compile(args["pattern"])
    except re.error as e:
        raise ConfigError(f"format_match args.pattern={args['pattern']!r} is not a regular expression ({e})") from None


def _check_length(args: dict) -> None:
    check_choice("length_penalty args.unit", args.get("unit", "chars"), LENGTH_UNITS)
    if args["target"] < 0 or (args.get("slope") or 0) < 0:
        raise ConfigError(f"length_penalty args.target={args['target']} and args.slope={args.get('slope')} "
                          "must be >= 0 (the penalty grows with length beyond target)")


def _check_math(args: dict) -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise ConfigError(MATH_HINT)


def _check_model(args: dict) -> None:
    from rlnotes.rewards.model import check  # optional: torch and transformers, for a reward model only

    check(args["path"])


# Built-in args that must be set (and why), then each built-in's own checks.
REQUIRED_ARGS = {"format_match": {"pattern": "a regular expression the whole completion must match"},
                 "length_penalty": {"target": "the length that costs nothing"},
                 "reward_model": {"path": "reward=model: reward.path=RUN_DIR/final or a Hugging Face model dir"}}
ARG_CHECKS = {"format_match": _check_format, "length_penalty": _check_length, "math_match": _check_math,
              "reward_model": _check_model}


def check_builtin_args(name: str, args: dict) -> None:
    """A built-in's args: known names, required ones set, values that can work."""
    params = [p for p in list(inspect.signature(REWARDS[name]).parameters)[2:] if p != "_"]
    unknown = [a for a in args if a not in params]
    if unknown:
        raise ConfigError(f"reward function {name} has no argument {unknown[0]!r}; its arguments: {', '.join(params)}")
    for arg, meaning in REQUIRED_ARGS.get(name, {}).items():
        if args.get(arg) is None:
            raise ConfigError(f"reward function {name} needs args.{arg} ({meaning})")
    ARG_CHECKS.get(name, lambda _: None)(args)
