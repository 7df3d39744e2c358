"""Multi-turn episodes as conversations: the run's tools and environment (MultiTurn), which runs a
batch's episodes through the sampler's episode loop (rlnotes.engine.sampling.episodes), and the
batch's conversations (Conversations): the prompt each episode starts from, the tokens of every
observation between the model's turns, and what reward functions, which score each whole episode
with the environment's own reward, and the samples table see afterwards.

Tokens. The model's turns are trained on as sampled, each ending with its EOS. An observation's
tokens are what the chat template adds to the conversation when the observation follows the
model's message: the template's rendering of [conversation + observation + the cue of the next
assistant turn] after the end of the model's turn (its EOS) in the rendering of the conversation
alone. So an episode's token sequence is the template's rendering of the whole conversation,
except where the model's sampled tokens spell its text differently from how the tokenizer would
(the tokens trained on are always the ones sampled). Without a chat template (model.chat_template
false, or a tokenizer without one) the conversation is "role: content" lines, as
rlnotes.engine.prompts.render_plain writes a prompt, and each model turn ends with its EOS token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import torch

from rlnotes.agents.environments import EnvironmentFailure, Episode, load_environment
from rlnotes.agents.tools import load_tools, template_takes_tools, tools_system_prompt
from rlnotes.core.errors import ConfigError
from rlnotes.engine.model.loading import context_length
from rlnotes.engine.prompts import PromptFormat, as_messages, render_plain
from rlnotes.engine.rollout import Rollout
from rlnotes.engine.sampling.episodes import generate_episodes
from rlnotes.engine.sampling.settings import EpisodeLimits, SamplingSettings
from rlnotes.rewards.watchdog import Watchdog

if TYPE_CHECKING:
    from rlnotes.rewards.scoring import Rewards


@dataclass(frozen=True)
class MultiTurn:
    """The multi-turn side of a run (rollout.tools / rollout.env): its tools and environment, loaded
    once, how their calls are made (the rollout section's tool and environment keys), and how long an
    episode may run (limits); it runs a batch's episodes."""
    tools: tuple
    env_factory: Optional[Callable]
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
    def of(cls, rollout) -> Optional["MultiTurn"]:
        """The multi-turn side of the rollout section, or None when a run has neither tools nor an
        environment (single turn)."""
        if not rollout.tools and not rollout.env:
            return None
        tools = tuple(load_tools(list(rollout.tools)))
        env = load_environment(rollout.env, rollout.env_style) if rollout.env else None
        return cls(tools, env, EpisodeLimits.of(rollout), rollout.max_tool_calls, rollout.tool_format,
                   rollout.tool_timeout, rollout.env_timeout, rollout.env_style)

    def episode(self) -> Episode:
        return Episode(list(self.tools), self.env_factory, self.max_tool_calls, self.tool_format, self.tool_timeout,
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


def _with_tools(messages: List[dict], schemas: List[dict]) -> List[dict]:
    """The tools described in the system message, for a template that does not render them."""
    block = tools_system_prompt(schemas)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}] + messages[1:]
    return [{"role": "system", "content": block}] + messages


class Conversations:
    """One batch of episodes, G per row: their environments, conversations and tool counters.
    `respond` is what rlnotes.engine.sampling.episodes.generate_episodes calls between turns."""

    def __init__(self, multi_turn: MultiTurn, tokenizer, rows: Sequence[dict], group_size: int,
                 prompt_format: PromptFormat = PromptFormat()):
        self.multi_turn, self.tokenizer, self.group_size = multi_turn, tokenizer, group_size
        self.templated = bool(prompt_format.chat_template and tokenizer.chat_template)
        self.episodes = [multi_turn.episode() for _ in range(len(rows) * group_size)]
        # Every episode has the same tools (its environment's methods are bound to it, their schemas alike).
        schemas = self.episodes[0].schemas if self.episodes else []
        self.template_tools = schemas if (schemas and self.templated and template_takes_tools(tokenizer)) else None
        self.messages: List[List[dict]] = []
        self.reset_added: List[bool] = []   # whether the environment's reset added to each episode's prompt
        for i, episode in enumerate(self.episodes):
            row = rows[i // group_size]
            start = episode.start(row)
            messages = _with_start(as_messages(row["prompt"], prompt_format.system_prompt), start)
            if schemas and self.template_tools is None:
                messages = _with_tools(messages, schemas)
            self.messages.append(messages)
            self.reset_added.append(bool(start))
        self.prompt_lengths = [len(m) for m in self.messages]

    # -- rendering ---------------------------------------------------------------------------------

    def _render(self, messages: List[dict], generation: bool) -> str:
        extra = {"tools": self.template_tools} if self.template_tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra)

    def prompt_ids(self) -> tuple[List[List[int]], int]:
        """The token ids episodes start from and how many episodes share each: one entry per row
        (G each) when an environment's reset left the G prompts of every row alike, else one per episode."""
        if self.templated:
            ids = [self.tokenizer(self._render(m, True), add_special_tokens=False)["input_ids"] for m in self.messages]
        else:
            ids = [self.tokenizer(render_plain(m), add_special_tokens=False)["input_ids"] for m in self.messages]
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
                              "prompts (data.max_prompt_len) or the tools' docstrings")

    def _observation_ids(self, i: int, observation: List[dict]) -> List[int]:
        """The tokens that follow episode i's last model turn (module docstring)."""
        if not self.templated:
            text = "".join(f"\n{m['role']}: {m['content']}" for m in observation) + "\nassistant:"
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        before = self._render(self.messages[i], generation=False)
        after = self._render(self.messages[i] + observation, generation=True)
        eos = self.tokenizer.eos_token or ""
        cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        if after[:cut] != before[:cut]:
            raise ValueError("the chat template renders a conversation's earlier turns differently once an "
                             "observation follows them; multi-turn episodes need a template that only appends")
        return self.tokenizer(after[cut:], add_special_tokens=False)["input_ids"]

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
            out.append(self._observation_ids(i, observation))
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
        tools = [{"role": "tools", "content": "\n".join(json.dumps(s) for s in self.template_tools)}] \
            if self.template_tools else []
        return [tools + [dict(m) for m in messages[:n]] for messages, n in zip(self.messages, self.prompt_lengths)]

    def texts(self) -> List[str]:
        """Each episode as text for the samples table: its messages after the prompt, role by role."""
        return ["\n".join(f"[{m['role']}] {m['content']}" for m in c) for c in self.completions()]

    def environments(self) -> List[object]:
        """Each episode's environment instance (None without one): TRL's `environments` keyword."""
        return [e.env for e in self.episodes]

    def env_name(self) -> str:
        """The environment's class name, for messages."""
        return type(self.episodes[0].env).__name__ if self.episodes else "?"

    def env_rewards(self) -> Optional[torch.Tensor]:
        """The environments' rewards [N] (0 for an episode whose environment gave none), or None
        when there is no environment."""
        if self.multi_turn.env_factory is None:
            return None
        return torch.tensor([float(r) if (r := e.reward()) is not None else 0.0 for e in self.episodes])

    def metrics(self, rollout: Rollout) -> Dict[str, float]:
        """episode/turns, episode/model_tokens and episode/env_tokens (means per episode),
        tools/calls (per episode) and tools/failure_frac (of the calls)."""
        calls = sum(e.tool_calls for e in self.episodes)
        model = rollout.completion_mask.sum(-1)
        turns = sum(m["role"] == "assistant" for c in self.completions() for m in c)
        return {"episode/turns": turns / len(self.episodes),
                "episode/model_tokens": float(model.mean()),
                "episode/env_tokens": float((rollout.real.sum(-1) - model).mean()),
                "tools/calls": calls / len(self.episodes),
                "tools/failure_frac": sum(e.tool_failures for e in self.episodes) / calls if calls else 0.0}

    def score(self, rewards: Rewards, rows: Sequence[dict], rollout: Rollout) -> tuple[torch.Tensor, Dict[str, float]]:
        """Each episode's reward (the episodes of `rows`, sampled as `rollout`): the reward functions'
        weighted sum over its messages after the prompt (TRL's `completions` of a multi-turn rollout,
        with `environments`), plus the environment's reward (weight 1, logged as reward/env; a NaN or
        inf one gets reward.fallback and counts in reward/failures, as a function's does). Metrics:
        the rewards', and the episodes' own."""
        totals, metrics = rewards.score_groups(rows, self.completions(), rollout.token_lists(), self.group_size,
                                               environments=self.environments())
        env = self.env_rewards()
        if env is not None:
            env, failed = rewards.fallback_for(f"environment {self.env_name()}", env)
            totals = totals + env
            metrics["reward/env"] = float(env.mean())
            metrics["reward/failures"] += failed
        return totals, {**metrics, **self.metrics(rollout)}
