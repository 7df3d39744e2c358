"""Reward functions, name resolution, and the weighted sum that survives a failing function."""

import importlib
import math
import sys
import textwrap

import pytest
import torch

from rlnotes.config import ConfigError, RewardConfig, RewardFnConfig
from rlnotes.rewards import RewardFailure, Rewards, function_specs, last_number, letter_share, number_match, resolve

# --------------------------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("completion, answer, score", [
    ("7", "7", 1.0),
    ("-3", "-3", 1.0),
    ("The answer is -3.", "-3", 1.0),
    ("3", "-3", 0.0),
    ("-3", "3", 0.0),
    ("1,234", "1234", 1.0),
    ("It is 1,234.", "1234", 1.0),
    ("The answer is 12.", "12", 1.0),
    ("12 apples, I think", "12", 1.0),
    ("4 + 3 = 7", "7", 1.0),
    ("4 + 3 = 7", "4", 0.0),
    ("no number here", "7", 0.0),
    ("", "7", 0.0),
    ("7.0", "7", 1.0),
    ("7.5", "7", 0.0),
    ("0.5", "0.50", 1.0),
    ("7", "seven", 0.0),
])
def test_number_match(completion, answer, score):
    assert number_match(["q"], [completion], answer=[answer]) == [score]


def test_number_match_is_per_sample_and_ignores_other_columns():
    assert number_match(["a", "b", "c"], ["1", "x 2", "3"], answer=["1", "2", "4"], letter=["z"] * 3) == [1.0, 1.0, 0.0]


def test_last_number():
    assert last_number("from 3 to 1,000,000.") == "1000000"
    assert last_number("none") is None


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


def always_raises(prompts, completions, **kw):
    raise RuntimeError("broken")


def too_many(prompts, completions, **kw):
    return [1.0] * (len(completions) + 1)


def first_only(prompts, completions, **kw):
    return [float(len(completions[0]))]


def record(prompts, completions, **kw):
    CALLS.append({"prompts": list(prompts), "completions": list(completions), **kw})
    return [2.0] * len(completions)


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
        resolve("exact_match")
    message = str(err.value)
    assert "'exact_match'" in message
    assert "number_match" in message and "letter_share" in message


# --------------------------------------------------------------------------------------------- Rewards


def rewards(*fns, target=None, fallback=0.0, console=None):
    """Rewards from (name, weight) pairs or (name, weight, args) triples."""
    functions = [RewardFnConfig(fn=f[0], weight=f[1], args=f[2] if len(f) > 2 else {}) for f in fns]
    return Rewards(RewardConfig(functions=functions, target=target, fallback=fallback), console=console)


def test_weighted_sum_of_two_functions():
    r = rewards(("number_match", 2.0), ("letter_share", 0.5))
    total, metrics = r(["p1", "p2"], ["aa7", "b"], {"answer": ["7", "3"], "letter": ["a", "b"]})
    # number_match: [1, 0]; letter_share: [2/3, 1]
    torch.testing.assert_close(total, torch.tensor([2 * 1 + 0.5 * 2 / 3, 2 * 0 + 0.5 * 1]))
    assert metrics["reward/number_match"] == pytest.approx(0.5)
    assert metrics["reward/letter_share"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["reward/failures"] == 0


def test_none_is_no_opinion(user_module):
    r = rewards(("number_match", 1.0), (f"{USER_MODULE}.length", 0.5))
    total, metrics = r(["p"] * 3, ["?1", "22", "abc"], {"answer": ["1", "22", "0"]})
    # number_match: [1, 1, 0]; length: [None, 2, 3] -> the first sample has only number_match
    torch.testing.assert_close(total, torch.tensor([1.0, 1.0 + 0.5 * 2, 0.0 + 0.5 * 3]))
    assert metrics["reward/length"] == pytest.approx(2.5)  # mean of 2 and 3, not of 0, 2, 3
    assert metrics["reward/failures"] == 0


def test_all_none_gives_nan_mean_and_zero_reward(user_module):
    total, metrics = rewards((f"{USER_MODULE}.length", 1.0))(["p", "p"], ["?a", "?b"], {})
    torch.testing.assert_close(total, torch.zeros(2))
    assert math.isnan(metrics["reward/length"])


class FakeConsole:
    def __init__(self):
        self.printed = []

    def print(self, text):
        self.printed.append(text)


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
    r = rewards((f"{USER_MODULE}.nan_on_empty", 1.0), fallback=-0.5)
    total, metrics = r(["p"] * 3, ["x", "", "inf"], {})
    torch.testing.assert_close(total, torch.tensor([1.0, -0.5, -0.5]))
    assert metrics["reward/failures"] == 2


def test_function_failing_on_every_sample_stops_the_run(user_module):
    with pytest.raises(RewardFailure, match="always_raises"):
        rewards((f"{USER_MODULE}.always_raises", 1.0))(["p", "p"], ["a", "b"], {})


def test_wrong_number_of_values_fails(user_module):
    with pytest.raises(RewardFailure, match="too_many"):
        rewards((f"{USER_MODULE}.too_many", 1.0))(["p", "p"], ["a", "b"], {})


def test_wrong_number_of_values_in_a_batch_is_retried_per_sample(user_module):
    # One value per call is right for a single sample, so the retry recovers every value.
    total, metrics = rewards((f"{USER_MODULE}.first_only", 1.0))(["p"] * 3, ["a", "bb", "ccc"], {})
    torch.testing.assert_close(total, torch.tensor([1.0, 2.0, 3.0]))
    assert metrics["reward/failures"] == 0


def test_columns_and_args_reach_the_function_as_keywords(user_module):
    r = rewards((f"{USER_MODULE}.record", 1.0, {"scale": 3}))
    r(["p1", "p2"], ["c1", "c2"], {"answer": ["1", "2"], "difficulty": ["easy", "hard"]})
    (call,) = user_module.CALLS
    assert call == {"prompts": ["p1", "p2"], "completions": ["c1", "c2"],
                    "answer": ["1", "2"], "difficulty": ["easy", "hard"], "scale": 3}


def test_target_adds_a_function_of_weight_one(user_module):
    cfg = RewardConfig(functions=[RewardFnConfig(fn="number_match", weight=0.25)], target=f"{USER_MODULE}.constant")
    assert function_specs(cfg) == [("number_match", 0.25, {}), (f"{USER_MODULE}.constant", 1.0, {})]
    total, metrics = Rewards(cfg)(["p", "p"], ["5", "6"], {"answer": ["5", "5"]})
    torch.testing.assert_close(total, torch.tensor([0.25 + 1.0, 0.0 + 1.0]))
    assert metrics["reward/constant"] == 1.0


def test_target_alone(user_module):
    total, _ = Rewards(RewardConfig(target=f"{USER_MODULE}.constant"))(["p"], ["x"], {})
    torch.testing.assert_close(total, torch.tensor([1.0]))


def test_empty_config_raises():
    with pytest.raises(ConfigError, match="no reward function"):
        Rewards(RewardConfig())


def test_unknown_function_fails_at_construction():
    with pytest.raises(ConfigError, match="exact_match"):
        rewards(("exact_match", 1.0))


def test_function_returning_nan_for_every_sample_stops_the_run(user_module):
    with pytest.raises(RewardFailure, match="no finite value"):
        rewards((f"{USER_MODULE}.nan_on_empty", 1.0))(["p", "p"], ["", ""], {})
