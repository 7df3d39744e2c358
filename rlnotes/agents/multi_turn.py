"""Multi-turn episodes as conversations: the run's tools and environments (MultiTurn; several that
rows choose among: rlnotes.agents.routing), which runs a batch's episodes through the sampler's
episode loop (rlnotes.engine.sampling.episodes), and the batch's conversations (Conversations):
the prompt each episode starts from, the tokens of every observation between the model's turns,
and what reward functions, which score each whole episode with the environment's own reward, and
the samples table see afterwards.

Tokens. The model's turns are trained on as sampled, each ending with its EOS; an observation's
tokens are what the chat template adds to the conversation when it follows the model's message
(rlnotes.agents.rendering, which demonstrations share). So an episode's token sequence is the
template's rendering of the whole conversation, except where the model's sampled tokens spell its
text differently from how the tokenizer would (the tokens trained on are always the ones sampled).
Without a chat template (model.chat_template false, or a tokenizer without one) the conversation is
"role: content" lines, as rlnotes.engine.prompts.render_plain writes a prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import torch

from rlnotes.agents.environments import EnvironmentFailure, Episode
from rlnotes.agents.routing import COLUMN, environment_of, load_environments, per_environment
from rlnotes.agents.rendering import Renderer
from rlnotes.agents.tools import load_tools
from rlnotes.core.errors import ConfigError
from rlnotes.engine.hardware import distributed
from rlnotes.engine.model.loading import context_length
from rlnotes.engine.prompts import PromptFormat, as_messages
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.episodes import generate_episodes
from rlnotes.engine.sampling.settings import EpisodeLimits, SamplingSettings
from rlnotes.rewards.watchdog import Watchdog

if TYPE_CHECKING:
    from rlnotes.rewards.scoring import Rewards


@dataclass(frozen=True)
class MultiTurn:
    """The multi-turn side of a run (rollout.tools / rollout.env): its tools and environments, loaded
    once, how their calls are made (the rollout section's tool and environment keys), and how long an
    episode may run (limits); it runs a batch's episodes. `envs`: {} without an environment, {None:
    factory} for one, {name: factory} for rollout.env's mapping, whose names the rows choose among."""
    tools: tuple
    envs: Dict[Optional[str], Callable]
    limits: EpisodeLimits
    max_tool_calls: int
    tool_format: str
    tool_timeout: Optional[float]
    env_timeout: Optional[float] = None
    env_style: str = "auto"   # rollout.env_style: how the environment's class is read
    # Names the environment's and tools' calls that run far past their usual time; one for the run,
    # so that its usual times are the run's.
    watchdog: Watchdog = field(default_factory=Watchdog, compare=False)

    @classmethod
    def of(cls, rollout, scored: bool = False) -> Optional["MultiTurn"]:
        """The multi-turn side of the rollout section, or None when a run has neither tools nor an
        environment (single turn); `scored` (reward=env): each environment must give a reward."""
        if not rollout.tools and not rollout.env:
            return None
        tools = tuple(load_tools(list(rollout.tools)))
        envs = load_environments(rollout.env, rollout.env_style, scored)
        return cls(tools, envs, EpisodeLimits.of(rollout), rollout.max_tool_calls, rollout.tool_format,
                   rollout.tool_timeout, rollout.env_timeout, rollout.env_style)

    @property
    def names(self) -> List[str]:
        """The environments rows choose among (rollout.env's mapping); [] when every row has the same
        one, or none."""
        return [name for name in self.envs if name is not None]

    def environment_of(self, row: dict, where: str) -> Optional[str]:
        """The name of the environment `row` chose (None when there is nothing to choose); a row that
        names none of them is a ConfigError beginning with `where`."""
        return environment_of(row, self.names, where) if self.names else None

    def schemas(self, name: Optional[str] = None) -> List[dict]:
        """The JSON schemas of the tools of an episode in environment `name` (its methods included),
        as the episodes describe them to the model."""
        return self.episode(name).schemas

    def episode(self, name: Optional[str] = None) -> Episode:
        """An episode in environment `name` (None: the one environment, or none)."""
        return Episode(list(self.tools), self.envs.get(name), self.max_tool_calls, self.tool_format, self.tool_timeout,
                       self.env_timeout, self.watchdog, self.env_style)

    def run_episodes(self, model, tokenizer, rows: Sequence[dict], group_size: int, sampling: SamplingSettings,
                     prompt_format: PromptFormat, generator: Optional[torch.Generator] = None,
                     seeds: Optional[torch.Tensor] = None, engine=None) -> tuple[Conversations, Rollout]:
        """`group_size` episodes per row (each row's next to each other), each turn sampled as
        `sampling` says and the episode as long as `limits` allow: (their conversations, the rollout
        of their compacted token sequences). `engine`: a vLLM engine that samples instead of the
        model (rollout.engine=vllm; the rollout then carries its log-probs as sampler_logprobs, for
        the trainer to recompute its own)."""
        conversations = Conversations(self, tokenizer, rows, group_size, prompt_format)
        prompts, shared = conversations.prompt_ids()
        conversations.check_fit(prompts, shared, context_length(model), sampling.max_new_tokens)
        if engine is not None:
            rollout = engine.generate_episodes(prompts, shared, conversations.respond, self.limits, seeds,
                                               next(model.parameters()).device)
        else:
            rollout = generate_episodes(model, tokenizer, prompts, shared, conversations.respond, sampling,
                                        self.limits, generator, seeds=seeds)
        rollout.texts = conversations.texts()
        return conversations, rollout


def _with_start(messages: List[dict], start) -> List[dict]:
    """The prompt after the environment's reset: a string joins the last user message (as TRL
    appends it), a list of messages follows the prompt."""
    if start is None:
        return messages
    if isinstance(start, str):
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            return messages + [{"role": "user", "content": start}]
        return messages[:last] + [{**messages[last], "content": messages[last]["content"] + start}] + messages[last + 1:]
    return messages + [dict(m) for m in start]


class Conversations:
    """One batch of episodes, G per row: their environments, conversations and tool counters.
    `respond` is what rlnotes.engine.sampling.episodes.generate_episodes calls between turns."""

    def __init__(self, multi_turn: MultiTurn, tokenizer, rows: Sequence[dict], group_size: int,
                 prompt_format: PromptFormat = PromptFormat()):
        self.multi_turn, self.tokenizer, self.group_size = multi_turn, tokenizer, group_size
        # Each episode's environment, by name (None: the run's one, or none), its row's choice.
        self.env_names = [multi_turn.environment_of(row, f"row {k + 1} of the batch") for k, row in enumerate(rows)
                          for _ in range(group_size)]
        self.episodes = [multi_turn.episode(name) for name in self.env_names]
        # The episodes of one environment have the same tools (its methods are bound to each instance,
        # their schemas alike): described, and rendered, alike.
        renderers = {name: Renderer.of(tokenizer, prompt_format.chat_template,
                                       self.episodes[self.env_names.index(name)].schemas)
                     for name in dict.fromkeys(self.env_names)}
        self.renderers = [renderers[name] for name in self.env_names]   # each episode's
        self.messages: List[List[dict]] = []
        self.reset_added: List[bool] = []   # whether the environment's reset added to each episode's prompt
        self.env_scores: Optional[torch.Tensor] = None   # the environments' rewards, once scored
        for i, episode in enumerate(self.episodes):
            row = rows[i // group_size]
            start = episode.start({k: v for k, v in row.items() if k != COLUMN} if multi_turn.names else row)
            messages = _with_start(as_messages(row["prompt"], prompt_format.system_prompt), start)
            self.messages.append(self.renderers[i].prompt_messages(messages))
            self.reset_added.append(bool(start))
        self.prompt_lengths = [len(m) for m in self.messages]

    # -- rendering (rlnotes.agents.rendering) ----------------------------------------------------------

    def prompt_ids(self) -> tuple[List[List[int]], int]:
        """The token ids episodes start from and how many episodes share each: one entry per row
        (G each) when an environment's reset left the G prompts of every row alike, else one per episode."""
        ids = [renderer.prompt_ids(m) for renderer, m in zip(self.renderers, self.messages)]
        g = self.group_size
        if all(ids[i] == ids[i - i % g] for i in range(len(ids))):
            return ids[::g], g
        return ids, 1

    def check_fit(self, prompt_ids: List[List[int]], shared: int, context: Optional[int], max_new_tokens: int) -> None:
        """Stop, in one line, on an episode whose prompt (`prompt_ids`, one per `shared` episodes)
        and one whole turn would not fit the model's `context` positions: an environment's reset
        text, or the tools' descriptions, made it longer than the data's prompt the data checks saw."""
        for k, ids in enumerate(prompt_ids):
            if context is None or len(ids) + max_new_tokens <= context:
                continue
            i = k * shared
            over = (f"{len(ids)} tokens; with rollout.max_new_tokens={max_new_tokens} it exceeds the model's {context} "
                    "positions")
            if self.reset_added[i]:
                raise EnvironmentFailure(f"environment {type(self.episodes[i].env).__name__}.reset made episode {i}'s "
                                         f"prompt {over}; make what reset returns shorter")
            raise ConfigError(f"episode {i}'s prompt is {over} (the tools' descriptions included); shorten the "
                              "prompts (data.max_prompt_len) or the tools' docstrings, or use a model with more "
                              "positions (the tiny model: model.tiny.max_positions)")

    # -- between turns -----------------------------------------------------------------------------

    def respond(self, rows: List[int], turns: List[List[int]], last: List[bool]) -> List[Optional[List[int]]]:
        """The observations after the turns the model just took (rlnotes.engine.sampling.episodes.Respond)."""
        out: List[Optional[List[int]]] = []
        for i, turn, final in zip(rows, turns, last):
            text = self.tokenizer.decode(turn, skip_special_tokens=True)
            self.messages[i].append({"role": "assistant", "content": text})
            episode = self.episodes[i]
            if final and not episode.step_style:  # nothing would read a tool's result
                out.append(None)
                continue
            observation, done = episode.step(text)
            if done or final or not observation:
                out.append(None)
                continue
            out.append(self.renderers[i].observation_ids(self.messages[i], observation))
            self.messages[i].extend(observation)
        return out

    # -- afterwards --------------------------------------------------------------------------------

    def completions(self) -> List[List[dict]]:
        """Each episode's messages after its prompt: what reward functions get as `completions`."""
        return [m[n:] for m, n in zip(self.messages, self.prompt_lengths)]

    def prompts(self) -> List[List[dict]]:
        """Each episode's prompt as the model saw it, for the samples table and files: the row's
        messages (the system prompt's too) with what the environment's reset added, and the tools'
        descriptions, in the system message or, where the chat template renders them itself, as a
        first "tools" entry holding their schemas."""
        tools = [[{"role": "tools", "content": "\n".join(json.dumps(s) for s in r.schemas)}] if r.template_tools else []
                 for r in self.renderers]
        return [first + [dict(m) for m in messages[:n]]
                for first, messages, n in zip(tools, self.messages, self.prompt_lengths)]

    def texts(self) -> List[str]:
        """Each episode as text for the samples table: its messages after the prompt, role by role."""
        return ["\n".join(f"[{m['role']}] {m['content']}" for m in c) for c in self.completions()]

    def tool_calls(self) -> List[int]:
        """Each episode's tool calls (malformed ones included, as tools/calls counts them)."""
        return [e.tool_calls for e in self.episodes]

    def environments(self) -> List[object]:
        """Each episode's environment instance (None without one): TRL's `environments` keyword."""
        return [e.env for e in self.episodes]

    def env_rewards(self) -> Optional[torch.Tensor]:
        """The environments' rewards [N] (0 for an episode whose environment gave none), or None
        when there is no environment."""
        if not self.multi_turn.envs:
            return None
        return torch.tensor([float(r) if (r := e.reward()) is not None else 0.0 for e in self.episodes])

    def _counters(self, rollout: Rollout) -> torch.Tensor:
        """Each episode's model turns, tokens of the model and of the observations, tool calls and
        failed calls [N, 5]."""
        model = rollout.completion_mask.sum(-1).double().cpu()
        turns = [sum(m["role"] == "assistant" for m in c) for c in self.completions()]
        return torch.stack([torch.tensor(turns, dtype=torch.float64), model,
                            rollout.real.sum(-1).double().cpu() - model,
                            torch.tensor(self.tool_calls(), dtype=torch.float64),
                            torch.tensor([e.tool_failures for e in self.episodes], dtype=torch.float64)], 1)

    def metrics(self, rollout: Rollout) -> Dict[str, float]:
        """episode/turns, episode/model_tokens and episode/env_tokens (means per episode),
        tools/calls (per episode) and tools/failure_frac (of the calls)."""
        turns, model, env, calls, failures = self._counters(rollout).mean(0).tolist()
        return {"episode/turns": turns, "episode/model_tokens": model, "episode/env_tokens": env,
                "tools/calls": calls, "tools/failure_frac": failures / calls if calls else 0.0}

    def environment_metrics(self, rollout: Rollout, totals: torch.Tensor) -> Dict[str, float]:
        """env/NAME/... of each environment of rollout.env's mapping (rlnotes.agents.routing.
        per_environment; {} without one) over the global batch: every rank's scored episodes, their
        rewards `totals`, gathered (so every rank calls it, after `score`)."""
        names = self.multi_turn.names
        if not names:
            return {}
        index = torch.tensor([names.index(name) for name in self.env_names], dtype=torch.float64)
        episodes = torch.cat([index[:, None], totals.detach().double().cpu()[:, None],
                              self.env_scores.double()[:, None], self._counters(rollout)], 1)
        return per_environment(names, distributed.gather_rows(episodes))

    def _fallback(self, rewards: Rewards, env: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The environments' rewards with reward.fallback for each NaN or inf one, and how many were:
        each environment's apart (Rewards.fallback_for), so that one that gives no finite reward stops
        the run by its name, whatever the others give."""
        out, failed = env.clone(), 0
        for name in dict.fromkeys(self.env_names):
            mine = torch.tensor([n == name for n in self.env_names])
            cls = type(self.episodes[self.env_names.index(name)].env).__name__
            out[mine], bad = rewards.fallback_for(f"environment {cls}" if name is None else
                                                  f"environment {name} ({cls})", env[mine])
            failed += bad
        return out, failed

    def score(self, rewards: Rewards, rows: Sequence[dict], rollout: Rollout) -> tuple[torch.Tensor, Dict[str, float]]:
        """Each episode's reward (the episodes of `rows`, sampled as `rollout`): the reward functions'
        weighted sum over its messages after the prompt (TRL's `completions` of a multi-turn rollout,
        with `environments`), plus its environment's reward (weight 1, logged as reward/env; a NaN or
        inf one gets reward.fallback and counts in reward/failures, as a function's does). Metrics:
        the rewards', and the episodes' own."""
        totals, metrics = rewards.score_groups(rows, self.completions(), rollout.token_lists(), self.group_size,
                                               environments=self.environments())
        env = self.env_rewards()
        if env is not None:
            env, failed = self._fallback(rewards, env)
            self.env_scores = env
            totals = totals + env
            metrics["reward/env"] = float(env.mean())
            metrics["reward/failures"] += failed
        return totals, {**metrics, **self.metrics(rollout)}
