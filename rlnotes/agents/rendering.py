"""How a conversation with tools becomes tokens: the one rendering that multi-turn episodes
(rlnotes.agents.multi_turn) and demonstrations (a `messages` column, which SFT and the SFT warm-up
learn from) share, so that a demonstration is, token for token, the episode that samples its
assistant turns.

A conversation's tokens are [prompt | turn | observation | turn | ...]:
- the prompt: the messages before the first assistant turn, the system prompt and the tools'
  descriptions added, through the chat template with the cue of the assistant's turn;
- an assistant turn: its text as the tokenizer spells it, then EOS, as the model samples it (a
  turn's `tool_calls` are written into its text as the calls the model writes, `hermes_call`);
- an observation: what the template adds to the conversation after the EOS of the turn before when
  the messages that follow (tool results, a user's reply) are appended, up to the cue of the next
  assistant turn (without a chat template: "role: content" lines, as rlnotes.engine.prompts renders).
Only the assistant turns' tokens carry loss (TRL's assistant_only_loss=True).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from rlnotes.agents.tools import template_takes_tools, tools_system_prompt
from rlnotes.engine.prompts import as_messages, render_plain, tool_call_parts


def with_tools(messages: List[dict], schemas: Sequence[dict]) -> List[dict]:
    """The tools described in the system message, for a template that does not render them."""
    block = tools_system_prompt(list(schemas))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}] + messages[1:]
    return [{"role": "system", "content": block}] + messages


@dataclass(frozen=True)
class Renderer:
    """A run's way from messages to tokens: its tokenizer, whether the chat template renders them
    (`templated`; else "role: content" lines), the tools' JSON schemas, and whether the template
    renders those itself (`template_tools`; else they go into the system message)."""
    tokenizer: Any
    templated: bool
    schemas: Tuple[dict, ...] = ()
    template_tools: bool = False

    @classmethod
    def of(cls, tokenizer, chat_template: bool, schemas: Sequence[dict] = ()) -> "Renderer":
        """The rendering of a run whose model.chat_template is `chat_template`, with these tools."""
        templated = bool(chat_template and tokenizer.chat_template)
        return cls(tokenizer, templated, tuple(schemas), bool(schemas) and templated and template_takes_tools(tokenizer))

    def prompt_messages(self, messages: List[dict]) -> List[dict]:
        """The prompt's messages as the model sees them: the tools described in the system message,
        unless the template renders them."""
        return with_tools(messages, self.schemas) if self.schemas and not self.template_tools else messages

    def render(self, messages: List[dict], generation: bool) -> str:
        extra = {"tools": list(self.schemas)} if self.template_tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **extra)

    def prompt_ids(self, messages: List[dict]) -> List[int]:
        """The token ids of a prompt's messages (prompt_messages already applied), ending with the cue
        of the assistant's turn."""
        text = self.render(messages, True) if self.templated else render_plain(messages)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def observation_ids(self, messages: List[dict], observation: List[dict]) -> List[int]:
        """The tokens that follow the last (assistant) turn of `messages` when `observation` follows
        it: the template's rendering of [messages + observation + the cue of the next assistant
        turn] after the end of that turn (its EOS) in the rendering of `messages` alone."""
        if not self.templated:
            text = "".join(f"\n{m['role']}: {m['content']}" for m in observation) + "\nassistant:"
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        before = self.render(messages, generation=False)
        after = self.render(messages + observation, generation=True)
        eos = self.tokenizer.eos_token or ""
        cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        if after[:cut] != before[:cut]:
            raise ValueError("the chat template renders a conversation's earlier turns differently once an "
                             "observation follows them; multi-turn episodes need a template that only appends")
        return self.tokenizer(after[cut:], add_special_tokens=False)["input_ids"]


def hermes_call(name: str, arguments: dict) -> str:
    """A call as the model writes it in the hermes format (rollout.tool_format=hermes), the form the
    tools' system prompt shows: <tool_call>, a line of JSON, </tool_call>."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def assistant_text(message: dict) -> str:
    """The text of an assistant turn as the model writes it: its content, then each of its
    `tool_calls` (TRL's {"type": "function", "function": {"name", "arguments"}}) as a hermes block."""
    calls = [hermes_call(*tool_call_parts(call)) for call in message.get("tool_calls") or []]
    return "\n".join(([message["content"]] if message.get("content") else []) + calls)


def conversation_tokens(renderer: Renderer, messages: List[dict],
                        system_prompt: Optional[str] = None) -> Tuple[List[int], List[int], List[float]]:
    """(prompt ids, the ids after the prompt, their loss mask: 1.0 on the assistant turns' tokens, their
    EOS included, 0.0 on the observations') of a conversation with at least one assistant turn (see
    the module docstring); `system_prompt` opens it when it has no system turn. Messages after the
    last assistant turn are left out: nothing after them is trained on."""
    roles = [m["role"] for m in messages]
    first, last = roles.index("assistant"), len(roles) - 1 - roles[::-1].index("assistant")
    context = renderer.prompt_messages(as_messages(messages[:first], system_prompt))
    prompt = renderer.prompt_ids(context)
    tokenizer, ids, mask, i = renderer.tokenizer, [], [], first
    while i <= last:
        turn = tokenizer(assistant_text(messages[i]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + turn, mask + [1.0] * len(turn)
        # The conversation goes on as an episode's does: with the text of the tokens the model wrote.
        context = context + [{"role": "assistant", "content": tokenizer.decode(turn, skip_special_tokens=True)}]
        i += 1
        if i > last:
            break
        j = next(k for k in range(i, last + 1) if roles[k] == "assistant")
        observation = [dict(m) for m in messages[i:j]]
        between = renderer.observation_ids(context, observation)
        ids, mask, context, i = ids + between, mask + [0.0] * len(between), context + observation, j
    return prompt, ids, mask
