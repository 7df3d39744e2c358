"""A prompt, and how it reaches the model: as chat messages, as plain text for a model without a chat
template, and as token ids. Data, rewards, agents and the sampler share these; nothing here imports
torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

# A prompt: plain text, or a conversation of {"role": ..., "content": ...} messages.
Prompt = Union[str, List[Dict[str, str]]]


def as_messages(prompt: Prompt, system_prompt: Optional[str] = None) -> List[Dict[str, str]]:
    """The prompt as chat messages: text becomes one user turn, and `system_prompt` opens the
    conversation when it has no system turn of its own (the data's own system turn wins)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def tool_call_parts(call) -> Tuple[str, dict]:
    """(name, arguments) of one entry of an assistant message's `tool_calls`, as TRL and the chat
    templates write it: {"type": "function", "function": {"name": ..., "arguments": {...}}}, or the
    {"name", "arguments"} inside; the arguments may be a JSON string of an object. A ValueError says
    what is wrong with it."""
    inner = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
        raise ValueError('a tool call must be {"type": "function", "function": {"name": ..., "arguments": {...}}}')
    arguments = inner.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"the arguments of tool call {inner['name']!r} are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of tool call {inner['name']!r} are not a JSON object")
    return inner["name"], arguments


def render_plain(prompt: Prompt, system_prompt: Optional[str] = None) -> str:
    """The prompt as text for a model without a chat template: text as it is (after the system
    prompt and a blank line, if there is one); a conversation as "role: content" lines and a last
    "assistant:" line that cues the reply."""
    if isinstance(prompt, str):
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    return "\n".join([f"{m['role']}: {m['content']}" for m in as_messages(prompt, system_prompt)] + ["assistant:"])


def encode_prompts(tokenizer, prompts: Sequence[Prompt], chat_template: bool = True,
                   system_prompt: Optional[str] = None) -> List[List[int]]:
    """Token ids of each prompt (text or messages): through the chat template with the generation
    prompt when the tokenizer has one and `chat_template` is on, else as `render_plain` text. The
    empty prompt of a plain-text row ({"text": ...}, trained on whole) is the start of a text: the
    tokenizer's BOS (else its EOS, which ends the text before), no template."""
    def encode(prompt: Prompt) -> List[int]:
        if prompt == "":
            return [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
        if chat_template and tokenizer.chat_template:
            return list(tokenizer.apply_chat_template(as_messages(prompt, system_prompt), add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"])
        return tokenizer(render_plain(prompt, system_prompt), add_special_tokens=False)["input_ids"]

    return [encode(p) for p in prompts]


@dataclass(frozen=True)
class PromptFormat:
    """How a run's prompts reach its model: through the chat template when the tokenizer has one and
    `chat_template` is on (model.chat_template), `system_prompt` opening every conversation that has
    no system turn of its own (data.system_prompt, else model.system_prompt)."""
    chat_template: bool = True
    system_prompt: Optional[str] = None

    def encode(self, tokenizer, prompts: Sequence[Prompt]) -> List[List[int]]:
        """encode_prompts in this format."""
        return encode_prompts(tokenizer, prompts, self.chat_template, self.system_prompt)
