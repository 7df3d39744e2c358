"""Checks of single settings that need nothing but the config: a choice among named options, and
the valid range of every numeric setting (RANGES), each failing with one line naming the key."""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Mapping

from omegaconf import OmegaConf

from rlnotes.core.errors import ConfigError

SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda", "auto")
# hardware.strategy: how several processes share a run (see rlnotes.engine.distributed).
STRATEGIES = ("ddp", "fsdp")
# rollout.engine: what samples completions.
ENGINES = ("hf", "vllm")
# sweep.direction: the sense of the objective a sweep optimizes.
DIRECTIONS = ("maximize", "minimize")


def planned_world_size(hardware) -> int:
    """Processes the run will have: torchrun's WORLD_SIZE inside a process it started, else
    hardware.nproc (the processes `rlnotes train` would start)."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return hardware.nproc or 1


def check_choice(key: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")


# ---------------------------------------------------------------------------------------------
# The valid range of every numeric setting, checked in one place (check_ranges) before anything
# loads. ">= a" and "> a" bound one side; "[a, b)" and the like both; every bound is finite, and
# so must the value be. null (where a setting allows it) is never checked. Settings without a
# range here: the seeds (any integer), the reward section (rlnotes.rewards.scoring checks it), and
# CHECKED_ELSEWHERE, whose checks need other settings too.
RANGES: Dict[str, tuple] = {
    "trainer.steps": (">= 1", "optimizer steps"),
    "trainer.batch_size": (">= 1", "prompts, pairs or rows per step"),
    "trainer.micro_batch_size": (">= 1", "completions per forward/backward pass; null = by micro_batch_tokens"),
    "trainer.micro_batch_tokens": (">= 1", "tokens per forward/backward pass at most; null = by micro_batch_memory"),
    "trainer.micro_batch_memory": ("> 0", "GiB of activations a forward/backward pass keeps at most; null = no limit"),
    "trainer.log_every": (">= 1", "steps per metrics row"),
    "trainer.eval_every": (">= 1", "steps between evaluations; null = never"),
    "optim.lr": ("(0, 1]", "AdamW's step size, about how far each weight moves per step: above 1 the "
                           "weights are overwritten by noise"),
    "optim.weight_decay": (">= 0", "AdamW's decoupled weight decay"),
    "sft_warmup.steps": (">= 0", "supervised steps before the algorithm's, within trainer.steps; 0 = none"),
    "sft_warmup.batch_size": (">= 1", "demonstration rows per warm-up step"),
    "sft_warmup.lr": ("(0, 1]", "AdamW's step size in the warm-up steps"),
    "optim.beta1": ("[0, 1)", "AdamW's decay rate of the gradient's running mean"),
    "optim.beta2": ("[0, 1)", "AdamW's decay rate of the squared gradient's running mean"),
    "optim.eps": ("> 0", "added to AdamW's denominator; 0 divides 0 by 0 wherever a gradient is 0, as LoRA's A "
                         "matrices' are at the first step"),
    "optim.max_grad_norm": ("> 0", "the global gradient norm is clipped to it; null = no clipping"),
    "optim.warmup_steps": (">= 0", "steps of linear learning-rate warmup"),
    "rollout.max_new_tokens": (">= 1", "completion tokens at most"),
    "rollout.temperature": ("> 0", "the sampling temperature; log-probs divide by it"),
    "rollout.top_p": ("(0, 1]", "the nucleus sampling mass; 1 samples from the full distribution"),
    "rollout.vllm_gpu_memory": ("(0, 1)", "the share of the GPU's memory vLLM may take"),
    "rollout.tis_cap": (">= 1", "the cap C of min(pi_trainer / pi_vllm, C)"),
    "rollout.max_turns": (">= 1", "model turns per episode; 1 = one completion per prompt"),
    "rollout.max_tool_calls": (">= 0", "tool calls an episode may make"),
    "rollout.max_episode_tokens": (">= 1", "tokens of an episode after its prompt; null = only the turns bound it"),
    "rollout.tool_timeout": ("> 0", "seconds a tool call may take; null = no limit"),
    "hardware.nproc": (">= 1", "processes on this machine; null = this one alone"),
    "logging.print_every": (">= 1", "steps per plain progress line; null = about 20 a run"),
    "logging.samples_every": (">= 0", "steps per samples table; 0 = never"),
    "logging.samples_shown": (">= 1", "completions a samples table shows"),
    "sweep.last_steps": (">= 1", "logged steps a training metric is averaged over for the sweep's objective"),
    "sweep.seeds": (">= 1", "seeds per configuration of a sweep"),
    "eval.size": (">= 1", "eval prompts; null = the whole eval split"),
    "eval.samples_per_prompt": (">= 1", "completions per eval prompt"),
    "eval.max_new_tokens": (">= 1", "completion tokens at most; null = rollout.max_new_tokens"),
    "eval.batch_size": (">= 1", "prompts per generation batch"),
    "data.train_size": (">= 1", "training prompts a built-in task generates"),
    "data.digits": (">= 1", "digits per operand"),
    "data.max_digits": (">= 1", "the most digits per operand; null = data.digits"),
    "model.lora.r": (">= 1", "the rank of LoRA's update B A; null model.lora trains all weights instead"),
    "model.lora.alpha": ("> 0", "LoRA's scale: the update is multiplied by alpha / r"),
    "model.lora.dropout": ("[0, 1)", "the dropout probability on LoRA's input"),
    "model.tiny.hidden_size": (">= 1", "the tiny model's width"),
    "model.tiny.num_layers": (">= 1", "the tiny model's layers"),
    "model.tiny.num_heads": (">= 1", "the tiny model's attention heads"),
    "model.tiny.intermediate_size": (">= 1", "the tiny model's MLP width"),
    "model.tiny.init_std": ("> 0", "the std of the tiny model's initial weights"),
    # algo.*: each applies to the algorithms whose schema has the key (an algorithm's declared `ranges` override).
    "algo.group_size": (">= 1", "completions sampled per prompt"),
    "algo.beta": (">= 0", "the weight of the KL penalty; 0 turns it off"),
    "algo.clip_eps": ("(0, 1)", "the clip range of the ratio pi / pi_old, to [1 - eps, 1 + eps]"),
    "algo.clip_eps_high": ("> 0", "the upper clip range of the ratio, to 1 + eps_high; null = clip_eps"),
    "algo.value_clip_eps": ("> 0", "the clip range of V around V_old; null = plain MSE"),
    "algo.epochs": (">= 1", "passes over each sampled batch"),
    "algo.minibatch_size": (">= 1", "completions per optimizer step"),
    "algo.gamma": ("[0, 1]", "the discount of future rewards"),
    "algo.lam": ("[0, 1]", "GAE's lambda"),
    "algo.vf_coef": (">= 0", "the weight of the value loss"),
    "algo.entropy_coef": (">= 0", "the weight of the entropy bonus"),
    "algo.target_kl": ("> 0", "the KL(pi_old || pi) that stops a batch's epochs early; null = never"),
    "algo.baseline_momentum": ("[0, 1)", "the weight of the previous running mean in baseline=mean"),
    "algo.label_smoothing": ("[0, 0.5)", "the probability that a pair's label is flipped"),
}
# hardware.threads, a number or a word, has its own check (check_threads).
# Numeric settings whose valid values depend on other settings: checked beside those.
CHECKED_ELSEWHERE = ("trainer.save_every", "trainer.keep_last", "algo.max_resample_rounds", "data.max_prompt_len",
                     "data.eval_size")


def check_threads(value) -> None:
    """hardware.threads: auto, null or an integer of at least 1, else one line saying so."""
    if value is None or value == "auto" or (type(value) is int and value >= 1):
        return
    meaning = "torch threads per process; null = torch's default, auto = chosen from the model's size"
    if type(value) is int:
        raise ConfigError(f"hardware.threads={value} must be at least 1 ({meaning})")
    raise ConfigError(f"hardware.threads={value!r} is not valid; give auto, null or an integer of at least 1 "
                      f"({meaning})")


def _in_range(value: float, spec: str) -> bool:
    if spec.startswith(">"):
        bound = float(spec.lstrip(">= "))
        return value >= bound if spec.startswith(">=") else value > bound
    low, high = (float(x) for x in spec[1:-1].split(","))
    return (low <= value if spec[0] == "[" else low < value) and (value <= high if spec[-1] == "]" else value < high)


def _range_text(spec: str) -> str:
    if spec.startswith(">="):
        return f"at least {spec[2:].strip()}"
    if spec.startswith(">"):
        return f"greater than {spec[1:].strip()}"
    return f"in {spec}"


def _nonfinite(node, path: str):
    """(key, value) of the first NaN or infinite number in a plain container, or None."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found = _nonfinite(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return (path, node) if isinstance(node, float) and not math.isfinite(node) else None


def check_ranges(cfg, own: Mapping[str, tuple] = {}) -> None:
    """Every numeric setting against its range (RANGES), and no NaN or infinity anywhere: one line
    naming the key, the value and the valid range. `own`: the ranges an algorithm gives its keys
    where they differ from RANGES (its declaration's `ranges`)."""
    ranges = {**RANGES, **own}
    for key, (spec, meaning) in ranges.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool) or (math.isfinite(value) and _in_range(value, spec)):
            continue
        shown = format(value, "g") if isinstance(value, float) else value
        why = " is not a number; it" if math.isnan(value) else " is not finite; it" if math.isinf(value) else ""
        raise ConfigError(f"{key}={shown}{why} must be {_range_text(spec)} ({meaning})")
    plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    found = _nonfinite({k: v for k, v in plain.items() if k != "hydra"}, "")
    if found:
        raise ConfigError(f"{found[0]}={found[1]} is not a finite number; give a finite value")



def model_token_limit(rollout) -> int:
    """The most tokens of its own the model can write in one episode: max_new_tokens per turn, times
    max_turns (the constant of Dr. GRPO's normaliser and the FLOP floor's completion length)."""
    return rollout.max_new_tokens * rollout.max_turns
