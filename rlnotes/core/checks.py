"""Checks of single settings that need nothing but the config: a choice among named options, and
the valid range of every numeric setting (RANGES), each failing with one line naming the key."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from rlnotes.core.algorithm import Algorithm
from rlnotes.core.comments import comment, summary
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import TrainConfig

SCHEDULES = ("constant", "linear", "cosine")
PRECISIONS = ("fp32", "bf16", "auto")
DEVICES = ("cpu", "cuda", "auto")
# hardware.strategy: how several processes share a run (see rlnotes.engine.hardware.distributed).
STRATEGIES = ("ddp", "fsdp")
# rollout.engine: what samples completions.
ENGINES = ("hf", "vllm")
# rollout.env_style: how an environment's class is read (rlnotes.agents.environments.is_step_style).
ENV_STYLES = ("auto", "gym", "tools")
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
# so must the value be. null (where a setting allows it) is never checked. What a setting means is
# its schema comment's (rlnotes.core.comments), quoted by the error. The algo section's ranges are
# each algorithm's own (its declaration's `ranges`). The seeds torch takes have torch's range
# (data.seed seeds Python's random alone: any integer). Settings without a range here: the reward
# section (rlnotes.rewards.scoring checks it), and CHECKED_ELSEWHERE, whose checks need other
# settings too.
RANGES: Dict[str, str] = {
    "trainer.steps": ">= 1", "trainer.batch_size": ">= 1", "trainer.micro_batch_size": ">= 1",
    "trainer.micro_batch_tokens": ">= 1", "trainer.micro_batch_memory": "> 0", "trainer.log_every": ">= 1",
    "trainer.eval_every": ">= 1",
    "optim.lr": "(0, 1]", "optim.weight_decay": ">= 0", "optim.beta1": "[0, 1)", "optim.beta2": "[0, 1)",
    "optim.eps": "> 0", "optim.max_grad_norm": "> 0", "optim.warmup_steps": ">= 0",
    "sft_warmup.steps": ">= 0", "sft_warmup.batch_size": ">= 1", "sft_warmup.lr": "(0, 1]",
    "rollout.max_new_tokens": ">= 1", "rollout.temperature": "> 0", "rollout.top_p": "(0, 1]",
    "rollout.vllm_gpu_memory": "(0, 1)", "rollout.tis_cap": ">= 1", "rollout.max_turns": ">= 1",
    "rollout.max_tool_calls": ">= 0", "rollout.max_episode_tokens": ">= 1", "rollout.tool_timeout": "> 0",
    "rollout.env_timeout": "> 0",
    "hardware.nproc": ">= 1",
    "logging.print_every": ">= 1", "logging.samples_every": ">= 0", "logging.samples_shown": ">= 1",
    "sweep.last_steps": ">= 1", "sweep.seeds": ">= 1",
    "eval.size": ">= 1", "eval.samples_per_prompt": ">= 1", "eval.max_new_tokens": ">= 1",
    "eval.batch_size": ">= 1",
    "data.train_size": ">= 1", "data.digits": ">= 1", "data.max_digits": ">= 1", "data.operands": ">= 2",
    "model.lora.r": ">= 1", "model.lora.alpha": "> 0", "model.lora.dropout": "[0, 1)",
    "model.tiny.hidden_size": ">= 1", "model.tiny.num_layers": ">= 1", "model.tiny.num_heads": ">= 1",
    "model.tiny.intermediate_size": ">= 1", "model.tiny.init_std": "> 0", "model.tiny.max_positions": ">= 1",
    "seed": "[-9223372036854775808, 18446744073709551616)", "model.tiny.init_seed": "[-9223372036854775808, "
    "18446744073709551616)",  # torch.manual_seed's: -2^63 to 2^64 - 1
}
# hardware.threads, a number or a word, has its own check (check_threads): these values.
THREADS = "auto, null or an integer of at least 1"
# rollout.env, one environment or a mapping of names to them, has its own check (check_env): these.
ENV_FORMS = ("null, an environment (letters, pkg.module:Class, path/to/env.py:Class) or a mapping of names to "
             "environments ({math: my_envs:MathEnv, words: letters})")
# A name in rollout.env's mapping: a row's `environment` value, a part of the metrics' env/NAME/...,
# and a key of its own (rollout.env.NAME): no dot, which would read as a deeper key.
ENV_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
# Numeric settings whose valid values depend on other settings: checked beside those.
CHECKED_ELSEWHERE = ("trainer.save_every", "trainer.keep_last", "algo.max_resample_rounds", "data.max_prompt_len",
                     "data.eval_size")


def check_threads(value) -> None:
    """hardware.threads: one of THREADS, else one line saying so."""
    if value is None or value == "auto" or (type(value) is int and value >= 1):
        return
    meaning = meaning_of("hardware.threads")
    if type(value) is int:
        raise ConfigError(f"hardware.threads={value} must be at least 1 ({meaning})")
    raise ConfigError(f"hardware.threads={value!r} is not valid; give {THREADS} ({meaning})")


def check_env(value) -> None:
    """rollout.env: one of ENV_FORMS (the environments themselves load when the run starts, before
    the model), else one line saying what is wrong and what to give."""
    if value is None or isinstance(value, str):
        return
    if not OmegaConf.is_dict(value) and not isinstance(value, dict):
        shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        raise ConfigError(f"rollout.env={shown!r} is not valid; give {ENV_FORMS}")
    if not value:
        raise ConfigError("rollout.env={} names no environment; give at least one name: environment, or null")
    for name, spec in value.items():
        if not isinstance(name, str):
            raise ConfigError(f"rollout.env: the name {name!r} is not a word; name each environment with letters, "
                              "digits, _ and - (e.g. env1)")
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"rollout.env: {name!r} cannot name an environment (a row's `environment` value and "
                              "the metrics' env/NAME/...): use letters, digits, _ and -")
        if not isinstance(spec, str) or not spec:
            shown = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else spec
            raise ConfigError(f"rollout.env.{name}={shown!r} is not an environment; give a built-in name (letters), "
                              "pkg.module:Class or path/to/env.py:Class")


def env_text(value) -> str:
    """rollout.env as an override writes it: `letters`, `{math: my_envs:MathEnv, words: letters}`."""
    if value is None or isinstance(value, str):
        return str(value)
    return "{" + ", ".join(f"{name}: {spec}" for name, spec in value.items()) + "}"


def _in_range(value: float, spec: str) -> bool:
    if spec.startswith(">"):
        bound = float(spec.lstrip(">= "))
        return value >= bound if spec.startswith(">=") else value > bound
    low, high = (float(x) for x in spec[1:-1].split(","))
    return (low <= value if spec[0] == "[" else low < value) and (value <= high if spec[-1] == "]" else value < high)


def range_text(spec: str) -> str:
    """A range as words: ">= 1" -> "at least 1", "> 0" -> "greater than 0", "(0, 1]" -> "in (0, 1]"."""
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


def meaning_of(key: str, algo_schema: Optional[type] = None) -> str:
    """The short form of a setting's schema comment (`algo.*`: of the algorithm's schema)."""
    section, _, rest = key.partition(".")
    text = comment(algo_schema, rest) if section == "algo" and algo_schema else comment(TrainConfig, key)
    return summary(text) if text else key


def check_ranges(cfg, algo: Algorithm) -> None:
    """Every numeric setting against its range (RANGES, and the algorithm's own for the algo
    section), and no NaN or infinity anywhere: one line naming the key, the value, the valid range
    and what the setting is."""
    for key, spec in {**RANGES, **algo.ranges}.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool) or (math.isfinite(value) and _in_range(value, spec)):
            continue
        shown = format(value, "g") if isinstance(value, float) else value
        why = " is not a number; it" if math.isnan(value) else " is not finite; it" if math.isinf(value) else ""
        raise ConfigError(f"{key}={shown}{why} must be {range_text(spec)} ({meaning_of(key, algo.schema)})")
    plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    found = _nonfinite({k: v for k, v in plain.items() if k != "hydra"}, "")
    if found:
        raise ConfigError(f"{found[0]}={found[1]} is not a finite number; give a finite value")



def model_token_limit(rollout) -> int:
    """The most tokens of its own the model can write in one episode: max_new_tokens per turn, times
    max_turns (the constant of Dr. GRPO's normaliser and the FLOP floor's completion length)."""
    return rollout.max_new_tokens * rollout.max_turns
