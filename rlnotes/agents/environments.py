"""Environments and the episode: what happens between two turns of the model.

A user's environment (`rollout.env`) is a class whose instance lives for one episode. Two kinds
are read, close to the libraries users port from:

- TRL-style (TRL's `environment_factory`): `reset(**row)` and public methods that the model calls
  as tools (each with type hints and a Google-style docstring); `get_reward()` may score the
  episode. Its episode ends when the model writes no tool call.
- step-style (gym, OpenEnv): `reset(**row)` and `step(action) -> (observation, reward, done)` (or
  an object with `.observation`, `.reward`, `.done`, as OpenEnv's StepResult); the model's reply is
  the action, the observation comes back as a user message, and the step rewards add up.

`Episode` gives both, and tools without an environment, one face: `start(row)`, `step(text)`,
`reward()`, with counters of turns, tool calls and their failures.
"""

from __future__ import annotations

import numbers
from typing import Callable, Dict, List, Optional, Tuple, Union

from rlnotes.agents.builtin import ENVIRONMENTS
from rlnotes.agents.tools import error_message, parse_tool_calls, run_tool_calls, tool_parser, tool_schema
from rlnotes.core.errors import ConfigError
from rlnotes.rewards.loading import accepted_names, first_line, resolve_callable

# Methods of a TRL-style environment that the model never calls as tools.
NOT_TOOLS = ("reset", "step", "get_reward")


class EnvironmentFailure(RuntimeError):
    """The user's environment raised or returned something that cannot be read: a bug in the
    environment, unlike a failed tool call (the model's), which the model is told about."""


def load_environment(spec: str) -> Callable[[], object]:
    """The factory (a class or zero-argument callable) that `rollout.env` names: a built-in
    (`rlnotes.agents.builtin.ENVIRONMENTS`) or 'pkg.module:Class' / 'path/to/env.py:Class'. One
    instance is made here, as TRL does, to check before a model loads that it has a `reset` and
    that the methods the model would call can be described to it."""
    factory = resolve_callable(spec, ENVIRONMENTS, "rollout.env: environment", ("envs", "MyEnv"))
    try:
        env = factory()
    except Exception as e:  # noqa: BLE001 - the user's constructor may raise anything
        raise ConfigError(f"rollout.env: environment {spec!r} could not be created with no arguments "
                          f"({first_line(e)}); give every argument of its __init__ a default") from None
    if not callable(getattr(env, "reset", None)):
        raise ConfigError(f"rollout.env: environment {spec!r} ({type(env).__name__}) has no reset method; define "
                          "reset(self, **row) returning None, a string or a list of messages")
    for method in env_tools(env).values():
        tool_schema(method, "rollout.env")
    return factory


def env_tools(env) -> Dict[str, Callable]:
    """The methods of a TRL-style environment that the model may call, bound to `env`: its public
    ones but reset, step and get_reward. A step-style environment (one with `step`) has none."""
    if callable(getattr(env, "step", None)):
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


class Episode:
    """One episode: the environment's instance (`env`, None without one), the tools the model may
    call, and the counters `turns`, `tool_calls`, `tool_failures`.

    At most `max_tool_calls` calls run in an episode; the calls past it are answered with an error
    and end the episode. `tool_format` is how calls are written (`parse_tool_calls`), and
    `tool_timeout` the seconds a call may take (None: no limit). Every call the model writes counts
    in `tool_calls`, malformed and refused ones too, and each of those in `tool_failures`, so that
    failures / calls is the share of the model's calls that gave no result."""

    def __init__(self, tools: List[Callable], env_factory: Optional[Callable], max_tool_calls: int,
                 tool_format: str = "hermes", tool_timeout: Optional[float] = None):
        tool_parser(tool_format)  # an unknown format fails here, before any turn
        try:
            self.env = env_factory() if env_factory is not None else None
        except Exception as e:  # noqa: BLE001 - it was created once when it loaded; now it fails
            raise EnvironmentFailure(f"environment {getattr(env_factory, '__name__', env_factory)!r} could not be "
                                     f"created ({first_line(e)})") from e
        self.max_tool_calls = max_tool_calls
        self.tool_format = tool_format
        self.tool_timeout = tool_timeout
        self.tools: Dict[str, Callable] = {fn.__name__: fn for fn in tools}
        for name, method in env_tools(self.env).items() if self.env is not None else ():
            if name in self.tools:
                raise ConfigError(f"rollout.env: method {name!r} of {type(self.env).__name__} has the name of a "
                                  "tool in rollout.tools; rename one of them")
            self.tools[name] = method
        step = getattr(self.env, "step", None)
        self._env_step = step if callable(step) else None   # a step-style environment's step
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
        kwargs = {k: v for k, v in row.items() if accepts is None or k in accepts}
        result = self._call_env("reset", **kwargs)
        if result is None or isinstance(result, str):
            return result
        return self._messages("reset", result)

    def step(self, text: str) -> Tuple[List[dict], bool]:
        """The model's turn ended with `text`: (the observation messages, whether the episode is
        done). Tool calls in `text` run (then env.step is not called); without a call, a step-style
        environment steps, and any other episode is done."""
        self.turns += 1
        parsed = parse_tool_calls(text, self.tool_format) if self.tools or self._env_step is None else None
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
            raise self._failure("step", f"returned {type(result).__name__}, not (observation, reward, done)")
        if reward is not None and not isinstance(reward, numbers.Real):
            raise self._failure("step", f"returned the reward {reward!r}, not a number or None")
        if reward is not None:
            self._step_rewards.append(float(reward))
        return self._observation(observation), bool(done)

    def reward(self) -> Optional[float]:
        """The environment's reward for the episode: its `get_reward()` when it has one, else the
        sum of its step rewards (None when no step gave one); None without an environment."""
        if self.env is None:
            return None
        if callable(getattr(self.env, "get_reward", None)):
            reward = self._call_env("get_reward")
            if reward is not None and not isinstance(reward, numbers.Real):
                raise self._failure("get_reward", f"returned {reward!r}, not a number or None")
            return None if reward is None else float(reward)
        return sum(self._step_rewards) if self._step_rewards else None

    # -----------------------------------------------------------------------------------------

    def _run_calls(self, calls: List[dict], errors: List[str]) -> Tuple[List[dict], bool]:
        """Tool messages for the malformed calls (`errors`) and the calls run, within the episode's
        budget of calls; past it, an error each, and the episode is done."""
        allowed = max(0, self.max_tool_calls - self.tool_calls)
        entries = [("invalid_tool_call", e) for e in errors] + calls
        kept, over = entries[:allowed], entries[allowed:]
        messages = [error_message(*e) for e in kept if isinstance(e, tuple)]
        ran, failed = run_tool_calls([c for c in kept if isinstance(c, dict)], self.tools, self.tool_timeout)
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
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise self._failure(method, f"returned {type(messages).__name__}; return None, a string or a list of "
                                        'messages like {"role": "user", "content": "..."}')
        return messages

    def _call_env(self, method: str, *args, **kwargs):
        try:
            return getattr(self.env, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a bug in the user's environment, reported as one
            raise self._failure(method, f"raised {first_line(e)}") from e

    def _failure(self, method: str, what: str) -> EnvironmentFailure:
        return EnvironmentFailure(f"environment {type(self.env).__name__}.{method} {what}")
