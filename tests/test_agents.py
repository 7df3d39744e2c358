"""Tools and environments (rlnotes.agents): schemas, parsing calls, running them safely, loading,
and the Episode that the engine drives between turns. No model runs here."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlnotes.agents.builtin import ENVIRONMENTS, TOOLS, LettersEnv, calculator
from rlnotes.agents.builtin import add as builtin_add
from rlnotes.agents.environments import EnvironmentFailure, Episode, is_step_style, load_environment
from rlnotes.agents.tools import (
    load_tools,
    parse_tool_calls,
    run_tool_calls,
    template_takes_tools,
    tool_schema,
    tools_system_prompt,
)
from rlnotes.core.errors import ConfigError
from tests.trl_environments import IncrementEnv, MyEchoEnv


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def undocumented(a: int) -> int:
    return a


def unhinted(a):
    """Return a.

    Args:
        a: Anything.
    """
    return a


def boom(x: str) -> str:
    """Always fail.

    Args:
        x: Ignored.
    """
    raise LookupError("no such row\nsecond line")


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


async def fetch(key: str) -> str:
    """Look a key up, asynchronously.

    Args:
        key: The key.
    """
    await asyncio.sleep(0.01)
    return f"value of {key}"


def table(n: int) -> dict:
    """A table of squares.

    Args:
        n: How many.
    """
    return {"squares": [i * i for i in range(n)]}


def wrong_type_inside(x: str) -> str:
    """A TypeError raised inside the tool, not by its arguments.

    Args:
        x: Anything.
    """
    return x + 1


# --------------------------------------------------------------------------------------------- schemas


def test_schema_of_a_plain_function():
    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first number."},
                                                        "b": {"type": "number", "description": "The second number."}},
                       "required": ["a"]},
        "return": {"type": "number"}}}


def test_schema_of_calculator():
    schema = tool_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["description"] == "Evaluate an arithmetic expression and return its value."
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["function"]["return"] == {"type": "string"}


@pytest.mark.parametrize("fn, missing", [(undocumented, "no docstring"), (unhinted, "missing a type hint")])
def test_a_function_that_cannot_be_described_is_one_config_line(fn, missing):
    with pytest.raises(ConfigError) as err:
        tool_schema(fn)
    message = str(err.value)
    assert "\n" not in message and "\\n" not in message  # one line, and no escaped line break in it either
    assert message.startswith(f"rollout.tools: tool {fn.__name__!r} cannot be described to the model")
    assert missing in message and "Args:" in message and "def add(a: int, b: int)" in message


def test_system_prompt_lists_the_schemas_and_the_call_format():
    schemas = [tool_schema(add), tool_schema(calculator)]
    prompt = tools_system_prompt(schemas)
    listed = prompt[prompt.index("<tools>\n") + 8:prompt.index("\n</tools>")]
    assert [json.loads(line) for line in listed.splitlines()] == schemas
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt


def test_template_takes_tools():
    assert template_takes_tools(SimpleNamespace(chat_template="{% if tools %}{{ tools | tojson }}{% endif %}"))
    assert template_takes_tools(SimpleNamespace(chat_template={"default": "x", "tool_use": "{{ tools }}"}))
    assert not template_takes_tools(SimpleNamespace(chat_template="{{ messages[0]['content'] }} use tools well"))
    assert not template_takes_tools(SimpleNamespace(chat_template="{% set tools = [] %}{{ tools }}"))
    assert template_takes_tools(SimpleNamespace(chat_template="{% generation %}{{ tools }}{% endgeneration %}"))
    assert not template_takes_tools(SimpleNamespace(chat_template=None))
    assert not template_takes_tools(object())


# --------------------------------------------------------------------------------------------- parsing


def call(name: str, **arguments) -> str:
    """A well-formed Hermes call, as the model would write it."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_parse_one_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [{"name": "calculator", "arguments": {"expression": "2+2"}}]
    assert parsed.errors == []


def test_parse_two_calls_and_the_parameters_alias():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "parameters": {"y": [2]}}</tool_call>')
    assert parse_tool_calls(text).calls == [{"name": "a", "arguments": {"x": 1}},
                                            {"name": "b", "arguments": {"y": [2]}}]


def test_parse_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_tool_calls(text).calls == [{"name": "a", "arguments": {"x": 1}}]


@pytest.mark.parametrize("block, says", [
    ('{"name": "a", "arguments": {"x": 1}', "not valid JSON"),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "a", "arguments": [1, 2]}', "not a JSON object"),
    ('{"name": "a", "arguments": "x=1"}', "a string that is not JSON"),
    ('["a"]', "not a JSON object"),
    ('"calculator"', "not a JSON object"),
    # a repeated key: JSON keeps the last value, so add(347, 123) would run for {"a": 347, "b": 589, "b": 123}
    ('{"name": "add", "arguments": {"a": 347, "b": 589, "b": 123}}', 'the key "b" is given twice in one object'),
    ('{"name": "add", "name": "sub", "arguments": {}}', 'the key "name" is given twice'),
    ('{"name": "add", "arguments": "{\\"a\\": 1, \\"a\\": 2}"}', 'the "arguments" of add: the key "a" is given twice'),
])
def test_parse_malformed_calls_are_errors_for_the_model(block, says):
    parsed = parse_tool_calls(call("ok") + f"<tool_call>{block}</tool_call>")
    assert parsed.calls == [{"name": "ok", "arguments": {}}]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("Tool call 2: ") and says in parsed.errors[0]


def test_parse_an_unclosed_tag_at_the_end_is_malformed():
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b"')
    assert parsed.calls == [{"name": "a", "arguments": {}}]
    assert parsed.errors == ["Tool call 2: a <tool_call> block is not closed with </tool_call>."]
    assert parse_tool_calls('<tool_call>{"name": "b"').errors[0].startswith("Tool call 1: a <tool_call> block")


def test_parse_text_without_calls():
    parsed = parse_tool_calls("The answer is 4. </tool_call> is just text here.")
    assert parsed.calls == [] and parsed.errors == []


def test_parse_with_a_user_parser(tmp_path, monkeypatch):
    (tmp_path / "my_parsing.py").write_text(textwrap.dedent("""
        def parse(text):
            if text == "crash":
                raise ValueError("cannot read")
            name, _, arg = text.partition(" ")
            return [{"name": name, "arguments": {"x": arg}}, {"arguments": {}}, "g"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    parsed = parse_tool_calls("f 3", fmt="my_parsing:parse")
    assert parsed.calls == [{"name": "f", "arguments": {"x": "3"}}]
    assert parsed.errors == ['Tool call 2: no "name" of the function to call.',
                             'Tool call 3: not a JSON object like {"name": ..., "arguments": {...}}.']
    assert parse_tool_calls("crash", fmt="my_parsing:parse").errors == [
        "Tool call 1: the tool calls could not be read (ValueError: cannot read)."]


def test_an_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.tool_format='json' is not a format \(hermes\)"):
        parse_tool_calls("x", fmt="json")


# --------------------------------------------------------------------------------------------- running


TOOLBOX = {f.__name__: f for f in (add, boom, nap, fetch, table, wrong_type_inside, calculator)}


def error_of(message: dict) -> str:
    return json.loads(message["content"])["error"]


def test_run_a_successful_call():
    messages, failures = run_tool_calls([{"name": "add", "arguments": {"a": 2, "b": 0.5}}], TOOLBOX, timeout=5)
    assert messages == [{"role": "tool", "name": "add", "content": "2.5"}] and failures == 0


def test_run_an_unknown_tool_names_the_available_ones():
    messages, failures = run_tool_calls([{"name": "sub", "arguments": {}}], {"add": add, "nap": nap}, timeout=5)
    assert failures == 1 and messages[0]["name"] == "sub"
    assert error_of(messages[0]) == "unknown tool 'sub'; the tools are: add, nap"


def test_run_arguments_that_do_not_fit():
    messages, failures = run_tool_calls([{"name": "add", "arguments": {"b": 1}},
                                         {"name": "add", "arguments": {"a": 1, "c": 2}}], TOOLBOX, timeout=5)
    assert failures == 2
    assert error_of(messages[0]) == "the arguments do not fit add(a, b=1.0): missing a required argument: 'a'"
    assert "unexpected keyword argument 'c'" in error_of(messages[1])


def test_run_a_raising_tool_gives_type_and_first_line():
    messages, failures = run_tool_calls([{"name": "boom", "arguments": {"x": "r"}},
                                         {"name": "wrong_type_inside", "arguments": {"x": "r"}}], TOOLBOX, timeout=5)
    assert failures == 2
    assert error_of(messages[0]) == "boom raised LookupError: no such row"
    assert error_of(messages[1]).startswith("wrong_type_inside raised TypeError: can only concatenate")


def test_run_a_call_past_the_timeout_stops_waiting():
    start = time.monotonic()
    messages, failures = run_tool_calls([{"name": "nap", "arguments": {"seconds": 5}},
                                         {"name": "add", "arguments": {"a": 1}}], TOOLBOX, timeout=0.2)
    assert time.monotonic() - start < 1.0
    assert failures == 1
    assert error_of(messages[0]) == "nap did not finish within 0.2 s"
    assert messages[1]["content"] == "2.0"


def test_run_an_async_tool_and_a_dict_result():
    messages, failures = run_tool_calls([{"name": "fetch", "arguments": {"key": "k"}},
                                         {"name": "table", "arguments": {"n": 3}}], TOOLBOX, timeout=5)
    assert failures == 0
    assert messages[0]["content"] == "value of k"
    assert json.loads(messages[1]["content"]) == {"squares": [0, 1, 4]}


def test_run_a_tool_that_exits_is_a_failure_not_an_exit():
    def leave(code: int) -> str:
        """Exit.

        Args:
            code: The status.
        """
        raise SystemExit(code)

    messages, failures = run_tool_calls([{"name": "leave", "arguments": {"code": 3}}], {"leave": leave}, timeout=5)
    assert failures == 1 and error_of(messages[0]) == "leave raised SystemExit: 3"


def test_run_a_calculator_error():
    messages, failures = run_tool_calls([{"name": "calculator", "arguments": {"expression": "1/0"}}], TOOLBOX, None)
    assert failures == 1 and error_of(messages[0]) == "calculator raised ValueError: division by zero"


# --------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression, value", [
    ("1 + 2", "3"), ("7/2", "3.5"), ("6/2", "3"), ("(12 + 7) * 3", "57"), ("-3 // 2", "-2"), ("17 % 5", "2"),
    ("2 ** 10", "1024"), ("-(4 - 10)", "6"), ("+5", "5"), ("0.1 + 0.2", "0.3"), ("2 ** -1", "0.5"),
    ("123 * 456", "56088"), ("10 ** 30", "1" + "0" * 30),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, says", [
    ("x + 1", "not a name"), ("abs(-1)", "not a function call"), ("(1).real", "not an attribute"),
    ("'a' * 3", "not 'a'"), ("True + 1", "not True"), ("[1, 2]", "not List"),
    ("2 ** 10000", "the power is too large"), ("9 ** 9 ** 9", "the power is too large"),
    ("10.0 ** 400", "too large"), ("1 / 0", "division by zero"), ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"), ("1" * 600, "longer than 500"),
    ("__import__('os')", "not a function call"),
])
def test_calculator_rejections(expression, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("*", r"\*")):
        calculator(expression)


def test_builtin_tables():
    assert TOOLS == {"calculator": calculator, "add": builtin_add} and ENVIRONMENTS == {"letters": LettersEnv}


# --------------------------------------------------------------------------------------------- add


def test_add_adds_two_integers_as_a_call_runs_it():
    calls = [{"name": "add", "arguments": {"a": 347, "b": 589}}, {"name": "add", "arguments": {"a": 936, "b": 123}},
             {"name": "add", "arguments": {"a": -5, "b": 2}}]
    messages, failures = run_tool_calls(calls, TOOLS, None)
    assert failures == 0 and [m["content"] for m in messages] == ["936", "1059", "-3"]


@pytest.mark.parametrize("arguments, says", [
    ({"a": 1, "b": 2, "c": 3}, "the arguments do not fit add(a, b): got an unexpected keyword argument 'c'"),
    ({"a": 1}, "the arguments do not fit add(a, b): missing a required argument: 'b'"),
    ({"expression": "1+2"}, "the arguments do not fit add(a, b): missing a required argument: 'a'"),
    ({"a": "12", "b": 3}, "add raised ValueError: a must be an integer like 347, not '12'; add takes two integers a and b"),
    ({"a": 1, "b": 2.5}, "add raised ValueError: b must be an integer like 347, not 2.5; add takes two integers a and b"),
    ({"a": True, "b": 2}, "add raised ValueError: a must be an integer like 347, not True"),
    ({"a": [1, 2], "b": 2}, "add raised ValueError: a must be an integer like 347, not [1, 2]"),
    ({"a": 10 ** 101, "b": 2}, "add raised ValueError: a is too large"),
])
def test_add_refuses_anything_but_two_integers_in_one_line_the_model_reads(arguments, says):
    messages, failures = run_tool_calls([{"name": "add", "arguments": arguments}], TOOLS, None)
    assert failures == 1 and error_of(messages[0]).startswith(says)


def test_schema_of_add_says_two_integers():
    function = tool_schema(builtin_add)["function"]
    assert function["name"] == "add" and function["description"] == "Add two integers and return their sum."
    assert function["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first integer."},
                                                   "b": {"type": "integer", "description": "The second integer."}}
    assert function["parameters"]["required"] == ["a", "b"]


# --------------------------------------------------------------------------------------------- loading


def test_load_tools_builtin_and_from_a_file(tmp_path, monkeypatch):
    # Not my_tools.py: the module a file loads stays in sys.modules under the file's name, and
    # docs/agents.md's my_tools, run later in the same process, would find this one instead.
    (tmp_path / "shouting_tools.py").write_text(textwrap.dedent('''
        def shout(text: str) -> str:
            """Upper-case a text.

            Args:
                text: The text.
            """
            return text.upper()

        def bare(x):
            return x
    '''))
    monkeypatch.chdir(tmp_path)
    calc, shout = load_tools(["calculator", "shouting_tools.py:shout"])
    assert calc is calculator and shout("hi") == "HI"
    with pytest.raises(ConfigError, match=r"^rollout.tools: tool 'bare' cannot be described"):
        load_tools(["shouting_tools.py:bare"])


@pytest.mark.parametrize("spec, says", [
    ("calculatr", "rollout.tools: tool 'calculatr' is not built in (calculator, add) and not an import path like "
                  "mypkg.tools.my_tool or a file like path/to/tools.py:my_tool"),
    ("no_such_pkg_xyz.tools:fn", "rollout.tools: tool 'no_such_pkg_xyz.tools:fn' could not be imported"),
    ("nope/tools.py:fn", "rollout.tools: tool 'nope/tools.py:fn': no file nope/tools.py"),
    ("rlnotes.agents.builtin:MAX_MAGNITUDE", "rollout.tools: tool 'rlnotes.agents.builtin:MAX_MAGNITUDE' is not "
                                             "callable"),
])
def test_load_tools_errors(spec, says):
    with pytest.raises(ConfigError) as err:
        load_tools([spec])
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_load_tools_duplicate_names():
    with pytest.raises(ConfigError, match="'calculator' and 'rlnotes.agents.builtin:calculator' are both a tool "
                                          "named 'calculator'"):
        load_tools(["calculator", "rlnotes.agents.builtin:calculator"])


class NoReset:
    def step(self, action):
        return None, 0, True


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, **row):
        return None


class BadMethod:
    def reset(self, **row):
        return None

    def lookup(self, key):
        return key


def test_load_environment_builtin_and_by_path():
    assert load_environment("letters") is LettersEnv
    assert load_environment(f"{__name__}:Counter") is Counter


@pytest.mark.parametrize("spec, says", [
    ("letterz", "rollout.env: environment 'letterz' is not built in (letters) and not an import path like "
                "mypkg.envs.MyEnv"),
    (f"{__name__}:NoReset", f"rollout.env: environment '{__name__}:NoReset' (NoReset) has no reset method; "
                            "define reset(self, **row)"),
    (f"{__name__}:NeedsArgs", f"rollout.env: environment '{__name__}:NeedsArgs' could not be created with no "
                              "arguments (TypeError: "),
    (f"{__name__}:BadMethod", "rollout.env: tool 'BadMethod.lookup' cannot be described to the model"),
])
def test_load_environment_errors(spec, says):
    with pytest.raises(ConfigError) as err:
        load_environment(spec)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------- episodes


def test_tools_only_episode_runs_calls_then_ends():
    episode = Episode([calculator], None, max_tool_calls=5)
    assert episode.start({"prompt": "p"}) is None and episode.env is None
    assert list(episode.tools) == ["calculator"] and episode.schemas == [tool_schema(calculator)]
    observations, done = episode.step("I will compute. " + call("calculator", expression="12*12"))
    assert observations == [{"role": "tool", "name": "calculator", "content": "144"}] and not done
    observations, done = episode.step(call("calculator", expression="x") + '<tool_call>{"name": 1}</tool_call>')
    assert not done and [m["name"] for m in observations] == ["invalid_tool_call", "calculator"]
    assert error_of(observations[0]).startswith("Tool call 2: no \"name\"")
    assert episode.step("The answer is 144.") == ([], True)
    assert (episode.turns, episode.tool_calls, episode.tool_failures) == (3, 3, 2)
    assert episode.reward() is None


def test_max_tool_calls_answers_the_calls_past_it_and_ends():
    episode = Episode([add], None, max_tool_calls=3)
    observations, done = episode.step(call("add", a=1) + call("add", a=2))
    assert [m["content"] for m in observations] == ["2.0", "3.0"] and not done
    observations, done = episode.step(call("add", a=3) + call("add", a=4) + call("add", a=5))
    assert done and observations[0]["content"] == "4.0"
    limit = "the limit of 3 tool calls per episode is reached; this call was not run"
    assert [error_of(m) for m in observations[1:]] == [limit, limit]
    assert (episode.turns, episode.tool_calls, episode.tool_failures) == (2, 5, 2)


class Counter:
    """A TRL-style environment: its public methods are the model's tools."""

    def __init__(self):
        self.count = 0

    def reset(self, start: int = 0, **row) -> str:
        self.count = start
        return f" (the counter starts at {start})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def _private(self):
        return "never a tool"

    @property
    def doubled(self) -> int:
        return 2 * self.count

    def get_reward(self) -> float:
        return float(self.count == 10)


def test_trl_style_environment_methods_are_tools_bound_to_the_instance():
    episode = Episode([calculator], Counter, max_tool_calls=10)
    assert episode.start({"prompt": [{"role": "user", "content": "count"}], "start": 4}) == " (the counter starts at 4)"
    assert list(episode.tools) == ["calculator", "increment"]
    assert episode.tools["increment"].__self__ is episode.env
    assert [s["function"]["name"] for s in episode.schemas] == ["calculator", "increment"]
    other = Episode([], Counter, max_tool_calls=10)
    observations, done = episode.step(call("increment", by=6))
    assert observations == [{"role": "tool", "name": "increment", "content": "10"}] and not done
    assert episode.env.count == 10 and other.env.count == 0
    assert episode.step("done") == ([], True)
    assert episode.reward() == 1.0 and other.reward() == 0.0


def test_a_tool_named_like_an_environment_method_is_a_config_error():
    def increment(by: int) -> int:
        """Add.

        Args:
            by: How much.
        """
        return by

    with pytest.raises(ConfigError, match="method 'increment' of Counter has the name of a tool"):
        Episode([increment], Counter, max_tool_calls=1)


class Guess:
    """A step-style environment: guess the number; returns a tuple, or a StepResult-like object."""

    def __init__(self, as_object: bool = False):
        self.as_object = as_object

    def reset(self, target: int, **row):
        self.target = target
        return [{"role": "user", "content": "Guess a number."}]

    def step(self, action: str):
        right = action.strip() == str(self.target)
        observation, reward, done = (None, 1.0, True) if right else ("Wrong, try again.", -0.25, False)
        if self.as_object:
            return SimpleNamespace(observation=observation and {"role": "user", "content": observation},
                                   reward=reward, done=done)
        return observation, reward, done


@pytest.mark.parametrize("as_object", [False, True])
def test_step_style_environment(as_object):
    episode = Episode([add], lambda: Guess(as_object), max_tool_calls=4)
    assert episode.start({"prompt": "p", "target": 7}) == [{"role": "user", "content": "Guess a number."}]
    assert list(episode.tools) == ["add"]
    assert episode.step("3") == ([{"role": "user", "content": "Wrong, try again."}], False)
    observations, done = episode.step(call("add", a=3, b=4))
    assert observations == [{"role": "tool", "name": "add", "content": "7"}] and not done
    assert episode.step("7") == ([], True)
    assert episode.reward() == 0.75
    assert (episode.turns, episode.tool_calls, episode.tool_failures) == (3, 1, 0)


def test_step_style_environment_without_tools_steps_on_tool_like_text():
    episode = Episode([], lambda: Guess(), max_tool_calls=4)
    episode.start({"target": 1})
    assert episode.step(call("add", a=1))[0] == [{"role": "user", "content": "Wrong, try again."}]
    assert episode.tool_calls == 0 and episode.reward() == -0.25


class DocumentedGymStep:
    """A gym-style step written with a tool's type hints and docstring, annotated to return a tuple."""

    def reset(self, **row):
        return None

    def step(self, action: str) -> tuple[str, float, bool]:
        """Act.

        Args:
            action: The model's reply.
        """
        return "again", 0.0, False


class UntypedTrlLikeStep:
    """A step whose argument TRL could not describe (no type hint): read step-style."""

    def reset(self, **row):
        return None

    def step(self, message):
        """Echo.

        Args:
            message: The message.
        """
        return message


@pytest.mark.parametrize("cls, step_style", [
    (LettersEnv, True),             # step(self, action: str) -> Tuple[...], no docstring
    (Guess, True),                  # typed, no docstring
    (DocumentedGymStep, True),      # a tool's docstring, but -> tuple[...]
    (UntypedTrlLikeStep, True),     # no type hint
    (MyEchoEnv, False),             # TRL's echo example: step(self, message: str) -> str, Args: section
    (Counter, False),               # no step
    (IncrementEnv, False),
])
def test_auto_reads_a_class_as_trl_does_unless_its_step_is_gyms(cls, step_style):
    assert is_step_style(cls(), "auto") is step_style
    assert is_step_style(cls(), "gym") and not is_step_style(cls(), "tools")


def test_trls_echo_example_runs_its_step_tool():
    """rlnotes called the tool `step` with the model's reply and stopped: 'environment MyEchoEnv.step
    returned str, not (observation, reward, done)'."""
    assert load_environment("tests.trl_environments:MyEchoEnv") is MyEchoEnv
    episode = Episode([], MyEchoEnv, max_tool_calls=4)
    assert not episode.step_style and list(episode.tools) == ["step"]
    assert episode.schemas[0]["function"]["parameters"]["properties"]["message"]["type"] == "string"
    assert episode.start({"prompt": "Echo 'Hello World!'"}) is None
    observations, done = episode.step(call("step", message="Hello World!"))
    assert observations == [{"role": "tool", "name": "step", "content": "Hello World!"}] and not done
    assert episode.step("Done.") == ([], True)
    assert episode.reward() == pytest.approx(1.2)


def test_env_style_says_how_a_class_is_read():
    gym = Episode([], MyEchoEnv, max_tool_calls=4, env_style="gym")
    assert gym.step_style and gym.tools == {}
    gym.start({})
    with pytest.raises(EnvironmentFailure) as err:
        gym.step("hi")
    assert str(err.value) == "environment MyEchoEnv.step returned str, not (observation, reward, done)"
    auto = Episode([], lambda: Broken(), max_tool_calls=1)
    auto.start({})
    with pytest.raises(EnvironmentFailure, match=r"not \(observation, reward, done\); if step is a tool the model "
                                                 r"calls, as in TRL's environment_factory, set rollout.env_style=tools$"):
        auto.step("bad return")
    tools = Episode([], DocumentedGymStep, max_tool_calls=1, env_style="tools")
    assert not tools.step_style and list(tools.tools) == ["step"]


@pytest.mark.parametrize("spec, style, says", [
    (f"{__name__}:Counter", "gym", f"rollout.env_style=gym: environment '{__name__}:Counter' (Counter) has no step "
                                   "method; define step(self, action)"),
    ("letters", "tools", "rollout.env: tool 'LettersEnv.step' cannot be described to the model"),
])
def test_an_env_style_the_class_does_not_fit_is_one_line_when_it_loads(spec, style, says):
    with pytest.raises(ConfigError) as err:
        load_environment(spec, style)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


class Broken:
    def reset(self, **row):
        return None

    def step(self, action):
        if action == "bad return":
            return "only an observation"
        raise IndexError("list index out of range\nmore")


def test_an_environment_that_raises_is_an_environment_failure():
    episode = Episode([], Broken, max_tool_calls=1)
    episode.start({})
    with pytest.raises(EnvironmentFailure, match=r"^environment Broken.step raised IndexError: list index out of "
                                                 r"range$"):
        episode.step("anything")
    with pytest.raises(EnvironmentFailure, match=r"^environment Broken.step returned str, not \(observation, reward"):
        episode.step("bad return")


def test_letters_environment_rewards_by_hand():
    episode = Episode([], LettersEnv, max_tool_calls=0)
    assert episode.start({"prompt": "Write b", "letter": "b"}) is None
    assert episode.step("bbab") == ([{"role": "user", "content": "Now write the letter b:"}], False)
    assert episode.step("bx") == ([], True)
    assert episode.reward() == pytest.approx(1 / 2)   # the second reply alone; the first earns nothing
    default = Episode([], LettersEnv, max_tool_calls=0)
    default.start({"prompt": "p"})
    default.step("aaaa")
    default.step("xa")
    assert default.env.letter == "a" and default.reward() == pytest.approx(0.5)


class Faulty:
    """An environment whose every method misbehaves, as the row asks."""

    def reset(self, how: str = "", **row):
        if how == "raise":
            raise RuntimeError("no data")
        return 42 if how == "number" else None

    def step(self, action):
        return "obs", "high", True

    def get_reward(self):
        return "great"


@pytest.mark.parametrize("call_it, says", [
    (lambda e: e.start({"how": "raise"}), "environment Faulty.reset raised RuntimeError: no data"),
    (lambda e: e.start({"how": "number"}), "environment Faulty.reset returned int; return None, a string or a list"),
    (lambda e: e.step("x"), "environment Faulty.step returned the reward 'high', not a number or None"),
    (lambda e: e.reward(), "environment Faulty.get_reward returned 'great', not a number or None"),
])
def test_an_environment_that_misbehaves_is_named(call_it, says):
    with pytest.raises(EnvironmentFailure) as err:
        call_it(Episode([], Faulty, max_tool_calls=1))
    assert str(err.value).startswith(says)


def test_an_environment_that_cannot_be_created_any_more():
    def factory():
        raise OSError("server down")

    with pytest.raises(EnvironmentFailure, match="environment 'factory' could not be created \\(OSError: server down"):
        Episode([], factory, max_tool_calls=1)


def test_an_episode_checks_its_tool_format():
    with pytest.raises(ConfigError, match="rollout.tool_format='xml'"):
        Episode([calculator], None, max_tool_calls=1, tool_format="xml")


# --------------------------------------------------------------------------------------------- copies, bounds, failures


class Remembers:
    """The usual TRL-style reset: keep the row's prompt as the conversation and add to it."""

    def reset(self, prompt, **row):
        self.messages = prompt
        self.messages.append({"role": "user", "content": "Begin."})
        return None

    def step(self, action):
        return None, float(len(self.messages)), True


def test_an_environment_gets_its_own_copies_of_the_rows_values():
    """It used to get the row's own list: each episode of the row grew its prompt (1 -> 2 -> 3
    messages) and the reward climbed with it."""
    row = {"prompt": [{"role": "user", "content": "Hi"}], "answer": ["a"]}
    for _ in range(3):
        episode = Episode([], Remembers, max_tool_calls=0)
        episode.start(row)
        episode.step("x")
        assert episode.reward() == 2.0
    assert row == {"prompt": [{"role": "user", "content": "Hi"}], "answer": ["a"]}


class History:
    """Returns its own message list and keeps editing it afterwards."""

    def reset(self, **row):
        self.history = [{"role": "user", "content": "start"}]
        return self.history

    def step(self, action):
        self.history[0]["content"] = "edited"
        self.history.append({"role": "user", "content": f"you said {action}"})
        return self.history[-1], 0.0, False


def test_the_conversation_keeps_its_own_copies_of_an_environments_messages():
    episode = Episode([], History, max_tool_calls=0)
    start = episode.start({})
    observation, _ = episode.step("a")
    episode.step("b")
    assert start == [{"role": "user", "content": "start"}]
    assert observation == [{"role": "user", "content": "you said a"}]


class Messages:
    """reset and step return whatever the row asks for."""

    def reset(self, give=None, **row):
        self.give = give
        return give

    def step(self, action):
        return self.give[0], 0.0, False


@pytest.mark.parametrize("give, says", [
    ([{"content": "no role"}], "returned a message (1 of 1) with no 'role'"),
    ([{"role": "user", "content": "fine"}, {"role": "user"}], "returned a message (2 of 2) with no 'content'"),
    ([{"role": "user", "content": 7}], "returned a message (1 of 1) with a int as its 'content'"),
    ([{"role": None, "content": "x"}], "returned a message (1 of 1) with a NoneType as its 'role'"),
])
def test_a_message_without_a_role_or_text_content_is_named(give, says):
    form = '; return messages like {"role": "user", "content": "..."}'
    with pytest.raises(EnvironmentFailure) as err:
        Episode([], Messages, max_tool_calls=0).start({"give": give})
    assert str(err.value) == f"environment Messages.reset {says}{form}"
    episode = Episode([], Messages, max_tool_calls=0)
    episode.start({"give": [{"role": "user", "content": "ok"}]})
    episode.env.give = give[-1:]
    with pytest.raises(EnvironmentFailure, match=r"^environment Messages.step returned a message \(1 of 1\) with"):
        episode.step("x")


class Rewarding:
    """get_reward returns whatever the row asks for."""

    def reset(self, value=None, **row):
        self.value = value

    def get_reward(self):
        return self.value


@pytest.mark.parametrize("value, reward", [
    (np.float32(0.5), 0.5), (np.int64(2), 2.0), (torch.tensor(0.25), 0.25), (np.array(1.5), 1.5), (True, 1.0),
    (10 ** 400, math.inf), (float("nan"), "nan"), (None, None),
])
def test_an_environments_reward_is_any_number_and_non_finite_ones_are_kept(value, reward):
    """A 0-d tensor or numpy scalar is a number; 10**400 (too large for a float) used to raise
    OverflowError; NaN and inf are kept for the scorer to replace with reward.fallback."""
    episode = Episode([], Rewarding, max_tool_calls=0)
    episode.start({"value": value})
    got = episode.reward()
    assert (math.isnan(got) if reward == "nan" else got == reward)


@pytest.mark.parametrize("value, says", [([1.0, 2.0], "[1.0, 2.0]"), (torch.ones(2), "tensor([1., 1.])"),
                                         ("1.0", "'1.0'")])
def test_an_environments_reward_that_is_not_a_number_is_named(value, says):
    episode = Episode([], Rewarding, max_tool_calls=0)
    episode.start({"value": value})
    with pytest.raises(EnvironmentFailure) as err:
        episode.reward()
    assert str(err.value) == f"environment Rewarding.get_reward returned {says}, not a number or None"


class GaveUp(BaseException):
    """A user's own BaseException."""


class Raises:
    def __init__(self):
        if Raises.error_in_init is not None:
            raise Raises.error_in_init

    error_in_init = None

    def reset(self, error=None, **row):
        if error is not None:
            raise error

    def step(self, action):
        raise GaveUp("the game is over")


@pytest.mark.parametrize("error", [SystemExit(0), asyncio.CancelledError(), GaveUp("no server")],
                         ids=["SystemExit", "CancelledError", "user BaseException"])
@pytest.mark.parametrize("env_timeout", [None, 5.0])
def test_an_environment_raising_any_base_exception_is_one_line_and_ctrl_c_still_stops(error, env_timeout,
                                                                                       monkeypatch):
    """These used to go past the run's error handling: a traceback, or an exit 0 mid-run."""
    episode = Episode([], Raises, max_tool_calls=0, env_timeout=env_timeout)
    with pytest.raises(EnvironmentFailure, match=f"^environment Raises.reset raised {type(error).__name__}"):
        episode.start({"error": error})
    with pytest.raises(EnvironmentFailure, match="^environment Raises.step raised GaveUp: the game is over$"):
        episode.step("x")
    monkeypatch.setattr(Raises, "error_in_init", error)
    name = type(error).__name__
    with pytest.raises(EnvironmentFailure, match=f"^environment 'Raises' could not be created \\({name}"):
        Episode([], Raises, max_tool_calls=0, env_timeout=env_timeout)
    monkeypatch.setattr(Raises, "error_in_init", None)
    with pytest.raises(KeyboardInterrupt):
        Episode([], Raises, max_tool_calls=0, env_timeout=env_timeout).start({"error": KeyboardInterrupt()})


def test_an_environment_that_exits_when_it_is_created_is_a_config_error(tmp_path):
    (tmp_path / "exiting_env.py").write_text("import sys\n\n\nclass Env:\n    def __init__(self):\n"
                                             "        sys.exit(0)\n\n    def reset(self, **row):\n        pass\n")
    with pytest.raises(ConfigError, match=r"could not be created with no arguments \(SystemExit: 0\)"):
        load_environment(f"{tmp_path}/exiting_env.py:Env")


class Stuck:
    """Its step returns when `release` is set (at most after 5 s)."""

    release = None

    def reset(self, **row):
        return None

    def step(self, action):
        for _ in range(500):
            if Stuck.release is not None and Stuck.release():
                break
            time.sleep(0.01)
        return "go on", 0.0, False


def test_env_timeout_bounds_a_step_that_does_not_return(monkeypatch):
    monkeypatch.setattr(Stuck, "release", None)
    episode = Episode([], Stuck, max_tool_calls=0, env_timeout=0.2)
    episode.start({})
    start = time.monotonic()
    with pytest.raises(EnvironmentFailure) as err:
        episode.step("x")
    assert time.monotonic() - start < 1.0
    assert str(err.value) == ("environment Stuck.step did not return within rollout.env_timeout=0.2 s; make it faster "
                              "or raise the limit")


def test_the_watchdog_names_an_environment_call_or_a_tool_that_does_not_return(monkeypatch, capsys):
    """No time-out (rollout.env_timeout null, rollout.tool_timeout null): the run waits, and one
    line on stderr says what for, while it waits."""
    from rlnotes.rewards import watchdog

    monkeypatch.setattr(watchdog, "HANG_MIN_S", 0.3)
    monkeypatch.setattr(Stuck, "release", lambda: "has been running" in capsys.readouterr().err)
    episode = Episode([], Stuck, max_tool_calls=0)
    episode.start({})
    episode.step("x")
    lines = []
    monkeypatch.setattr(Stuck, "release", lambda: bool(lines))
    episode = Episode([], Stuck, max_tool_calls=0, watchdog=watchdog.Watchdog(lines.append))
    episode.start({})
    episode.step("x")
    # the seconds named are the call's when the watchdog looked: HANG_MIN_S, or a little more on a busy box
    waited = re.compile(r"has been running for (\d+\.\d) s")
    assert len(lines) == 1 and float(waited.search(lines[0])[1]) >= 0.3
    assert waited.sub("has been running for T s", lines[0]) == (
        "environment Stuck.step has been running for T s; the run is waiting for it "
        "(rollout.env_timeout=SECONDS bounds its calls; Ctrl-C stops the run and says how to resume)")

    def waits() -> str:
        """Wait for the watchdog."""
        for _ in range(500):
            if len(lines) > 1:
                break
            time.sleep(0.01)
        return "done"

    messages, failures = run_tool_calls([{"name": "waits", "arguments": {}}], {"waits": waits}, None,
                                        watchdog.Watchdog(lines.append))
    assert failures == 0 and float(waited.search(lines[1])[1]) >= 0.3
    assert waited.sub("has been running for T s", lines[1]).startswith(
        "tool 'waits' has been running for T s; the run is waiting for it (rollout.tool_timeout=SECONDS bounds a call")


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


def test_a_tool_result_that_cannot_be_shown_as_text_is_the_tools_failure():
    def odd(kind: str) -> object:
        """Return something odd.

        Args:
            kind: Which.
        """
        return {"object": Unprintable(), "huge": 10 ** 5000, "bytes": b"ok", "none": None}[kind]

    calls = [{"name": "odd", "arguments": {"kind": k}} for k in ("object", "huge", "bytes", "none")]
    messages, failures = run_tool_calls(calls, {"odd": odd}, timeout=5)
    assert failures == 2
    assert error_of(messages[0]) == "odd returned a Unprintable that cannot be shown as text (RuntimeError: no text)"
    assert error_of(messages[1]).startswith("odd returned a int that cannot be shown as text (ValueError: Exceeds")
    assert [m["content"] for m in messages[2:]] == ["b'ok'", "None"]


def test_a_parser_that_exits_is_a_malformed_call_not_an_exit(tmp_path, monkeypatch):
    (tmp_path / "exiting_parser.py").write_text("import sys\n\n\ndef parse(text):\n    sys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert parse_tool_calls("x", fmt="exiting_parser:parse").errors == [
        "Tool call 1: the tool calls could not be read (SystemExit: 3)."]


def test_the_watchdog_names_a_parser_that_does_not_return(tmp_path, monkeypatch):
    from rlnotes.rewards import watchdog

    monkeypatch.setattr(watchdog, "HANG_MIN_S", 0.3)
    (tmp_path / "slow_parser.py").write_text("import time\n\nLINES = []\n\n\ndef parse(text):\n"
                                             "    for _ in range(500):\n        if LINES:\n            break\n"
                                             "        time.sleep(0.01)\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_parser

    try:
        episode = Episode([add], None, max_tool_calls=1, tool_format="slow_parser:parse",
                          watchdog=watchdog.Watchdog(slow_parser.LINES.append))
        assert episode.step("no calls") == ([], True)
        assert slow_parser.LINES == ["rollout.tool_format parser 'slow_parser:parse' has been running for 0.3 s; "
                                     "the run is waiting for it (Ctrl-C stops the run and says how to resume)"]
    finally:
        sys.modules.pop("slow_parser", None)
