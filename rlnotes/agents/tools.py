"""Tools the model calls between its turns: loaded from `rollout.tools`, described to the model
(JSON schemas from their signatures and docstrings, in the chat template or a system prompt),
their calls parsed from the model's text (`rollout.tool_format`) and run, each result or error
becoming a tool message.

Whatever the model writes or a tool does (bad JSON, an unknown tool, wrong arguments, an
exception, a result that cannot be shown as text, a call past rollout.tool_timeout) becomes an
error message the model reads and a counted failure, never an exception of the run. A call still
running long after the tool's usual time is named while it runs (rlnotes.rewards.watchdog).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from jinja2 import Environment, TemplateSyntaxError, meta
from jinja2.ext import loopcontrols
from transformers.utils import get_json_schema

from rlnotes.agents.builtin import TOOLS
from rlnotes.core.errors import ConfigError
from rlnotes.core.user_code import first_line, is_async, resolve_callable
from rlnotes.rewards.watchdog import Watchdog, in_thread

# ---------------------------------------------------------------------------------------------
# loading and describing tools

# A described function, in words: an error is one line, and a docstring's line breaks are the point.
SCHEMA_EXAMPLE = ('def add(a: int, b: int) -> int whose docstring is "Add two numbers.", then a line "Args:" and, '
                  'indented below it, a line per argument: "a: The first number.", "b: The second number."')


def load_tools(specs: Sequence[str]) -> List[Callable]:
    """The functions `rollout.tools` names: built-ins (`rlnotes.agents.builtin.TOOLS`) by name, a
    user's by import path ('pkg.module:fn', 'pkg.module.fn') or file ('path/to/tools.py:fn'). Each
    one's schema is read here, so that a missing docstring or type hint fails before a model loads."""
    tools, names = [], {}
    for spec in specs:
        fn = resolve_callable(spec, TOOLS, "rollout.tools: tool", ("tools", "my_tool"))
        name = tool_schema(fn)["function"]["name"]
        if name in names:
            raise ConfigError(f"rollout.tools: {names[name]!r} and {spec!r} are both a tool named {name!r}; "
                              "the model calls tools by name: list each once, or rename one function")
        names[name] = spec
        tools.append(fn)
    return tools


def tool_schema(fn: Callable, setting: str = "rollout.tools") -> dict:
    """The JSON schema the model sees of `fn` (transformers' `get_json_schema`: its name, the
    docstring's description, each argument's type and description). A function without type hints
    or a Google-style docstring has none: a ConfigError that names `setting` and shows the form."""
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises its own parsing exceptions
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"{setting}: tool {name!r} cannot be described to the model ({first_line(e)}); give it "
                          "a type hint for every argument and a Google-style docstring with an Args: section, "
                          f"e.g. {SCHEMA_EXAMPLE}") from None


def tools_system_prompt(schemas: List[dict]) -> str:
    """Instructions and the tools' schemas, Hermes-style, for a chat template that does not render
    tools itself (it goes into the system message)."""
    listed = "\n".join(json.dumps(schema) for schema in schemas)
    return ("You can call functions to help you answer. The functions you may call are described, "
            "as JSON schemas, between <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments between <tool_call></tool_call> "
            "tags, one call per block:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "Each result comes back to you in a tool message. When you need no more calls, write your answer "
            "without a <tool_call> block.")


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument (it reads the variable
    `tools`); False when it has no template. A template that jinja2 cannot parse alone (one using
    transformers' own tags) is searched for the word `tools` instead."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        template = "\n".join(template.values())
    if not template:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(Environment(extensions=[loopcontrols]).parse(template))
    except TemplateSyntaxError:
        return re.search(r"\btools\b", template) is not None


# ---------------------------------------------------------------------------------------------
# parsing the model's calls


@dataclass
class ToolCalls:
    calls: List[dict] = field(default_factory=list)    # each {"name": str, "arguments": dict}
    errors: List[str] = field(default_factory=list)    # one sentence per malformed call, for the model


FORMATS = ("hermes",)
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PARSERS: Dict[str, Callable] = {}   # user parsers by spec, loaded once


def tool_parser(fmt: str) -> Optional[Callable]:
    """The user's parser that `rollout.tool_format` names ('pkg.module:fn', loaded once), None for
    a built-in format; an unknown name is a ConfigError."""
    if fmt in FORMATS:
        return None
    if fmt not in _PARSERS:
        if ":" not in fmt and "." not in fmt:
            raise ConfigError(f"rollout.tool_format={fmt!r} is not a format ({', '.join(FORMATS)}) nor the "
                              "import path of a parser like mypkg.parsing:parse_calls")
        _PARSERS[fmt] = resolve_callable(fmt, {}, "rollout.tool_format: parser", ("parsing", "parse_calls"))
    return _PARSERS[fmt]


def parse_tool_calls(text: str, fmt: str = "hermes") -> ToolCalls:
    """The calls in the model's `text`. hermes: each `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` block ("parameters" is read as "arguments", which may also be a JSON string of an
    object); an unclosed `<tool_call>` at the end is a malformed call. A user's parser
    `fn(text) -> [{"name", "arguments"}, ...]` is checked the same way, and its exception is one
    malformed call."""
    parser = tool_parser(fmt)
    if parser is None:
        blocks = _HERMES_BLOCK.findall(text)
        tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if blocks else text
        items = [_read_json(block) for block in blocks]
        if "<tool_call>" in tail:
            items.append((None, "a <tool_call> block is not closed with </tool_call>"))
    else:
        try:
            items = [(item, None) for item in parser(text)]
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - the user's parser failed on the model's text, sys.exit() too
            items = [(None, f"the tool calls could not be read ({first_line(e)})")]
    out = ToolCalls()
    for i, (item, error) in enumerate(items, 1):
        call = _checked_call(item) if error is None else error
        if isinstance(call, str):
            out.errors.append(f"Tool call {i}: {call}.")
        else:
            out.calls.append(call)
    return out


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: List[tuple]) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice: JSON would keep the last value
    silently, and a call like {"a": 3, "b": 5, "b": 7} would run as if it had been meant."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(f'the key "{key}" is given twice in one object; give each argument once')
        out[key] = value
    return out


def _loads(text: str) -> object:
    return json.loads(text, object_pairs_hook=_unique_keys)


def _read_json(block: str) -> tuple[object, Optional[str]]:
    """(the block's JSON value, None), or (None, why it is not JSON or repeats a key)."""
    try:
        return _loads(block), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at character {e.pos})"
    except _RepeatedKey as e:
        return None, str(e)


def _checked_call(item) -> object:
    """{"name", "arguments"} of one parsed call, or what is wrong with it (a string)."""
    if not isinstance(item, dict):
        return 'not a JSON object like {"name": ..., "arguments": {...}}'
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return 'no "name" of the function to call'
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except json.JSONDecodeError:
            return f'the "arguments" of {name} are a string that is not JSON'
        except _RepeatedKey as e:
            return f'the "arguments" of {name}: {e}'
    if not isinstance(arguments, dict):
        return f'the "arguments" of {name} are not a JSON object'
    return {"name": name, "arguments": arguments}


# ---------------------------------------------------------------------------------------------
# running calls


def error_message(name: str, error: str) -> dict:
    """The tool message that tells the model its call failed."""
    return {"role": "tool", "name": name, "content": json.dumps({"error": error})}


# How the watchdog's line says to bound a tool's calls.
HANG_HINT = "rollout.tool_timeout=SECONDS bounds a call; Ctrl-C stops the run and says how to resume"


def run_tool_calls(calls: List[dict], tools: Dict[str, Callable], timeout: Optional[float],
                   watchdog: Optional[Watchdog] = None) -> tuple[List[dict], int]:
    """(one tool message per call, in order; how many failed). A result is the message's content
    (text as it is, a dict or list as JSON, anything else as str() gives it); a failure is
    `{"error": "..."}`: an unknown tool, arguments that do not fit its signature, an exception in
    the tool, a result that cannot be shown as text, or no result within `timeout` seconds (None:
    no limit; the call runs in a daemon thread that is left behind). `watchdog` names a call still
    running far past the tool's usual time."""
    watchdog = watchdog or Watchdog()
    messages, failures = [], 0
    for call in calls:
        name, arguments = call["name"], call["arguments"]
        fn = tools.get(name)
        if fn is None:
            error = f"unknown tool {name!r}; the tools are: {', '.join(tools) or 'none'}"
        else:
            error = _misfit(name, fn, arguments)
        if error is None:
            with watchdog.watching(f"tool {name}", f"tool {name!r}", HANG_HINT):
                start = time.perf_counter()
                result, error = _call(name, fn, arguments, timeout)
            watchdog.record(f"tool {name}", time.perf_counter() - start)
        if error is None:
            result, error = _as_text(name, result)
        if error is not None:
            failures += 1
            messages.append(error_message(name, error))
        else:
            messages.append({"role": "tool", "name": name, "content": result})
    return messages, failures


def _misfit(name: str, fn: Callable, arguments: dict) -> Optional[str]:
    """Why `arguments` cannot be passed to `fn` (before it runs, so that a TypeError inside the tool
    is not taken for one); None when they fit."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(**arguments)
    except TypeError as e:
        plain = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                  return_annotation=signature.empty)
        return f"the arguments do not fit {name}{plain}: {e}"
    return None


def _call(name: str, fn: Callable, arguments: dict, timeout: Optional[float]) -> tuple[object, Optional[str]]:
    """(result, None), or (None, what went wrong): fn(**arguments) in a daemon thread, an async
    tool run to completion there. Whatever the tool raises, SystemExit and KeyboardInterrupt
    included, is the tool's failure."""
    def work():
        result = asyncio.run(fn(**arguments)) if is_async(fn) else fn(**arguments)
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    finished = in_thread(work, timeout, f"tool-{name}")
    if not finished.done:
        return None, f"{name} did not finish within {timeout:g} s"
    if finished.error is not None:
        return None, f"{name} raised {first_line(finished.error)}"
    return finished.result, None


def _as_text(name: str, result) -> tuple[Optional[str], Optional[str]]:
    """(the tool message's content, None), or (None, why the result cannot be shown as text): text
    as it is, a dict or list as JSON (str() where it is not JSON), anything else as str() gives it."""
    if isinstance(result, str):
        return result, None
    try:
        if isinstance(result, (dict, list)):
            try:
                return json.dumps(result), None
            except (TypeError, ValueError):
                pass
        return str(result), None
    except Exception as e:  # noqa: BLE001 - a user's __str__, or an int too long to print
        return None, f"{name} returned a {type(result).__name__} that cannot be shown as text ({first_line(e)})"
