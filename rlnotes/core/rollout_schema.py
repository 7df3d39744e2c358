"""The rollout section of the typed config schema (rlnotes.core.schema): how completions and
multi-turn episodes are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class RolloutConfig:
    # Completion tokens at most; a completion that reaches it counts as truncated. A completion ends
    # at the tokenizer's EOS or at any EOS id the model's generation config lists (as TRL's and
    # transformers' generate end it).
    max_new_tokens: int = 16
    # The sampling temperature; log-probs divide by it, in sampling and in the loss alike.
    temperature: float = 1.0
    # The nucleus sampling mass; 1 samples from the full distribution.
    top_p: float = 1.0
    # Draw each completion's tokens from random numbers keyed by (seed, step, the prompt's place in
    # the global batch, its sample number), so a completion does not depend on which prompts share
    # its batch or its process: 1 and N processes then sample the same completions. null = on when
    # several processes train (torchrun), off with one (a single random stream).
    per_prompt_seed: Optional[bool] = None
    # Sample with each LoRA layer's update merged into a copy of its float32 weight, W + (alpha/r) B A:
    # one matmul per layer instead of three (the same outputs up to rounding), for the adapted layers'
    # weights in extra memory while sampling; over a bf16 weight (hardware.precision=bf16), where the
    # update would round away, the adapter's sum without peft's Python around it. false samples
    # through the adapter as it trains.
    merge_adapter: bool = True
    # Sample with copies of the large float32 linear layers' weights (the merged ones among them; not
    # on an Intel CPU, where MKL is as fast), and bf16 ones where oneDNN has bf16, reordered for
    # oneDNN's matmul, on the CPU (rlnotes.engine.policy.packed): the same outputs up to rounding,
    # faster generation, for those weights' size again in memory while sampling. false: torch's
    # default matmul (MKL).
    pack_weights: bool = True
    # Decode Llama, Qwen2 and Mistral models with rlnotes' own step (rlnotes.engine.sampling.decoder: the
    # layers' math as plain tensor operations) rather than the model's forward: the same logits up
    # to float32 rounding, without the Python around each call of the model's forward. false: the
    # model's forward.
    fast_decode: bool = True
    # What samples: hf (a generate loop over the policy itself, in this process; the default) or
    # vllm (a vLLM engine on this process's GPU, pip extra vllm; LoRA only: each step the adapter,
    # not merged weights, goes to vLLM, and the trainer recomputes its own log-probs of the samples).
    engine: str = "hf"
    # The share of the GPU's memory vLLM may take (rollout.engine=vllm): its weights and KV cache;
    # training keeps the rest.
    vllm_gpu_memory: float = 0.3
    # The cap C of min(pi_trainer / pi_vllm, C); null = no correction. rollout.engine=vllm: truncated
    # importance sampling (Yao et al. 2025, who use C = 2) weights each token's policy-gradient term by
    # it, correcting for vLLM's numerics differing from the trainer's; the mismatch is logged either way.
    tis_cap: Optional[float] = None
    # Model turns per episode; 1 = one completion per prompt. Multi-turn episodes (rollout=multi_turn;
    # rlnotes.engine.sampling.episodes): turns of at most max_new_tokens each, with tool results or the
    # environment's replies between them; rollout.tools and rollout.env need at least 2 (multi_turn sets 4).
    max_turns: int = 1
    # Tools the model may call: built-in names (calculator) or your functions, 'pkg.module:fn' or
    # 'path/to/tools.py:fn', typed and with a docstring (their JSON schemas come from the signature).
    tools: List[str] = field(default_factory=list)
    # An environment, one instance per episode: a built-in name (letters) or 'pkg.module:Class' /
    # 'path/to/env.py:Class' with reset(**row), and step(action) -> (observation, reward, done) or,
    # as TRL's environment_factory takes, public methods that become tools and get_reward(). Or a
    # mapping of names to environments, as TRL's environment_factory takes a dict: each row names its
    # own in its `environment` column, and its episodes see that environment's tools alone
    # (rlnotes.agents.routing).
    env: Any = None
    # How rollout.env's class is read: gym (step-style: the model's reply goes to step(action), which
    # returns (observation, reward, done)), tools (TRL's environment_factory: every public method but
    # reset and get_reward is a tool, step included), or auto: tools unless the class has a step that
    # TRL could not offer as a tool (a parameter without a type hint or without a line in a Google-style
    # docstring's Args:) or that is annotated to return a tuple. Decided before the model loads.
    env_style: str = "auto"
    # Tool calls an episode may make; calls past it get an error message and end the episode.
    max_tool_calls: int = 8
    # Tokens of an episode after its prompt; null = only the turns bound it. The model's and the
    # observations' together; an observation that does not fit ends the episode (truncated).
    max_episode_tokens: Optional[int] = None
    # How tool calls are written: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>)
    # or your parser 'pkg.module:fn' (text -> list of {"name", "arguments"}).
    tool_format: str = "hermes"
    # Seconds a tool call may take; null = no limit. Past it the model gets an error message.
    tool_timeout: Optional[float] = 10.0
    # Seconds a call of the environment (its creation, reset, step or get_reward) may take; null =
    # no limit. Past it the run stops with one line naming the call (a call still running long
    # after its usual time is named either way).
    env_timeout: Optional[float] = None
