"""Reward functions, their checks and names, the weighted sum that survives a failing function,
conversational completions, and reward models (a Hugging Face dir and an algo=rm run)."""

import asyncio
import importlib
import json
import math
import re
import sys
import textwrap
import time
import types
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import RewardConfig, RewardFnConfig
from rlnotes.rewards.builtin import (
    check_builtin_args,
    countdown,
    countdown_expression,
    evaluate_arithmetic,
    exact_match,
    format_match,
    last_number,
    length_penalty,
    letter_share,
    math_match,
    normalize_text,
    number_match,
)
from rlnotes.rewards.loading import (
    check_reward_config,
    function_specs,
    metric_names,
    resolve,
)
from rlnotes.rewards.scoring import RewardFailure, Rewards

THINK = r"<think>.*?</think>\s*<answer>.*?</answer>"

# --------------------------------------------------------------------------------------------- number_match


@pytest.mark.parametrize("completion, answer, score", [
    ("7", "7", 1.0),
    ("-3", "-3", 1.0),
    ("The answer is -3.", "-3", 1.0),
    ("x = -3", "-3", 1.0),
    ("\u22123", "-3", 1.0),            # a Unicode minus sign
    ("3", "-3", 0.0),
    ("-3", "3", 0.0),
    ("4-3", "1", 0.0),                 # the last number is 3: the minus is a subtraction
    ("4-3", "3", 1.0),
    ("1,234", "1234", 1.0),
    ("It is 1,234.", "1234", 1.0),
    ("1,234", "1,234", 1.0),           # commas in the answer column too
    ("1,234,567 stars", "1234567", 1.0),
    ("1,2,3", "3", 1.0),               # a list, not a thousands separator
    ("1,2,3", "123", 0.0),
    ("The answer is 12.", "12", 1.0),
    ("12 apples, I think", "12", 1.0),
    ("4 + 3 = 7", "7", 1.0),
    ("4 + 3 = 7", "4", 0.0),
    ("no number here", "7", 0.0),
    ("", "7", 0.0),
    ("3.0", "3", 1.0),
    ("3", "3.0", 1.0),
    ("7.5", "7", 0.0),
    ("0.5", "0.50", 1.0),
    ("1,234.5 kg", "1234.5", 1.0),
    ("7", "seven", 0.0),
    ("7", 7, 1.0),                     # an int column
])
def test_number_match(completion, answer, score):
    assert number_match(["q"], [completion], answer=[answer]) == [score]


def test_number_match_is_per_sample_and_ignores_other_columns():
    assert number_match(["a", "b", "c"], ["1", "x 2", "3"], answer=["1", "2", "4"], letter=["z"] * 3) == [1.0, 1.0, 0.0]


def test_the_built_in_functions_are_importable_from_rlnotes_rewards():
    """`from rlnotes.rewards import number_match` (and every other built-in) works for users' code."""
    import rlnotes.rewards
    from rlnotes.rewards.builtin import REWARDS

    assert rlnotes.rewards.REWARDS is REWARDS
    assert {name: getattr(rlnotes.rewards, name, None) for name in REWARDS} == REWARDS
    assert rlnotes.rewards.number_match(["p"], ["it is 3"], ["3"]) == [1.0]


def test_last_number():
    assert last_number("from 3 to 1,000,000.") == "1000000"
    assert last_number("(2)-5") == "5"
    assert last_number("none") is None


# --------------------------------------------------------------------------------------------- letter_share


@pytest.mark.parametrize("completion, letter, share", [
    ("aaa", "a", 1.0),
    ("abab", "a", 0.5),
    ("a a", "a", 2 / 3),
    ("AAA", "a", 0.0),
    ("bcd", "a", 0.0),
    ("", "a", 0.0),
    ("xxxxb", "b", 0.2),
])
def test_letter_share(completion, letter, share):
    assert letter_share(["q"], [completion], letter=[letter]) == [pytest.approx(share)]


# --------------------------------------------------------------------------------------------- exact_match


@pytest.mark.parametrize("completion, answer, normalize, score", [
    ("Paris", "Paris", False, 1.0),
    ("  Paris\n", "Paris", False, 1.0),       # surrounding whitespace never counts
    ("paris", "Paris", False, 0.0),
    ("Paris.", "Paris", False, 0.0),
    ("paris", "Paris", True, 1.0),
    ("Paris!", "paris", True, 1.0),
    ("The  Eiffel\ttower.", "the eiffel tower", True, 1.0),
    ("New-York", "new york", True, 0.0),      # punctuation is removed, not made a space
    ("Paris, France", "Paris", True, 0.0),
    ("", "Paris", True, 0.0),
    ("Lyon", ["Paris", "Lyon"], False, 1.0),  # a row may accept several answers
    ("Nice", ["Paris", "Lyon"], False, 0.0),
])
def test_exact_match(completion, answer, normalize, score):
    assert exact_match(["q"], [completion], answer=[answer], normalize=normalize) == [score]


def test_normalize_text():
    assert normalize_text("  Hello,   WORLD!\n") == "hello world"
    assert normalize_text("\u00abQuoted\u00bb \u2014 text") == "quoted text"


# --------------------------------------------------------------------------------------------- format_match


@pytest.mark.parametrize("completion, score", [
    ("<think>3+4 is 7</think><answer>7</answer>", 1.0),
    ("<think>line one\nline two</think>\n\n<answer>7</answer>\n", 1.0),   # newlines inside and between
    ("<think></think><answer></answer>", 1.0),
    ("Sure! <think>x</think><answer>7</answer>", 0.0),                  # text before: not the whole completion
    ("<think>x</think><answer>7</answer> done", 0.0),
    ("<think>x</think>", 0.0),
    ("<answer>7</answer>", 0.0),
    ("7", 0.0),
])
def test_format_match_think_answer(completion, score):
    assert format_match(["q"], [completion], pattern=THINK) == [score]


def test_format_match_pattern_is_anchored_at_both_ends():
    assert format_match(["q"] * 2, ["The answer is 7", "answer 7"], pattern=r".*answer is \d+") == [1.0, 0.0]


# --------------------------------------------------------------------------------------------- length_penalty


def test_length_penalty_in_characters():
    texts = ["a" * 5, "a" * 10, "a" * 12, "a" * 30, "a" * 500]
    # 0 up to target=10, then -0.05 per character, floored at -1
    assert length_penalty(["q"] * 5, texts, target=10, slope=0.05) == pytest.approx([0, 0, -0.1, -1.0, -1.0])
    assert length_penalty(["q"] * 5, texts, target=10, slope=0.05, max_penalty=None) == \
        pytest.approx([0, 0, -0.1, -1.0, -24.5])


def test_length_penalty_dapo_overlong_shape():
    # L_max = 20, L_cache = 4: free up to 16 tokens, -1 at 20 and beyond (DAPO Eq. 13).
    ids = [[1] * n for n in (16, 17, 18, 20, 25)]
    values = length_penalty(["q"] * 5, ["x"] * 5, target=16, slope=1 / 4, unit="tokens", completion_ids=ids)
    assert values == pytest.approx([0, -0.25, -0.5, -1.0, -1.0])


def test_length_penalty_in_tokens_needs_completion_ids():
    with pytest.raises(ValueError, match="completion_ids"):
        length_penalty(["q"], ["abc"], target=1, unit="tokens")


# --------------------------------------------------------------------------------------------- math_match


@pytest.mark.parametrize("completion, answer, score", [
    (r"So the answer is $\boxed{\frac{2}{4}}$.", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", r"$\frac{1}{2}$", 1.0),
    (r"\boxed{1+x^2}", "x^2+1", 1.0),           # a bare answer column is read as math
    (r"First 8. Final answer: \boxed{7}. Then 9", "7", 1.0),
    ("<think>2+2=4, then 5</think><answer>7</answer>", "7", 1.0),   # the <answer> section, not the thinking
    ("<think>it is 7</think><answer>5</answer>", "7", 0.0),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),
    (r"\boxed{1.41}", r"\sqrt{2}", 0.0),
    (r"\boxed{\{2, 1\}}", r"$\{1, 2\}$", 1.0),
    (r"It is $3\pi$.", r"3\pi", 1.0),              # bare answers are read whole, not as their first number
    (r"\boxed{3}", r"3\pi", 0.0),
    (r"\boxed{(1, 2)}", "(1, 2)", 1.0),
    (r"\boxed{2}", "(1, 2)", 0.0),
    (r"The solution: $x = \frac{1}{2}$, so \boxed{\frac{1}{2}}", r"We get $\boxed{0.5}$.", 1.0),
    ("I do not know", "7", 0.0),
    ("", "7", 0.0),
])
def test_math_match(completion, answer, score):
    pytest.importorskip("math_verify")
    assert math_match(["q"], [completion], answer=[answer]) == [score]


def test_math_match_has_no_opinion_on_an_answer_it_cannot_parse():
    pytest.importorskip("math_verify")
    assert math_match(["q"] * 3, ["7", "7", "7"], answer=["", "}{", "7"]) == [None, None, 1.0]


def test_math_match_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)   # import math_verify now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "rlnotes\[math\]"'):
        math_match(["q"], ["7"], answer=["7"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r'rlnotes\[math\]'):
        check_builtin_args("math_match", {})


# --------------------------------------------------------------------------------------------- countdown


@pytest.mark.parametrize("completion, numbers, target, score", [
    ("<answer>(3 + 5) * 2</answer>", [3, 5, 2], 16, 1.0),
    ("<answer>(3+5)*2</answer>", [2, 3, 5, 7], 16, 1.0),          # not every number has to be used
    ("Let me think.\nAnswer: (3 + 5) * 2", [3, 5, 2], 16, 1.0),
    ("Trying things\n(3 + 5) * 2 = 16", [3, 5, 2], 16, 1.0),       # last line, the left side of '='
    ("(3 + 5) \u00d7 2.", [3, 5, 2], 16, 1.0),                     # x sign, final period
    ("<answer>(8 / 3) * 6</answer>", [8, 3, 6], 16, 1.0),          # exact: no float rounding
    ("<answer>-(3 - 5) * 8</answer>", [3, 5, 8], 16, 1.0),
    ("<answer>(3 + 5) * 2</answer>", [3, 5, 2], 17, 0.0),          # wrong value
    ("<answer>8 * 2</answer>", [3, 5, 2], 16, 0.0),                # 8 is not given
    ("<answer>(3 + 5) * 2 * 1</answer>", [3, 5, 2], 16, 0.0),
    ("<answer>4 * 4</answer>", [4, 3], 16, 0.0),                   # 4 used twice, given once
    ("<answer>4 * 4</answer>", [4, 4], 16, 1.0),                   # given twice
    ("<answer>16</answer>", [16, 1], 16, 1.0),
    ("<answer>2 ** 4</answer>", [2, 4], 16, 0.0),                  # only + - * /
    ("<answer>16.0</answer>", [16], 16, 0.0),                      # integers only
    ("<answer>5 / (3 - 3) + 16</answer>", [5, 3, 3, 16], 16, 0.0),  # division by zero
    ("<answer>__import__('os').getcwd()</answer>", [1], 16, 0.0),
    ("<answer>(3 + 5</answer>", [3, 5], 8, 0.0),
    ("", [3, 5], 8, 0.0),
    ("<answer>" + "(" * 500 + "1" + ")" * 500 + "</answer>", [1], 1, 0.0),
])
def test_countdown(completion, numbers, target, score):
    assert countdown(["q"], [completion], numbers=[numbers], target=[target]) == [score]


def test_countdown_expression_sources():
    assert countdown_expression("<answer>1+2</answer> then answer: 3+4") == "1+2"   # tags first
    assert countdown_expression("x\nThe answer: 3*4 = 12\nthanks") == "3*4"
    assert countdown_expression("first\n\n 5 - 1 \n\n") == "5 - 1"


def test_evaluate_arithmetic():
    assert evaluate_arithmetic("(8 / 3) * 6") == (Fraction(16), [8, 3, 6])
    assert evaluate_arithmetic("-2 - -3") == (Fraction(1), [2, 3])
    with pytest.raises(ValueError):
        evaluate_arithmetic("a + 1")


# --------------------------------------------------------------------------------------------- built-in args


@pytest.mark.parametrize("name, args, message", [
    ("exact_match", {"normalise": True}, "no argument 'normalise'; its arguments: answer, normalize"),
    ("format_match", {}, "needs args.pattern"),
    ("format_match", {"pattern": "(unclosed"}, "not a regular expression"),
    ("length_penalty", {"slope": 0.1}, "needs args.target"),
    ("length_penalty", {"target": 10, "unit": "words"}, "choose one of: chars, tokens"),
    ("length_penalty", {"target": 10, "slope": -1}, "must be >= 0"),
    ("reward_model", {}, "reward.path"),
    ("reward_model", {"path": "/no/such/dir"}, "neither the final/ dir of an algo=rm run"),
])
def test_builtin_args_are_checked(name, args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_builtin_args(name, args)


def test_bad_builtin_args_fail_when_the_config_is_checked():
    from rlnotes.commands.cli import UsageError
    from tests.conftest import compose

    with pytest.raises(UsageError, match="format_match needs args.pattern"):
        compose("reward.functions=[{fn: format_match}]")


def test_shipped_reward_configs_compose():
    from tests.conftest import compose

    for option, names in [("exact", ["exact_match"]), ("countdown", ["countdown"]),
                          ("reasoning", ["accuracy", "format"]), ("arith", ["number_match"])]:
        if option == "reasoning":
            pytest.importorskip("math_verify")
        assert [f.name for f in Rewards(compose(f"reward={option}").reward).fns] == names


# --------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("fns, names, expected", [
    (["number_match", "letter_share"], [None, None], ["number_match", "letter_share"]),
    (["pkg.a.score", "pkg.b.score"], [None, None], ["a.score", "b.score"]),
    (["x.a.score", "y.a.score", "z.other"], [None] * 3, ["x.a.score", "y.a.score", "other"]),
    (["format_match", "format_match"], [None, None], ["format_match", "format_match_2"]),
    (["format_match", "format_match"], ["think", "boxed"], ["think", "boxed"]),
    (["pkg.score", "number_match"], [None, "score"], ["pkg.score", "score"]),   # a given name wins
    (["stats.mean"], [None], ["stats.mean"]),                                   # reward/mean is the total
    (["m.score", "m.score", "m.score"], [None, None, "score_2"], ["score", "score_3", "score_2"]),
    (["a.score", "a.score", "b.score"], [None] * 3, ["a.score", "a.score_2", "b.score"]),
])
def test_metric_names_are_unique_and_readable(fns, names, expected):
    assert metric_names(fns, names) == expected


@pytest.mark.parametrize("names, message", [(["mean"], "a metric the algorithms write"),
                                            (["a", "a"], "given to two functions")])
def test_given_metric_names_must_be_free(names, message):
    with pytest.raises(ConfigError, match=message):
        metric_names(["number_match"] * len(names), names)


# --------------------------------------------------------------------------------------------- resolve

USER_MODULE = "rlnotes_test_user_rewards"
USER_CODE = '''
import math

CALLS = []


def constant(prompts, completions, **kw):
    return [1.0] * len(completions)


def length(prompts, completions, **kw):
    """No opinion (None) on completions that start with '?'."""
    return [None if c.startswith("?") else float(len(c)) for c in completions]


def fragile(prompts, completions, **kw):
    if "boom" in completions:
        raise ValueError("boom")
    return [1.0] * len(completions)


def nan_on_empty(prompts, completions, **kw):
    return [float("nan") if not c else (math.inf if c == "inf" else 1.0) for c in completions]


def odd_values(prompts, completions, **kw):
    table = {"str": "1.0", "list": [1.0], "none": None, "bool": True, "tensor": __import__("torch").tensor(0.5)}
    return [table.get(c, 2.0) for c in completions]


def always_raises(prompts, completions, **kw):
    raise RuntimeError("broken\\nsecond line")


def none_or_nan(prompts, completions, **kw):
    return [None if c == "skip" else float("nan") for c in completions]


def too_many(prompts, completions, **kw):
    return [1.0] * (len(completions) + 1)


def first_only(prompts, completions, **kw):
    return [float(len(completions[0]))]


def record(prompts, completions, **kw):
    CALLS.append({"prompts": list(prompts), "completions": list(completions), **kw})
    return [2.0] * len(completions)


def score(prompts, completions, **kw):
    return [0.25] * len(completions)


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module on sys.path, as `reward.target=rlnotes_test_user_rewards.fn` needs."""
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module(USER_MODULE)
    sys.modules.pop(USER_MODULE, None)


def test_resolve_builtin():
    assert resolve("number_match") is number_match
    assert resolve("letter_share") is letter_share


def test_resolve_import_path(user_module):
    fn = resolve(f"{USER_MODULE}.constant")
    assert fn is user_module.constant
    assert fn(["p"], ["c", "d"]) == [1.0, 1.0]


def test_resolve_missing_module_names_the_path():
    with pytest.raises(ConfigError, match=r"no_such_pkg_xyz\.rewards\.fn") as err:
        resolve("no_such_pkg_xyz.rewards.fn")
    assert "ModuleNotFoundError" in str(err.value)


def test_resolve_missing_attribute_names_the_path(user_module):
    with pytest.raises(ConfigError, match=rf"{USER_MODULE}\.nope"):
        resolve(f"{USER_MODULE}.nope")


def test_resolve_not_callable(user_module):
    with pytest.raises(ConfigError, match="not callable"):
        resolve(f"{USER_MODULE}.NOT_A_FUNCTION")


def test_resolve_unknown_plain_name_lists_builtins():
    with pytest.raises(ConfigError) as err:
        resolve("exact_matchh")
    message = str(err.value)
    assert "'exact_matchh'" in message
    assert all(name in message for name in ("number_match", "exact_match", "format_match", "countdown"))


# --------------------------------------------------------------------------------------------- Rewards


def rewards(*fns, target=None, fallback=0.0, console=None, timeout=None):
    """Rewards from (fn, weight), (fn, weight, args) or (fn, weight, args, name) tuples."""
    functions = [RewardFnConfig(fn=f[0], weight=f[1], args=f[2] if len(f) > 2 else {},
                                name=f[3] if len(f) > 3 else None) for f in fns]
    cfg = OmegaConf.structured(RewardConfig(functions=functions, target=target, fallback=fallback, timeout_s=timeout))
    return Rewards(cfg, console=console)


class FakeConsole:
    def __init__(self):
        self.printed = []

    def print(self, text):
        self.printed.append(text)


def test_weighted_sum_of_two_functions():
    r = rewards(("number_match", 2.0), ("letter_share", 0.5))
    total, metrics = r(["p1", "p2"], ["aa7", "b"], {"answer": ["7", "3"], "letter": ["a", "b"]})
    # number_match: [1, 0]; letter_share: [2/3, 1]
    torch.testing.assert_close(total, torch.tensor([2 * 1 + 0.5 * 2 / 3, 2 * 0 + 0.5 * 1]))
    assert metrics == {"reward/number_match": pytest.approx(0.5), "reward/letter_share": pytest.approx(5 / 6),
                       "reward/failures": 0}


def test_none_is_no_opinion(user_module):
    r = rewards(("number_match", 1.0), (f"{USER_MODULE}.length", 0.5))
    total, metrics = r(["p"] * 3, ["?1", "22", "abc"], {"answer": ["1", "22", "0"]})
    # number_match: [1, 1, 0]; length: [None, 2, 3] -> the first sample has only number_match
    torch.testing.assert_close(total, torch.tensor([1.0, 1.0 + 0.5 * 2, 0.0 + 0.5 * 3]))
    assert metrics["reward/length"] == pytest.approx(2.5)  # mean of 2 and 3, not of 0, 2, 3
    assert metrics["reward/failures"] == 0


def test_a_sample_no_function_scores_gets_zero_and_a_warning_once(user_module):
    console = FakeConsole()
    r = rewards((f"{USER_MODULE}.length", 2.0), console=console)
    total, metrics = r(["p"] * 3, ["?a", "bb", "?c"], {})
    torch.testing.assert_close(total, torch.tensor([0.0, 4.0, 0.0]))
    assert metrics == {"reward/length": 2.0, "reward/failures": 0}
    assert len(console.printed) == 1 and "2 of 3 samples" in console.printed[0]
    total, metrics = r(["p", "p"], ["?a", "?b"], {})
    torch.testing.assert_close(total, torch.zeros(2))
    assert math.isnan(metrics["reward/length"]) and len(console.printed) == 1


def test_function_raising_on_one_sample_is_retried_per_sample(user_module):
    console = FakeConsole()
    r = rewards((f"{USER_MODULE}.fragile", 2.0), ("number_match", 1.0), fallback=-1.0, console=console)
    total, metrics = r(["p"] * 3, ["1", "boom", "3"], {"answer": ["1", "0", "4"]})
    # fragile: [1, fallback -1, 1] x 2; number_match: [1, 0, 0]
    torch.testing.assert_close(total, torch.tensor([2.0 + 1.0, -2.0 + 0.0, 2.0 + 0.0]))
    assert metrics["reward/failures"] == 1
    assert metrics["reward/fragile"] == pytest.approx((1 - 1 + 1) / 3)
    assert metrics["reward/number_match"] == pytest.approx(1 / 3)
    assert len(console.printed) == 1 and "ValueError: boom" in console.printed[0]
    r(["p", "p"], ["boom", "2"], {"answer": ["0", "2"]})
    assert len(console.printed) == 1  # the traceback is shown once per run


def test_nan_and_inf_get_the_fallback(user_module):
    console = FakeConsole()
    r = rewards((f"{USER_MODULE}.nan_on_empty", 1.0), fallback=-0.5, console=console)
    total, metrics = r(["p"] * 3, ["x", "", "inf"], {})
    torch.testing.assert_close(total, torch.tensor([1.0, -0.5, -0.5]))
    assert metrics["reward/failures"] == 2
    assert len(console.printed) == 1 and "nan" in console.printed[0]


def test_values_that_are_not_numbers_get_the_fallback(user_module):
    r = rewards((f"{USER_MODULE}.odd_values", 1.0), fallback=-1.0)
    total, metrics = r(["p"] * 6, ["str", "list", "none", "bool", "tensor", "x"], {})
    # "1.0" (a string) and [1.0] are not numbers; None is no opinion; True is 1; a 0-d tensor is a number
    torch.testing.assert_close(total, torch.tensor([-1.0, -1.0, 0.0, 1.0, 0.5, 2.0]))
    assert metrics["reward/failures"] == 2
    assert metrics["reward/odd_values"] == pytest.approx((-1 - 1 + 1 + 0.5 + 2) / 5)


def test_function_failing_on_every_sample_stops_the_run_with_one_line(user_module):
    with pytest.raises(RewardFailure, match=r"'always_raises' .*RuntimeError: broken\)") as err:
        rewards((f"{USER_MODULE}.always_raises", 1.0))(["p", "p"], ["a", "b"], {})
    assert "\n" not in str(err.value)


def test_function_returning_nan_for_every_sample_stops_the_run(user_module):
    with pytest.raises(RewardFailure, match="no finite number .* returned nan"):
        rewards((f"{USER_MODULE}.nan_on_empty", 1.0))(["p", "p"], ["", ""], {})


def test_failing_on_every_sample_it_scores_stops_the_run(user_module):
    with pytest.raises(RewardFailure, match="none_or_nan"):
        rewards((f"{USER_MODULE}.none_or_nan", 1.0))(["p"] * 3, ["skip", "a", "skip"], {})
    total, _ = rewards((f"{USER_MODULE}.none_or_nan", 1.0))(["p"] * 2, ["skip", "skip"], {})  # only None: fine
    torch.testing.assert_close(total, torch.zeros(2))


def test_wrong_number_of_values_fails(user_module):
    with pytest.raises(RewardFailure, match="too_many.*returned 3 values for 2 completions"):
        rewards((f"{USER_MODULE}.too_many", 1.0))(["p", "p"], ["a", "b"], {})


def test_wrong_number_of_values_is_a_contract_error_not_retried(user_module):
    """Too few values stop the run at once, naming the function and both counts: a per-sample retry
    would hide the bug (one value per call is right for one sample)."""
    console = FakeConsole()
    with pytest.raises(RewardFailure) as err:
        rewards((f"{USER_MODULE}.first_only", 1.0), console=console)(["p"] * 3, ["a", "bb", "ccc"], {})
    assert str(err.value) == ("reward function 'first_only' returned 1 values for 3 completions; it must return one "
                              "value (a number or None) per completion")
    assert console.printed == []  # no "retrying sample by sample"


@pytest.fixture
def own(monkeypatch):
    """Reward functions a test defines, importable as rlnotes_test_own.<name>: own(fn, ..., **Rewards
    settings) gives Rewards over them, each of weight 1."""
    module = types.ModuleType("rlnotes_test_own")
    monkeypatch.setitem(sys.modules, "rlnotes_test_own", module)

    def rewards_of(*fns, **kw):
        for fn in fns:
            setattr(module, fn.__name__, fn)
        return rewards(*[(f"rlnotes_test_own.{fn.__name__}", 1.0) for fn in fns], **kw)
    return rewards_of


@pytest.mark.parametrize("result, what", [
    ({"a": 1.0, "b": 0.0}, "dict"),                 # was accepted: its keys became the rewards
    ({1.0, 2.0}, "set"),                            # was accepted in the set's order, not the samples'
    ("10", "str"),                                  # was read character by character
    ((v for v in (1.0, 2.0)), "generator"),
    (np.ones((2, 1)), "a 2-D ndarray"),
    (torch.tensor(1.0), "a 0-D Tensor"),
])
def test_a_result_that_is_not_one_value_per_completion_is_the_contract_error(own, result, what):
    def gives(completions, **kwargs):
        return result

    with pytest.raises(RewardFailure) as err:
        own(gives)(["p", "p"], ["a", "b"], {})
    assert str(err.value) == (f"reward function 'gives' returned {what}, not a list of one value (a number or None) "
                              "per completion (a list, a tuple, or a 1-D numpy array or tensor)")


@pytest.mark.parametrize("result", [[1.0, 2.0], (1, 2.0), np.array([1.0, 2.0]), np.array([1, 2]),
                                    torch.tensor([1.0, 2.0]), [np.float32(1.0), torch.tensor(2.0)]])
def test_lists_tuples_and_1d_arrays_and_tensors_are_one_value_per_completion(own, result):
    def gives(completions, **kwargs):
        return result

    total, metrics = own(gives)(["p", "p"], ["a", "b"], {})
    assert total.tolist() == [1.0, 2.0] and metrics["reward/failures"] == 0


def test_a_value_too_large_for_a_float_gets_the_fallback_in_one_line(own):
    """10**400 overflows float(); 10**5000 cannot even be printed (Python's limit on int digits)."""
    def huge(completions, **kwargs):
        return [{"big": 10 ** 400, "bigger": 10 ** 5000}.get(c, 1.0) for c in completions]

    console = FakeConsole()
    total, metrics = own(huge, fallback=-1.0, console=console)(["p"] * 3, ["big", "ok", "bigger"], {})
    assert total.tolist() == [-1.0, 1.0, -1.0] and metrics["reward/failures"] == 2
    (line,) = console.printed
    assert line.startswith("[yellow]reward function 'huge' returned 1000") and "…" in line and len(line) < 200
    with pytest.raises(RewardFailure, match=r"^reward function 'huge' gave no finite number .*\(it returned <int>\)"):
        own(huge)(["p"], ["bigger"], {})


def test_columns_args_and_completion_ids_reach_the_function_as_keywords(user_module):
    r = rewards((f"{USER_MODULE}.record", 1.0, {"scale": 3, "difficulty": "fixed"}))
    r(["p1", "p2"], ["c1", "c2"], {"answer": ["1", "2"], "difficulty": ["easy", "hard"]},
      completion_ids=[[5, 2], [7, 8, 2]])
    (call,) = user_module.CALLS
    assert {k for k in call if k.startswith(("trainer_state", "log_"))} == {"trainer_state", "log_extra", "log_metric"}
    call = {k: v for k, v in call.items() if k not in ("trainer_state", "log_extra", "log_metric")}
    assert call == {"prompts": ["p1", "p2"], "completions": ["c1", "c2"], "answer": ["1", "2"],
                    "difficulty": "fixed", "scale": 3, "completion_ids": [[5, 2], [7, 8, 2]]}


def test_length_penalty_in_tokens_through_rewards():
    r = rewards(("length_penalty", 1.0, {"target": 2, "slope": 0.5, "unit": "tokens"}))
    total, _ = r(["p"] * 3, ["a", "b", "c"], {}, completion_ids=[[1, 2], [1, 2, 3], [1, 2, 3, 4, 5, 6]])
    torch.testing.assert_close(total, torch.tensor([0.0, -0.5, -1.0]))


def test_name_collisions_get_distinct_metrics(user_module, tmp_path, monkeypatch):
    (tmp_path / "other_rewards.py").write_text("def score(prompts, completions, **kw):\n"
                                               "    return [0.75] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = rewards((f"{USER_MODULE}.score", 1.0), ("other_rewards.score", 1.0), ("format_match", 1.0, {"pattern": "a+"}),
                ("format_match", 1.0, {"pattern": "b+"}), ("format_match", 0.0, {"pattern": "c+"}, "only_c"))
    total, metrics = r(["p"] * 2, ["aa", "b"], {})
    assert metrics == {f"reward/{USER_MODULE}.score": 0.25, "reward/other_rewards.score": 0.75,
                       "reward/format_match": 0.5, "reward/format_match_2": 0.5, "reward/only_c": 0.0,
                       "reward/failures": 0}
    torch.testing.assert_close(total, torch.tensor([2.0, 2.0]))   # weight 0 logs without scoring
    sys.modules.pop("other_rewards", None)


def test_conversational_prompts_get_message_completions(user_module):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]
    r = rewards((f"{USER_MODULE}.record", 1.0))
    r([chat, "plain prompt"], ["7", "8"], {})
    (call,) = user_module.CALLS
    assert call["prompts"] == [chat, "plain prompt"]
    assert call["completions"] == [[{"role": "assistant", "content": "7"}], "8"]


def test_builtins_score_conversational_completions():
    chat = [{"role": "user", "content": "q"}]
    r = rewards(("number_match", 1.0), ("exact_match", 1.0, {"normalize": True}), ("format_match", 1.0,
                {"pattern": r"\d+"}), ("letter_share", 1.0), ("length_penalty", 1.0, {"target": 1, "slope": 1.0}),
                ("countdown", 1.0))
    total, metrics = r([chat, "q"], ["7", "7"], {"answer": ["7", "7"], "letter": ["7", "7"], "numbers": [[7], [7]],
                                                 "target": [7, 7]})
    assert metrics["reward/failures"] == 0
    torch.testing.assert_close(total, torch.tensor([5.0, 5.0]))   # the same text scores the same either way


def test_target_adds_a_function_of_weight_one(user_module):
    cfg = OmegaConf.structured(RewardConfig(functions=[RewardFnConfig(fn="number_match", weight=0.25)],
                                            target=f"{USER_MODULE}.constant"))
    assert function_specs(cfg) == [("number_match", 0.25, {}, None), (f"{USER_MODULE}.constant", 1.0, {}, None)]
    total, metrics = Rewards(cfg)(["p", "p"], ["5", "6"], {"answer": ["5", "5"]})
    torch.testing.assert_close(total, torch.tensor([0.25 + 1.0, 0.0 + 1.0]))
    assert metrics["reward/constant"] == 1.0


def test_target_alone(user_module):
    total, _ = rewards(target=f"{USER_MODULE}.constant")(["p"], ["x"], {})
    torch.testing.assert_close(total, torch.tensor([1.0]))


def test_empty_config_raises():
    with pytest.raises(ConfigError, match="no reward function"):
        rewards()


def test_unknown_function_fails_at_construction():
    with pytest.raises(ConfigError, match="exact_matchh"):
        rewards(("exact_matchh", 1.0))


# --------------------------------------------------------------------------------------------- TRL's calling convention

TRL_MODULE = "rlnotes_test_trl_rewards"
# Reward functions as TRL users write them: keyword arguments, **kwargs, the names TRL passes.
TRL_CODE = '''
import asyncio
import sys
import time

SEEN = []
STARTED = []


def reward_len(completions, **kwargs):
    return [-abs(3 - len(c)) for c in completions]


def accuracy(completions, ground_truth, **kwargs):
    return [float(c == g) for c, g in zip(completions, ground_truth)]


def keyword_only(*, prompts, completions, ground_truth, scale=1.0, **kwargs):
    return [scale * float(g in p) for p, g in zip(prompts, ground_truth)]


def no_kwargs(completions, ground_truth):
    return [float(c.startswith(g)) for c, g in zip(completions, ground_truth)]


def by_progress(completions, trainer_state, **kwargs):
    SEEN.append((trainer_state.global_step, trainer_state.max_steps))
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def digits_only(completions, **kwargs):
    """Applies only to completions that start with a digit."""
    return [float(c.isdigit()) if c[:1].isdigit() else None for c in completions]


async def judge_a(completions, **kwargs):
    """Finishes only if judge_b runs at the same time (both wait until both have started)."""
    return await _meet("a", completions)


async def judge_b(completions, **kwargs):
    return await _meet("b", completions)


async def _meet(who, completions):
    STARTED.append(who)
    for _ in range(200):
        if {"a", "b"} <= set(STARTED):
            return [1.0] * len(completions)
        await asyncio.sleep(0.01)
    return [0.0] * len(completions)


LOOPS = []


async def keeps_a_client(completions, **kwargs):
    """Like an async HTTP client made once: bound to the event loop of its first call."""
    LOOPS.append(asyncio.get_running_loop())
    return [1.0] * len(completions)


def mentions_the_question(prompts, completions, **kwargs):
    """Conversational data: prompts are message lists, completions [{"role": "assistant", ...}]."""
    SEEN.append((prompts, completions))
    return [float(c[0]["content"] in p[-1]["content"]) for p, c in zip(prompts, completions)]


def logs(completions, ground_truth, log_extra, log_metric, **kwargs):
    log_extra("length", [len(c) for c in completions])
    log_metric("long_frac", sum(len(c) > 2 for c in completions) / len(completions))
    return [0.0] * len(completions)


def vandal(prompts, completions, ground_truth, **kwargs):
    completions.sort()
    ground_truth[0] = "edited"
    prompts.clear()
    return [0.0] * len(completions)


def exits(completions, **kwargs):
    if "exit" in completions:
        sys.exit(3)
    return [1.0] * len(completions)


def interrupts(completions, **kwargs):
    raise KeyboardInterrupt


async def interrupts_async(completions, **kwargs):
    raise KeyboardInterrupt


def sleeps(completions, **kwargs):
    time.sleep(float(completions[0]))
    return [1.0] * len(completions)


async def sleeps_async(completions, **kwargs):
    await asyncio.sleep(float(completions[0]))
    return [1.0] * len(completions)


def positional_only(prompts, completions, /, **kwargs):
    return [0.0] * len(completions)
'''


@pytest.fixture
def trl_module(tmp_path, monkeypatch):
    (tmp_path / f"{TRL_MODULE}.py").write_text(TRL_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module(TRL_MODULE)
    sys.modules.pop(TRL_MODULE, None)


def trl(*names, **kw):
    return rewards(*[(f"{TRL_MODULE}.{n}", 1.0) for n in names], **kw)


def test_trl_signatures_are_called_by_keyword(trl_module):
    """reward_len(completions, **kwargs), accuracy(completions, ground_truth, **kwargs), a
    keyword-only one and one without **kwargs: each gets what it names, by keyword."""
    r = rewards((f"{TRL_MODULE}.reward_len", 1.0), (f"{TRL_MODULE}.accuracy", 10.0),
                (f"{TRL_MODULE}.keyword_only", 1.0, {"scale": 100.0}), (f"{TRL_MODULE}.no_kwargs", 1000.0))
    total, metrics = r(["is it 7?", "is it 8?"], ["7", "9999"], {"ground_truth": ["7", "8"]})
    # reward_len: [-2, -1]; accuracy: [1, 0]; keyword_only: [1, 1] x 100; no_kwargs: [1, 0] x 1000
    torch.testing.assert_close(total, torch.tensor([-2.0 + 10 + 100 + 1000, -1.0 + 0 + 100 + 0]))
    assert metrics["reward/failures"] == 0


def test_trainer_state_reaches_the_function(trl_module):
    from rlnotes.rewards.scoring import TrainerState

    r = trl("by_progress")
    r.state = TrainerState(global_step=3, max_steps=12, epoch=0.5)
    total, _ = r(["p", "p"], ["a", "b"], {})
    torch.testing.assert_close(total, torch.tensor([0.25, 0.25]))
    assert trl_module.SEEN == [(3, 12)]


def test_none_is_not_applicable_and_a_row_no_function_scores_is_named(trl_module):
    console = FakeConsole()
    r = rewards((f"{TRL_MODULE}.digits_only", 2.0), console=console)
    total, metrics = r(["p1", "What is [b]?", "p3"], ["12", "no digits", "1a"], {"ground_truth": ["12", "x", "y"]})
    torch.testing.assert_close(total, torch.tensor([2.0, 0.0, 0.0]))
    assert metrics["reward/digits_only"] == 0.5   # over the samples it scored
    (message,) = console.printed
    assert "1 of 3 samples" in message and "sample 1: prompt 'What is \\[b]?'" in message  # markup escaped
    assert "completion 'no digits'" in message and "ground_truth='x'" in message


def test_async_functions_are_awaited_together(trl_module):
    r = trl("judge_a", "judge_b", "reward_len")
    total, metrics = r(["p"], ["abc"], {})
    assert metrics["reward/judge_a"] == metrics["reward/judge_b"] == 1.0   # each saw the other start
    torch.testing.assert_close(total, torch.tensor([2.0]))


def test_async_functions_run_on_one_event_loop_across_calls(trl_module):
    r = trl("keeps_a_client")
    r(["p"], ["a"], {})
    r(["p"], ["b"], {})
    first, second = trl_module.LOOPS
    assert first is second and not first.is_closed()


def test_conversational_data_as_trl_passes_it(trl_module):
    chat = lambda q: [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]  # noqa: E731
    total, _ = trl("mentions_the_question")([chat("say 7"), chat("say 8")], ["7", "9"], {})
    torch.testing.assert_close(total, torch.tensor([1.0, 0.0]))
    ((prompts, completions),) = trl_module.SEEN
    assert prompts == [chat("say 7"), chat("say 8")]
    assert completions == [[{"role": "assistant", "content": "7"}], [{"role": "assistant", "content": "9"}]]


def test_log_metric_and_log_extra(trl_module, user_module):
    r = trl("logs", "digits_only")
    _, metrics = r(["p"] * 3, ["a", "bbb", "cccc"], {"ground_truth": ["1", "2", "3"]})
    assert metrics["reward/logs/long_frac"] == pytest.approx(2 / 3)
    assert r.extra == {"length": [1, 3, 4]}


def test_log_extra_of_a_per_sample_retry_lands_on_its_sample(trl_module):
    """A batch that raises is retried one sample at a time; each retry's logged value goes to its row."""
    module = types.ModuleType("retry_logs")

    def logs_then_fails(completions, log_extra, **kwargs):
        log_extra("seen", list(completions))
        if len(completions) > 1:
            raise ValueError("batch")
        return [1.0]

    module.logs_then_fails = logs_then_fails
    sys.modules["retry_logs"] = module
    try:
        r = rewards(("retry_logs.logs_then_fails", 1.0))
        r(["p"] * 3, ["a", "b", "c"], {})
    finally:
        sys.modules.pop("retry_logs")
    assert r.extra == {"seen": ["a", "b", "c"]}


def test_each_function_gets_its_own_copies(trl_module, user_module):
    """A function that sorts the completions, edits a column and empties the prompts changes
    nothing a later function, the caller or the samples table sees."""
    r = rewards((f"{TRL_MODULE}.vandal", 1.0), (f"{USER_MODULE}.record", 1.0))
    prompts, completions, columns = ["p1", "p2"], ["zz", "aa"], {"ground_truth": ["g1", "g2"]}
    r(prompts, completions, columns)
    (call,) = user_module.CALLS
    assert call["prompts"] == ["p1", "p2"] and call["completions"] == ["zz", "aa"]
    assert call["ground_truth"] == ["g1", "g2"]
    assert prompts == ["p1", "p2"] and completions == ["zz", "aa"] and columns == {"ground_truth": ["g1", "g2"]}


def test_sys_exit_in_a_reward_is_a_failure_not_an_exit(trl_module):
    console = FakeConsole()
    total, metrics = trl("exits", fallback=-1.0, console=console)(["p"] * 2, ["ok", "exit"], {})
    torch.testing.assert_close(total, torch.tensor([1.0, -1.0]))
    assert metrics["reward/failures"] == 1 and "SystemExit: 3" in console.printed[0]
    with pytest.raises(RewardFailure, match=r"'exits' gave no finite number .*\(SystemExit: 3\)"):
        trl("exits")(["p"], ["exit"], {})


def test_keyboard_interrupt_still_stops(trl_module):
    with pytest.raises(KeyboardInterrupt):
        trl("interrupts")(["p"], ["a"], {})
    with pytest.raises(KeyboardInterrupt):
        trl("interrupts", timeout=5.0)(["p"], ["a"], {})
    for timeout in (None, 5.0):  # raised on the event loop's thread, it still reaches the run's
        with pytest.raises(KeyboardInterrupt):
            trl("interrupts_async", timeout=timeout)(["p"], ["a"], {})


def test_a_weighted_sum_past_float32_gets_the_fallback_in_one_line(own):
    """1e39 is a finite float, but not a float32: the rewards tensor held inf, and the loss NaN."""
    def large(completions, **kwargs):
        return [{"big": 1e39, "near": 3e38}.get(c, 1.0) for c in completions]

    console = FakeConsole()
    own(large)   # now importable as rlnotes_test_own.large; weighed 2 here
    r = rewards(("rlnotes_test_own.large", 2.0), fallback=-1.0, console=console)
    total, metrics = r(["p"] * 3, ["big", "near", "ok"], {})
    assert total.tolist() == [-1.0, -1.0, 2.0] and metrics["reward/failures"] == 2
    assert console.printed == ["[yellow]the weighted sum of the reward functions gave the reward inf for 2 of 3 "
                               "samples; they get -1.0[/]"]
    with pytest.raises(RewardFailure) as err:
        r(["p"], ["big"], {})
    assert str(err.value) == ("the weighted sum of the reward functions gave no finite reward for any sample of the "
                              "batch (inf); scale the rewards or the weights down")


class GaveUp(BaseException):
    """A user's own BaseException, as a library's abort signal might be."""


@pytest.mark.parametrize("error", [asyncio.CancelledError(), GaveUp("server closed"), SystemExit(2), GeneratorExit()],
                         ids=["CancelledError", "user BaseException", "SystemExit", "GeneratorExit"])
@pytest.mark.parametrize("awaited", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_reward_raising_any_base_exception_is_a_failure_of_that_sample(own, error, awaited, timeout):
    def fails(completions, **kwargs):
        if "bad" in completions:
            raise error
        return [1.0] * len(completions)

    async def fails_async(completions, **kwargs):
        return fails(completions)

    fn = fails_async if awaited else fails
    console = FakeConsole()
    total, metrics = own(fn, fallback=-1.0, console=console, timeout=timeout)(["p"] * 2, ["ok", "bad"], {})
    assert total.tolist() == [1.0, -1.0] and metrics["reward/failures"] == 1
    assert type(error).__name__ in console.printed[0]
    with pytest.raises(RewardFailure, match=f"'{fn.__name__}' gave no finite number .*{type(error).__name__}"):
        own(fn, timeout=timeout)(["p"], ["bad"], {})


def test_an_async_function_that_blocks_the_loop_is_timed_out(own):
    """time.sleep in an async function never reaches an await: the loop runs in its own thread, so
    the run stops waiting for it at reward.timeout_s anyway."""
    async def blocks(completions, **kwargs):
        time.sleep(float(completions[0]))
        return [1.0] * len(completions)

    r = own(blocks, fallback=-5.0, timeout=0.2)
    start = time.perf_counter()
    total, metrics = r(["p"], ["1.0"], {})
    assert time.perf_counter() - start < 0.8
    assert total.tolist() == [-5.0] and metrics["reward/failures"] == 1


def test_a_call_that_does_not_return_is_named_while_it_runs(own, monkeypatch):
    """No reward.timeout_s: the run waits, and the watchdog says for what, once per call, after
    HANG_FACTOR times the function's usual time (HANG_MIN_S before it has one)."""
    from rlnotes.rewards import watchdog

    monkeypatch.setattr(watchdog, "HANG_MIN_S", 0.3)
    console = FakeConsole()

    def waits(completions, **kwargs):  # returns at once, or when the watchdog has spoken (at most 5 s)
        for _ in range(500 if completions[0] == "wait" else 0):
            if console.printed:
                break
            time.sleep(0.01)
        return [1.0] * len(completions)

    async def waits_async(completions, **kwargs):
        await asyncio.sleep(0)
        return waits(completions)

    r = own(waits, console=console)
    r(["p"], ["wait"], {})
    (line,) = console.printed
    assert line.startswith("[yellow]reward function 'waits' has been running for 0.3 s; the run is waiting for it "
                           "(reward.timeout_s=SECONDS bounds a call; Ctrl-C stops the run and says how to resume)")
    for _ in range(3):
        r(["p"], ["now"], {})
    console.printed.clear()
    r(["p"], ["wait"], {})
    assert "x its usual" in console.printed[0]
    console.printed.clear()
    own(waits_async, console=console, timeout=30.0)(["p"], ["wait"], {})
    assert console.printed[0].startswith("[yellow]reward function 'waits_async' has been running for 0.3 s")


@pytest.mark.parametrize("fn", ["sleeps", "sleeps_async"])
def test_timeout_gives_the_fallback_and_three_in_a_row_stop_the_run(trl_module, fn):
    console = FakeConsole()
    r = trl(fn, "reward_len", fallback=-5.0, timeout=0.2, console=console)
    start = time.perf_counter()
    total, metrics = r(["p", "p"], ["1.5", "x"], {})
    assert time.perf_counter() - start < 1.2
    torch.testing.assert_close(total, torch.tensor([-5.0 - 0.0, -5.0 - 2.0]))
    assert metrics["reward/failures"] == 2
    assert console.printed == [f"[yellow]reward function {fn!r} took longer than reward.timeout_s=0.2 s; its 2 "
                               "samples get -5.0[/]"]
    assert r(["p"], ["0"], {})[1]["reward/failures"] == 0   # a call in time resets the count
    r(["p"], ["1.5"], {})
    r(["p"], ["1.5"], {})
    with pytest.raises(RewardFailure, match=f"'{fn}' took longer than reward.timeout_s=0.2 s on 3 calls in a row"):
        r(["p"], ["1.5"], {})


def test_a_call_far_slower_than_usual_is_named(trl_module):
    console = FakeConsole()
    r = trl("sleeps", console=console)
    for _ in range(3):
        r(["p"], ["0"], {})
    assert console.printed == []
    r(["p"], ["1.1"], {})
    (message,) = console.printed
    took = re.match(r"\[yellow\]reward function 'sleeps' took (\d+\.\d) s on this batch, (\d+)x its usual", message)
    assert took and float(took[1]) >= 1.1 and int(took[2]) >= 10, message  # a slept 1.1 s, longer on a busy box
    assert "reward.timeout_s" in message


def test_timeout_must_be_positive():
    cfg = OmegaConf.structured(RewardConfig(functions=[RewardFnConfig(fn="number_match")], timeout_s=0))
    with pytest.raises(ConfigError, match=r"reward.timeout_s=0.0 must be > 0"):
        check_reward_config(cfg)


def test_positional_only_parameters_are_refused_when_the_config_is_checked(trl_module):
    with pytest.raises(ConfigError, match=r"'rlnotes_test_trl_rewards.positional_only' takes 'prompts' "
                                          r"positional-only .* called by keyword"):
        trl("positional_only")


def test_a_required_argument_no_column_fills_is_refused_before_the_model_loads(trl_module, tmp_path, monkeypatch):
    """accuracy(completions, ground_truth, **kwargs) on a file without ground_truth: one line naming
    the function, the argument and the columns, from setup before the policy is built."""
    from rich.console import Console

    import rlnotes.training.setup as common
    from rlnotes.algos.registry import REGISTRY
    from tests.conftest import compose

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(8)))
    cfg = compose("data=file", f"data.path={data}", "data.eval_size=2", "reward=custom",
                  f"reward.target={TRL_MODULE}.accuracy")
    monkeypatch.setattr(common.Policy, "from_config", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError) as err:
        common.setup(cfg, REGISTRY[cfg.algo.name], tmp_path / "run", Console(quiet=True))
    assert str(err.value) == (f"{data} has no column 'ground_truth', which reward accuracy needs; its columns: "
                              "answer, prompt; rename one with data.columns.ground_truth=COLUMN")


def test_reward_columns_of_trl_signatures():
    from rlnotes.data.datasets import reward_columns

    def reward_len(completions, **kwargs): ...
    def accuracy(completions, ground_truth, **kwargs): ...
    def keyword_only(*, prompts, completions, solution, trainer_state, log_extra, log_metric, level=1, **kw): ...

    assert reward_columns(reward_len) == []
    assert reward_columns(accuracy) == ["ground_truth"]
    assert reward_columns(keyword_only) == ["solution"]
    assert reward_columns(keyword_only, bound=("solution",)) == []


# -- where a user's module is found

CWD_CODE = "def brevity(completions, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n"


@pytest.fixture
def in_project_dir(tmp_path, monkeypatch):
    """The working directory holds the user's rewards.py (and sub/more.py); it is not on sys.path,
    as when the `rlnotes` console script runs."""
    (tmp_path / "cwd_rewards.py").write_text(CWD_CODE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper_mod.py").write_text("BONUS = 2.0\n")
    (tmp_path / "sub" / "more.py").write_text("from helper_mod import BONUS\n\n\ndef bonus(completions, **kwargs):\n"
                                              "    return [BONUS] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != tmp_path])
    yield tmp_path
    for name in ("cwd_rewards", "more", "helper_mod"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("target", ["cwd_rewards.brevity", "cwd_rewards:brevity"])
def test_a_module_in_the_working_directory_is_found(in_project_dir, target):
    assert resolve(target)(completions=["abc"]) == [0.25]


def test_a_file_path_is_found_with_its_neighbours(in_project_dir):
    r = rewards(("sub/more.py:bonus", 1.0), ("cwd_rewards:brevity", 1.0))
    total, metrics = r(["p"], ["abc"], {})
    torch.testing.assert_close(total, torch.tensor([2.25]))
    assert set(metrics) == {"reward/bonus", "reward/brevity", "reward/failures"}
    assert resolve("sub/more.py:bonus") is resolve(str(in_project_dir / "sub" / "more.py") + ":bonus")


def test_a_misspelled_reward_function_gets_the_closest_name(in_project_dir):
    """As a misspelled key does: a built-in's name, or a function of the user's module."""
    (in_project_dir / "typo_rewards.py").write_text("def accuracy(prompts, completions, **_):\n"
                                                    "    return [1.0] * len(completions)\n")
    for name, says in (("exact_mach", "; did you mean exact_match?"),
                       ("typo_rewards.acuracy", "(AttributeError: module 'typo_rewards' has no attribute 'acuracy'); "
                                                "did you mean typo_rewards.accuracy?"),
                       ("typo_rewards.py:acuracy", "did you mean typo_rewards.py:accuracy?"),
                       ("typo_rewards.zzz", "; check the name")):
        with pytest.raises(ConfigError) as err:
            resolve(name)
        assert str(err.value).endswith(says), str(err.value)
    sys.modules.pop("typo_rewards", None)


def test_a_module_that_fails_to_load_says_so(in_project_dir):
    (in_project_dir / "broken_rewards.py").write_text("def f(completions, **kwargs)\n    return []\n")
    with pytest.raises(ConfigError) as err:
        resolve("broken_rewards:f")
    assert str(err.value) == ("reward function 'broken_rewards:f' could not be imported (SyntaxError: expected ':' "
                              "(broken_rewards.py, line 1)); its module failed to load")
    sys.modules.pop("broken_rewards", None)


@pytest.mark.parametrize("code, says", [
    ("import sys\nsys.exit(0)\n", "(SystemExit: 0); its module exits_on_import exits while it is imported (sys.exit(), "
                                  "or argparse reading the command line): move that code under `if __name__ == "
                                  "'__main__':`"),
    ("import argparse\nargparse.ArgumentParser().parse_args(['train'])\n", "(SystemExit: 2); its module "
                                                                          "exits_on_import exits while it is imported"),
    ("class Stop(BaseException):\n    pass\n\n\nraise Stop('no config')\n", "(Stop: no config); its module failed to "
                                                                             "load"),
])
def test_a_module_that_exits_or_raises_a_base_exception_on_import_is_named(in_project_dir, capsys, code, says):
    """`rlnotes train` used to exit 0 with nothing trained: the check before training imports the
    module, and its SystemExit went through."""
    from rlnotes.commands.cli import main

    (in_project_dir / "exits_on_import.py").write_text(code + "\n\ndef f(completions, **kwargs):\n    return []\n")
    try:
        with pytest.raises(ConfigError) as err:
            resolve("exits_on_import:f")
        assert str(err.value).startswith(f"reward function 'exits_on_import:f' could not be imported {says}")
        assert main(["train", "reward=custom", "reward.target=exits_on_import:f", "logging.progress=false"]) == 2
        stderr = capsys.readouterr().err
        assert f"rlnotes: error: reward function 'exits_on_import:f' could not be imported {says}" in stderr
    finally:
        sys.modules.pop("exits_on_import", None)


def test_a_missing_file_names_it(in_project_dir):
    with pytest.raises(ConfigError, match=r"reward function 'nope/r.py:fn': no file nope/r.py \(paths are relative"):
        resolve("nope/r.py:fn")


def test_cli_precheck_finds_a_module_in_the_working_directory(in_project_dir):
    from rlnotes.commands.check import check

    (cfg,) = check(["reward=custom", "reward.target=cwd_rewards:brevity",
                    "reward.functions=[{fn: sub/more.py:bonus, weight: 1.0}]"], False, None)
    assert cfg.reward.target == "cwd_rewards:brevity"


@pytest.mark.long
def test_console_script_trains_with_rewards_from_the_working_directory(tmp_path):
    """The real `rlnotes` script (its sys.path has no working directory) and a user's reward module
    and file beside the data, without PYTHONPATH."""
    import os
    import subprocess

    (tmp_path / "cwd_rewards.py").write_text(CWD_CODE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.py").write_text("def bonus(completions, **kwargs):\n"
                                              "    return [2.0] * len(completions)\n")
    script = Path(sys.executable).with_name("rlnotes")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(script), "train", "reward=custom", "reward.target=cwd_rewards.brevity",
                           "reward.functions=[{fn: sub/more.py:bonus, weight: 1.0}]", "trainer.steps=1",
                           "trainer.batch_size=2", "algo.group_size=2", "rollout.max_new_tokens=4",
                           "logging.progress=false", "hydra.run.dir=run"],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/bonus"] == 2.0 and 0 < row["reward/brevity"] <= 1


# -- TRL's own reward functions


def test_trl_think_format_reward_on_conversational_data():
    rewards_module = pytest.importorskip("trl.rewards")
    r = rewards(("trl.rewards.think_format_reward", 1.0))
    chat = [{"role": "user", "content": "Think, then answer."}]
    total, metrics = r([chat, chat], ["<think>\nhm\n</think>\n42", "42"], {})
    torch.testing.assert_close(total, torch.tensor([1.0, 0.0]))
    assert metrics == {"reward/think_format_reward": 0.5, "reward/failures": 0}
    assert rewards_module.think_format_reward is resolve("trl.rewards:think_format_reward")


def test_trl_accuracy_reward_with_its_none_and_log_extra():
    pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    r = rewards(("trl.rewards.accuracy_reward", 1.0), ("number_match", 0.5))
    chat = [{"role": "user", "content": "1/3 as a fraction?"}]
    total, metrics = r([chat] * 3, [r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "7"],
                       {"solution": [r"$\frac{1}{3}$", r"$\frac{1}{3}$", "no math here"], "answer": ["3", "2", "7"]})
    # accuracy: [1, 0, None (the solution does not parse)]; number_match: [1, 1, 1] x 0.5
    torch.testing.assert_close(total, torch.tensor([1.5, 0.5, 0.5]))
    assert metrics["reward/accuracy_reward"] == 0.5 and metrics["reward/failures"] == 0
    assert set(r.extra) == {"solution", "gold_parsed", "answer_parsed"} and r.extra["answer_parsed"][2] == "[skipped]"


# --------------------------------------------------------------------------------------------- reward models


def tiny_classifier(path, chat_template=None, num_labels=1):
    """A tiny LlamaForSequenceClassification and its tokenizer saved in `path`, as a published reward
    model would be."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlnotes.engine.model.loading import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = chat_template
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=num_labels, pad_token_id=0,
                         initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def one_by_one(model, tokenizer, texts, add_special_tokens=True):
    """The model's score of each text alone: no batch, no padding."""
    with torch.no_grad():
        return [float(model(**tokenizer(t, add_special_tokens=add_special_tokens, return_tensors="pt")).logits[0, 0])
                for t in texts]


def test_hf_reward_model_scores_in_batches_as_one_by_one(tmp_path):
    from rlnotes.rewards.builtin import reward_model

    model, tokenizer = tiny_classifier(tmp_path)
    prompts, completions = ["Q: 3+4?", "Q: 10+20? ", "Q: 1+1?"], ["7", "It is 30, I think.", "2!"]
    scores = reward_model(prompts, completions, path=str(tmp_path), batch_size=2)
    expected = one_by_one(model, tokenizer, [p + c for p, c in zip(prompts, completions)])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 4) for s in scores}) == 3     # the scores tell the sequences apart


def test_hf_reward_model_renders_the_chat_template(tmp_path):
    from rlnotes.rewards.builtin import reward_model

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    model, tokenizer = tiny_classifier(tmp_path, chat_template=template)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"}]
    scores = reward_model(["3+4?", chat], ["7", [{"role": "assistant", "content": "7"}]], path=str(tmp_path))
    expected = one_by_one(model, tokenizer, ["<user>3+4?\n<assistant>7\n",
                                             "<system>Be brief.\n<user>3+4?\n<assistant>7\n"], False)
    assert scores == pytest.approx(expected, abs=1e-5)


def test_hf_model_with_several_labels_is_refused(tmp_path):
    from rlnotes.rewards.model import load_scorer

    tiny_classifier(tmp_path, num_labels=2)
    with pytest.raises(ConfigError, match="has 2 labels"):
        load_scorer(tmp_path, torch.device("cpu"), 4)


def without(path, name):
    """The saved model in `path` with tensor `name` removed from its weights."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights[name]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_reward_model_without_its_score_head_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """transformers initializes a missing head at random (with a warning, muted here): the run
    trained on a random reward."""
    from rlnotes.commands.cli import UsageError
    from rlnotes.rewards import model as reward_models
    from tests.conftest import compose

    tiny_classifier(tmp_path)
    without(tmp_path, "score.weight")
    says = (f"reward model '{tmp_path}' has no saved weights for score.weight: it would score with weights "
            "initialized at random")
    with pytest.raises(UsageError, match=re.escape(says)):
        compose("reward=model", f"reward.path={tmp_path}")
    monkeypatch.setattr(reward_models, "_saved_names", lambda path: None)   # a .bin checkpoint: found as it loads
    reward_models.check(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(says)):
        reward_models.load_scorer(tmp_path, torch.device("cpu"), 4)


def test_a_reward_model_with_several_labels_is_refused_before_any_model_loads(tmp_path):
    """It used to be found at the first reward call, after the first batch was sampled."""
    from rlnotes.commands.cli import UsageError
    from tests.conftest import compose

    tiny_classifier(tmp_path, num_labels=2)
    with pytest.raises(UsageError, match="has 2 labels; a reward model gives one score per sequence"):
        compose("reward=model", f"reward.path={tmp_path}")


def test_an_rm_head_file_without_its_weight_is_refused(tmp_path):
    from safetensors.torch import save_file

    from rlnotes.rewards.model import check

    save_file({"bias": torch.zeros(1)}, str(tmp_path / "reward_head.safetensors"))
    with pytest.raises(ConfigError, match="reward_head.safetensors has no weight; it is not the head an algo=rm run"):
        check(tmp_path)


def test_a_reward_model_that_fails_to_load_is_loaded_once(tmp_path, monkeypatch):
    """The failed call is retried sample by sample; each retry used to load the model again."""
    from rlnotes.rewards import model as reward_models

    loads = []

    def broken(path, device, batch_size):
        loads.append(path)
        raise OSError("weights damaged")

    monkeypatch.setattr(reward_models, "load_scorer", broken)  # builtin.reward_model imports it when called
    monkeypatch.setattr(reward_models, "check", lambda path: None)
    r = rewards(("reward_model", 1.0, {"path": str(tmp_path / "rm")}))
    with pytest.raises(RewardFailure, match=r"gave no finite number .*\(OSError: weights damaged\)"):
        r(["p"] * 3, ["a", "b", "c"], {})
    assert len(loads) == 1


def test_reward_model_path_must_be_a_model_dir(tmp_path):
    from rlnotes.commands.cli import UsageError
    from tests.conftest import compose

    with pytest.raises(UsageError, match="neither the final/ dir of an algo=rm run"):
        compose("reward=model", f"reward.path={tmp_path}")


def test_reward_model_from_an_hf_dir_in_a_run(tmp_path):
    """reward=model with an HF dir: composed, checked, on hardware.device, through Rewards."""
    from tests.conftest import compose

    model, tokenizer = tiny_classifier(tmp_path)
    cfg = compose("reward=model", f"reward.path={tmp_path}")
    assert cfg.reward.functions[0].args.device == cfg.hardware.device
    total, metrics = Rewards(cfg.reward)(["a", "b"], ["x", "yy"], {})
    torch.testing.assert_close(total, torch.tensor(one_by_one(model, tokenizer, ["ax", "byy"])), atol=1e-5, rtol=0)
    assert metrics["reward/reward_model"] == pytest.approx(float(total.mean()), abs=1e-6)


def test_reward_model_from_an_rm_run(tmp_path):
    """A 2-step algo=rm run through the console entry point, then reward=model on its final/: the
    scores are the trained head's r(x, y), the same in any batch size."""
    from rlnotes.commands.cli import main
    from rlnotes.engine.sequences import encode
    from rlnotes.rewards.builtin import reward_model
    from rlnotes.rewards.model import load, sequence_rewards
    from tests.conftest import compose

    run = tmp_path / "rm"
    assert main(["train", "algo=rm", "data=letters_pairs", "trainer.steps=2", "trainer.batch_size=4",
                 "logging.progress=false", f"hydra.run.dir={run}"]) == 0
    final = run / "final"
    prompts, completions = ["Write the letter a:", "Write the letter b!", "Write the letter a."], ["aaaa", "bb", "c"]
    cfg = compose("reward=model", f"reward.path={final}")
    total, metrics = Rewards(cfg.reward)(prompts, completions, {})
    model, head, tokenizer, model_cfg = load(final, torch.device("cpu"))
    with torch.no_grad():
        expected = torch.stack([sequence_rewards(model, head, encode(tokenizer, [p], [c], torch.device("cpu"),
                                                                     model_cfg.chat_template))[0]
                                for p, c in zip(prompts, completions)])
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=0)
    assert reward_model(prompts, completions, path=str(final), batch_size=1) == pytest.approx(total.tolist(), abs=1e-5)
    assert metrics["reward/failures"] == 0
    # The run's last checkpoint holds the same weights and its own config.yaml: it scores the same.
    (checkpoint,) = (run / "checkpoints").iterdir()
    assert reward_model(prompts, completions, path=str(checkpoint)) == pytest.approx(total.tolist(), abs=1e-5)


# --------------------------------------------------------------------------------------------- in a run


def test_grpo_logs_every_function_and_scores_tokens(tmp_path, user_module):
    """Two GRPO steps with several functions: each logs reward/<name>, the total is their weighted
    sum, and length_penalty in tokens sees the sampled completions' lengths."""
    from rich.console import Console

    from rlnotes.commands.train import train
    from tests.conftest import compose

    functions = ("[{fn: letter_share, weight: 1.0}, {fn: length_penalty, weight: 1.0, name: long, "
                 "args: {target: 0, slope: 1.0, max_penalty: null, unit: tokens}}, "
                 f"{{fn: {USER_MODULE}.score, weight: 2.0}}]")
    cfg = compose("algo=grpo", "logging.progress=false", "trainer.steps=2", "rollout.max_new_tokens=6",
                  f"reward.functions={functions}")
    train(cfg, tmp_path / "run", Console(quiet=True))   # beside the user's module, not in its dir
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward/score"] == 0.25 and row["reward/failures"] == 0
        assert row["reward/long"] == pytest.approx(-row["completion/len_mean"], rel=1e-5)
        assert row["reward/mean"] == pytest.approx(row["reward/letter_share"] + row["reward/long"] + 0.5, rel=1e-5)


def test_grpo_trains_with_trl_style_functions_on_a_users_jsonl(tmp_path, trl_module):
    """`rlnotes train` on a user's file with TRL-style functions: keyword arguments and a column
    (accuracy), trainer_state, None, two async ones, log_metric and log_extra into metrics.jsonl and
    samples.jsonl, and a function that edits its inputs without harming the others."""
    from rlnotes.commands.cli import main

    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}:", "ground_truth": str(i)}) + "\n" for i in range(10)))
    names = ["vandal", "reward_len", "accuracy", "by_progress", "digits_only", "judge_a", "judge_b", "logs"]
    functions = "[" + ", ".join(f"{{fn: {TRL_MODULE}.{n}, weight: 1.0}}" for n in names) + "]"
    code = main(["train", "data=file", f"data.path={data}", "data.eval_size=2", f"reward.functions={functions}",
                 "trainer.steps=2", "trainer.batch_size=2", "algo.group_size=2", "rollout.max_new_tokens=4",
                 "logging.progress=false", "logging.samples_every=1", "logging.samples_shown=2",
                 f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/by_progress"] for r in rows] == [0.0, 0.5]   # global_step / max_steps at steps 0 and 1
    for row in rows:
        assert row["reward/failures"] == 0 and row["reward/judge_a"] == row["reward/judge_b"] == 1.0
        assert 0.0 <= row["reward/logs/long_frac"] <= 1.0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["length"] == len(s["completion"]) for s in samples)
    assert all(s["prompt"].startswith("Say ") for s in samples)   # vandal emptied only its own copy


def test_trainer_state_counts_steps_and_epochs_of_rows_drawn():
    from rlnotes.data.sampler import PromptSampler

    sampler = PromptSampler([{"prompt": str(i)} for i in range(8)], batch_size=4, seed=0)
    for _ in range(3):
        sampler.next_batch()
    rewards = Rewards(OmegaConf.structured(RewardConfig(functions=[RewardFnConfig(fn="letter_share")])))
    rewards.at_step(2, 10, sampler.epochs_drawn())
    state = rewards.state
    assert (state.global_step, state.max_steps, state.epoch) == (2, 10, 1.5)
