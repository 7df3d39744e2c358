"""Environments and the episode: what happens between two turns of the model.

A user's environment (`rollout.env`) is a class whose instance lives for one episode. Two kinds
are read, close to the libraries users port from:

- TRL-style (TRL's `environment_factory`): `reset(**row)` and public methods that the model calls
  as tools (each with type hints and a Google-style docstring), every one but `reset` and
  `get_reward`, as TRL takes them: a method named `step` is a tool too (TRL's echo example's is);
  `get_reward()` may score the episode. Its episode ends when the model writes no tool call.
- step-style (gym, OpenEnv): `reset(**row)` and `step(action) -> (observation, reward, done)` (or
  an object with `.observation`, `.reward`, `.done`, as OpenEnv's StepResult); the model's reply is
  the action, the observation comes back as a user message, and the step rewards add up.

`rollout.env_style` says which (gym or tools), or auto decides by the class's `step`
(`is_step_style`), when the environment loads, before the model does.

`Episode` gives both, and tools without an environment, one face: `start(row)`, `step(text)`,
`reward()`, with counters of turns, tool calls and their failures. The environment gets its own
copies of the row's values (as reward functions do), and the conversation its own copies of the
messages the environment returns. Each call of the environment (its creation, reset, step and
get_reward) is bounded by `rollout.env_timeout` and watched (rlnotes.rewards.watchdog); whatever
goes wrong in one (an exception of any kind but KeyboardInterrupt, no answer in time, a result that
cannot be read) is an EnvironmentFailure naming the method.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import time
import typing
from typing import Callable, Dict, List, Optional, Tuple, Union

from rlnotes.agents.builtin import ENVIRONMENTS
from rlnotes.agents.tools import error_message, parse_tool_calls, run_tool_calls, tool_parser, tool_schema
from rlnotes.core.errors import ConfigError
from rlnotes.core.user_code import accepted_names, first_line, resolve_callable
from rlnotes.rewards.watchdog import Finished, Watchdog, in_thread

# Methods of a TRL-style environment that the model never calls as tools: TRL's reserved two.
NOT_TOOLS = ("reset", "get_reward")
# How the watchdog's line says to bound an environment's calls.
HANG_HINT = "rollout.env_timeout=SECONDS bounds its calls; Ctrl-C stops the run and says how to resume"


class EnvironmentFailure(RuntimeError):
    """The user's environment raised or returned something that cannot be read: a bug in the
    environment, unlike a failed tool call (the model's), which the model is told about."""


def load_environment(spec: str, style: str = "auto", setting: str = "rollout.env",
                     scored: bool = False) -> Callable[[], object]:
    """The factory (a class or zero-argument callable) that `rollout.env` names (`setting`: the key
    its errors name, rollout.env.NAME in a mapping): a built-in (`rlnotes.agents.builtin.ENVIRONMENTS`)
    or 'pkg.module:Class' / 'path/to/env.py:Class'. One instance is made here, as TRL does, to check
    before a model loads that it has a `reset`, that it is of the `style` (rollout.env_style) asked
    for, that the methods the model would call can be described to it, and (`scored`: reward=env,
    its reward the run's only one) that it gives a reward: get_reward(), or a step-style step's."""
    factory = resolve_callable(spec, ENVIRONMENTS, f"{setting}: environment", ("envs", "MyEnv"))
    try:
        env = factory()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's constructor may raise anything, sys.exit() too
        raise ConfigError(f"{setting}: environment {spec!r} could not be created with no arguments "
                          f"({first_line(e)}); give every argument of its __init__ a default") from None
    if not callable(getattr(env, "reset", None)):
        raise ConfigError(f"{setting}: environment {spec!r} ({type(env).__name__}) has no reset method; define "
                          "reset(self, **row) returning None, a string or a list of messages")
    if style == "gym" and not callable(getattr(env, "step", None)):
        raise ConfigError(f"rollout.env_style=gym: environment {spec!r} ({type(env).__name__}) has no step method; "
                          "define step(self, action) returning (observation, reward, done), or set "
                          "rollout.env_style=tools (its public methods are the model's tools, as in TRL)")
    step_style = is_step_style(env, style)
    if step_style and not _takes_one_argument(env.step):
        raise ConfigError(f"{setting}: environment {spec!r} ({type(env).__name__}) has step{_signature(env.step)}, "
                          "and a step-style environment's step takes the model's turn: define step(self, action) "
                          "returning (observation, reward, done)")
    for method in env_tools(env, step_style).values():
        tool_schema(method, setting)
    if scored and not step_style and not callable(getattr(env, "get_reward", None)):
        raise ConfigError(f"reward=env: {setting} {spec!r} ({type(env).__name__}) gives no reward, so every episode "
                          "would score 0: define get_reward(self) -> float (as TRL scores such an environment; a "
                          "reward attribute is not read) or a step(self, action) returning (observation, reward, "
                          "done), or score the episodes with reward functions (reward=custom reward.target=...)")
    return factory


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):  # a builtin or C method: no signature to show
        return "(...)"


def _takes_one_argument(fn: Callable) -> bool:
    """Whether `fn` (a bound method) can be called with one positional argument."""
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read: let the call say
        return True
    return True


def is_step_style(env, style: str = "auto") -> bool:
    """Whether `env` is read step-style (gym, OpenEnv), not TRL-style, as rollout.env_style says:
    gym, tools, or auto, which goes by the class's `step` method:

    - no `step`: TRL-style;
    - a `step` that TRL could offer the model as a tool, and not annotated to return a tuple:
      TRL-style, `step` being one of the tools (TRL's echo example, `step(self, message: str) -> str`
      with its Args: section). TRL's tools need a type hint and a line in a Google-style docstring's
      Args: section for every parameter; `tool_schema` (transformers' get_json_schema), which
      describes tools to the model, checks exactly that;
    - any other `step` (gym's `step(self, action)`, untyped or without that docstring, or annotated
      `-> Tuple[...]`): step-style.
    """
    if style != "auto":
        return style == "gym"
    step = getattr(env, "step", None)
    if not callable(step):
        return False
    try:
        tool_schema(step)
    except ConfigError:  # not describable as a tool
        return True
    return _returns_tuple(step)


def _returns_tuple(fn: Callable) -> bool:
    """Whether `fn`'s return annotation is a tuple (tuple, Tuple[...], 'tuple[...]' unresolved)."""
    try:
        annotation = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - a string annotation naming what is not importable here
        annotation = inspect.signature(fn).return_annotation
    if isinstance(annotation, str):
        return re.match(r"\s*(typing\.)?[Tt]uple\b", annotation) is not None
    return annotation is tuple or typing.get_origin(annotation) is tuple


def env_tools(env, step_style: bool) -> Dict[str, Callable]:
    """The methods of a TRL-style environment that the model may call, bound to `env`: its public
    ones but reset and get_reward (step included). A step-style environment has none."""
    if step_style:
        return {}
    out = {}
    for name in dir(type(env)):
        if name.startswith("_") or name in NOT_TOOLS or isinstance(getattr(type(env), name), property):
            continue
        method = getattr(env, name)
        if callable(method):
            out[name] = method
    return out


Observation = Optional[Union[str, List[dict]]]


def _shown(value, width: int = 80) -> str:
    """`value` for a message: its repr, cut to `width` characters (its type when it has none)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's __repr__
        return f"<{type(value).__name__}>"
    return text if len(text) <= width else text[:width - 1] + "…"


class Episode:
    """One episode: the environment's instance (`env`, None without one), the tools the model may
    call, and the counters `turns`, `tool_calls`, `tool_failures`.

    At most `max_tool_calls` calls run in an episode; the calls past it are answered with an error
    and end the episode. `tool_format` is how calls are written (`parse_tool_calls`), and
    `tool_timeout` the seconds a call may take (None: no limit); `env_timeout` the seconds a call of
    the environment may take (None: no limit), `watchdog` names the calls that run long (shared by
    the run's episodes, which make the usual times). Every call the model writes counts
    in `tool_calls`, malformed and refused ones too, and each of those in `tool_failures`, so that
    failures / calls is the share of the model's calls that gave no result."""

    def __init__(self, tools: List[Callable], env_factory: Optional[Callable], max_tool_calls: int,
                 tool_format: str = "hermes", tool_timeout: Optional[float] = None,
                 env_timeout: Optional[float] = None, watchdog: Optional[Watchdog] = None, env_style: str = "auto"):
        tool_parser(tool_format)  # an unknown format fails here, before any turn
        self.env_timeout = env_timeout
        self.watchdog = watchdog or Watchdog()
        self.env = None
        if env_factory is not None:  # it was created once when it loaded; it may fail now
            self.env = self._bounded(f"environment {getattr(env_factory, '__name__', env_factory)!r}", env_factory,
                                     creating=True)
        self.max_tool_calls = max_tool_calls
        self.tool_format = tool_format
        self.tool_timeout = tool_timeout
        self.tools: Dict[str, Callable] = {fn.__name__: fn for fn in tools}
        self.env_style = env_style
        self.step_style = self.env is not None and is_step_style(self.env, env_style)
        for name, method in env_tools(self.env, self.step_style).items() if self.env is not None else ():
            if name in self.tools:
                raise ConfigError(f"rollout.env: method {name!r} of {type(self.env).__name__} has the name of a "
                                  "tool in rollout.tools; rename one of them")
            self.tools[name] = method
        self._env_step = self.env.step if self.step_style else None
        self._step_rewards: List[float] = []
        self.turns = self.tool_calls = self.tool_failures = 0

    @property
    def schemas(self) -> List[dict]:
        """The JSON schema of each tool, for the prompt."""
        return [tool_schema(fn) for fn in self.tools.values()]

    def start(self, row: dict) -> Observation:
        """`env.reset` with the dataset row's columns as keywords (those it takes, all when it has
        **kwargs); its result: None, a string to append to the last user message, or messages to
        append after the prompt. None without an environment."""
        if self.env is None:
            return None
        accepts = accepted_names(self.env.reset)
        kwargs = copy.deepcopy({k: v for k, v in row.items() if accepts is None or k in accepts})
        result = self._call_env("reset", **kwargs)
        if result is None or isinstance(result, str):
            return result
        return self._messages("reset", result)

    def step(self, text: str) -> Tuple[List[dict], bool]:
        """The model's turn ended with `text`: (the observation messages, whether the episode is
        done). Tool calls in `text` run (then env.step is not called); without a call, a step-style
        environment steps, and any other episode is done."""
        self.turns += 1
        parsed = self._parsed(text) if self.tools or self._env_step is None else None
        if parsed is not None and (parsed.calls or parsed.errors):
            return self._run_calls(parsed.calls, parsed.errors)
        if self._env_step is None:
            return [], True
        result = self._call_env("step", text)
        if isinstance(result, (tuple, list)) and len(result) == 3:
            observation, reward, done = result
        elif all(hasattr(result, a) for a in ("observation", "reward", "done")):
            observation, reward, done = result.observation, result.reward, result.done
        else:
            hint = ("; if step is a tool the model calls, as in TRL's environment_factory, set rollout.env_style=tools"
                    if self.env_style == "auto" else "")
            raise self._failure("step", f"returned {type(result).__name__}, not (observation, reward, done){hint}")
        reward = self._number("step", reward, "the reward ")
        if reward is not None:
            self._step_rewards.append(reward)
        return self._observation(observation), bool(done)

    def _parsed(self, text: str):
        """The tool calls in `text`; a user's parser (rollout.tool_format) is watched, as it runs on
        every turn."""
        if tool_parser(self.tool_format) is None:
            return parse_tool_calls(text, self.tool_format)
        label = f"rollout.tool_format parser {self.tool_format!r}"
        with self.watchdog.watching(label, label, "Ctrl-C stops the run and says how to resume"):
            return parse_tool_calls(text, self.tool_format)

    def reward(self) -> Optional[float]:
        """The environment's reward for the episode: its `get_reward()` when it has one, else the
        sum of its step rewards (None when no step gave one); None without an environment. NaN
        and inf are kept (Conversations.score gives them reward.fallback)."""
        if self.env is None:
            return None
        if callable(getattr(self.env, "get_reward", None)):
            return self._number("get_reward", self._call_env("get_reward"))
        return sum(self._step_rewards) if self._step_rewards else None

    # -----------------------------------------------------------------------------------------

    def _run_calls(self, calls: List[dict], errors: List[str]) -> Tuple[List[dict], bool]:
        """Tool messages for the malformed calls (`errors`) and the calls run, within the episode's
        budget of calls; past it, an error each, and the episode is done."""
        allowed = max(0, self.max_tool_calls - self.tool_calls)
        entries = [("invalid_tool_call", e) for e in errors] + calls
        kept, over = entries[:allowed], entries[allowed:]
        messages = [error_message(*e) for e in kept if isinstance(e, tuple)]
        ran, failed = run_tool_calls([c for c in kept if isinstance(c, dict)], self.tools, self.tool_timeout,
                                     self.watchdog)
        limit = f"the limit of {self.max_tool_calls} tool calls per episode is reached; this call was not run"
        over_messages = [error_message(e[0] if isinstance(e, tuple) else e["name"], limit) for e in over]
        self.tool_calls += len(entries)
        self.tool_failures += len(messages) + failed + len(over)
        return messages + ran + over_messages, bool(over)

    def _observation(self, observation) -> List[dict]:
        if observation is None:
            return []
        if isinstance(observation, str):
            return [{"role": "user", "content": observation}]
        return self._messages("step", [observation] if isinstance(observation, dict) else observation)

    def _messages(self, method: str, messages) -> List[dict]:
        """The environment's messages, copied (it may edit its own later), each checked to have a
        string role and content."""
        form = 'messages like {"role": "user", "content": "..."}'
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise self._failure(method, f"returned {type(messages).__name__}; return None, a string or a list of "
                                        f"{form}")
        for i, m in enumerate(messages):
            bad = next((k for k in ("role", "content") if not isinstance(m.get(k), str)), None)
            if bad is not None:
                what = "no" if bad not in m else f"a {type(m[bad]).__name__} as its"
                raise self._failure(method, f"returned a message ({i + 1} of {len(messages)}) with {what} {bad!r}; "
                                            f"return {form}")
        return copy.deepcopy(messages)

    def _number(self, method: str, value, what: str = "") -> Optional[float]:
        """None, or `value` as a float (NaN and inf kept; a number too large for a float is inf);
        anything else is a failure of `method`."""
        if value is None:
            return None
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            return float(value)
        except OverflowError:  # not finite either way: it gets reward.fallback
            return math.inf
        except Exception:  # noqa: BLE001 - whatever a user's __float__ raises
            raise self._failure(method, f"returned {what}{_shown(value)}, not a number or None") from None

    def _call_env(self, method: str, *args, **kwargs):
        return self._bounded(f"environment {type(self.env).__name__}.{method}",
                             lambda: getattr(self.env, method)(*args, **kwargs))

    def _bounded(self, label: str, call: Callable[[], object], creating: bool = False):
        """call() within rollout.env_timeout, watched: its result, or an EnvironmentFailure that
        names `label` ("environment Guess.step") and what went wrong (`creating`: the call makes
        the environment). KeyboardInterrupt stops the run as Ctrl-C does."""
        start = time.perf_counter()
        with self.watchdog.watching(label, label, HANG_HINT):
            if self.env_timeout is None:
                try:
                    finished = Finished(call())
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 - a bug in the user's environment, reported as one
                    finished = Finished(error=e)
            else:
                finished = in_thread(call, self.env_timeout, label)
        if isinstance(finished.error, KeyboardInterrupt):
            raise finished.error
        if finished.error is not None:
            why = first_line(finished.error)
            raise EnvironmentFailure(f"{label} could not be created ({why})" if creating else f"{label} raised {why}") \
                from finished.error
        if not finished.done:
            late = f"did not return within rollout.env_timeout={self.env_timeout:g} s"
            raise EnvironmentFailure(f"{label} could not be created (it {late})" if creating else
                                     f"{label} {late}; make it faster or raise the limit")
        self.watchdog.record(label, time.perf_counter() - start)
        return finished.result

    def _failure(self, method: str, what: str) -> EnvironmentFailure:
        return EnvironmentFailure(f"environment {type(self.env).__name__}.{method} {what}")
