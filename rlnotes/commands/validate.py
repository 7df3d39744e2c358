"""The whole config checked before anything loads: every setting's type (Hydra and the schema),
choices and ranges, the algorithm's own checks, data, rewards, engine and batch arithmetic. The
checks that need several floors (data, rewards, trackers, checkpoints) meet here, above them.

Light: it imports neither torch nor transformers (a mistake is one line in about a second, not
after the seconds they take), so the algorithms are their declarations as their modules
state them (rlnotes.commands.declared), and a check that needs a heavy library imports it when a
setting asks for it (rollout.engine=vllm, trainer.resume=PATH, reward=model)."""

from __future__ import annotations

import importlib.util
from typing import Dict

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rlnotes.commands.declared import algorithm, declarations
from rlnotes.core.algorithm import Algorithm
from rlnotes.core.checks import (
    DEVICES,
    DIRECTIONS,
    ENGINES,
    ENV_STYLES,
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    check_choice,
    check_ranges,
    check_env,
    check_threads,
    env_text,
    planned_world_size,
)
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import RewardFnConfig, TrainConfig
from rlnotes.data.settings import check_data_config, file_from_path
from rlnotes.data.tasks import TASK_REWARDS
from rlnotes.engine.model.sources import check_model_source
from rlnotes.rewards.loading import check_reward_config
from rlnotes.run.tracking import check_backends


def resolve_auto(cfg) -> Algorithm:
    """Fill in data=auto and reward=auto with the algorithm's task and that task's reward; the
    algorithm that algo.name names."""
    algo = algorithm(cfg.algo.name)
    file_from_path(cfg.data)  # data.path=FILE alone means data=file
    task = cfg.data.source == "task"   # a file or hub dataset has no reward of its own
    if task and cfg.data.name == "auto":
        cfg.data.name = algo.default_task
    if task and cfg.reward.name == "auto" and not cfg.reward.functions and cfg.data.name in TASK_REWARDS:
        cfg.reward.functions = [RewardFnConfig(fn=TASK_REWARDS[cfg.data.name])]
    return algo


def _check_micro_batch(cfg, algo: Algorithm) -> None:
    """trainer.micro_batch_size splits the sequences of one update on each process into equal
    passes: it must divide them."""
    m = cfg.trainer.micro_batch_size
    if m is None:
        return
    shape = algo.shape(cfg)
    n, what = shape.per_update, shape.per_update_text
    world = planned_world_size(cfg.hardware)
    share = n // world if world > 1 and n % world == 0 else n  # an uneven split is _check_layout's error
    if share != n:
        what += f", {share} on each of {world} processes"
    if m > share:
        raise ConfigError(f"trainer.micro_batch_size={m} is larger than the {n} {what}; lower it to at most {share} "
                          "or set it to null")
    if share % m:
        divisors = ", ".join(str(d) for d in range(1, share + 1) if share % d == 0)
        raise ConfigError(f"trainer.micro_batch_size={m} does not divide the {n} {what} into equal passes; use one "
                          f"of {divisors}, or null (one pass)")


def _check_layout(cfg) -> None:
    """Settings that several processes constrain: the global batch must split evenly over them."""
    check_choice("hardware.strategy", cfg.hardware.strategy, STRATEGIES)
    world = planned_world_size(cfg.hardware)
    if world <= 1:
        return
    b = cfg.trainer.batch_size
    if b % world:
        raise ConfigError(f"trainer.batch_size={b} does not split evenly over {world} processes; use a multiple of "
                          f"{world} (it is the global batch: each process takes 1/{world} of it)")
    if cfg.rollout.per_prompt_seed is False:
        raise ConfigError(f"rollout.per_prompt_seed=false cannot work with {world} processes: each samples its own "
                          "prompts from keyed random numbers; set it to null (or true)")


def _check_engine(cfg) -> None:
    """rollout.engine=vllm and rollout.tis_cap: a GPU, the package, a LoRA policy vLLM can load."""
    r = cfg.rollout
    check_choice("rollout.engine", r.engine, ENGINES)
    if r.engine == "hf":
        if r.tis_cap is not None:
            raise ConfigError("rollout.tis_cap corrects for vLLM's sampling log-probs; with rollout.engine=hf the "
                              "policy samples itself (every weight is 1): set rollout.engine=vllm or drop tis_cap")
        return
    import torch  # optional: torch (seconds to import) only where rollout.engine=vllm asks for a GPU

    if cfg.hardware.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError("rollout.engine=vllm runs on a GPU and torch sees none here (or hardware.device=cpu); "
                          "use rollout.engine=hf, or hardware=cuda on a GPU machine")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm needs the vllm package; install it with: pip install 'rlnotes[vllm]'")
    if cfg.model.lora is None:
        raise ConfigError("rollout.engine=vllm sends the LoRA adapter to vLLM each step; set model.lora (without "
                          "LoRA the whole model would have to be sent) or use rollout.engine=hf")
    if cfg.model.name_or_path == "tiny":
        raise ConfigError("rollout.engine=vllm loads the model from disk and model=tiny is built in code; use "
                          "model=smollm2-135m, a local Hugging Face dir or a hub id")
    if cfg.hardware.strategy == "fsdp" and planned_world_size(cfg.hardware) > 1:
        raise ConfigError("rollout.engine=vllm with hardware.strategy=fsdp is not supported (the adapter's shards "
                          "would have to be gathered each step); use hardware=ddp")


def _check_checkpointing(trainer) -> None:
    """trainer.save_every, keep_last and resume; a resume path must hold a checkpoint now, before
    any model loads (auto is looked up in the run dir when the run starts)."""
    if trainer.save_every is not None and trainer.save_every < 0:
        raise ConfigError(f"trainer.save_every={trainer.save_every} must be >= 0 (0 or null: save only at the end)")
    if trainer.keep_last is not None and trainer.keep_last < 1:
        raise ConfigError(f"trainer.keep_last={trainer.keep_last} must be at least 1 (null keeps every checkpoint)")
    if trainer.resume not in (None, "auto"):
        from rlnotes.run.restore import resolve  # optional: torch and peft, only where a resume path is given

        resolve(trainer.resume)


def _check_episodes(cfg, algo: Algorithm) -> None:
    """Multi-turn settings: a source of observations for more than one turn, a turn to read a tool's
    result, an algorithm that samples, and the engine that runs episodes."""
    r = cfg.rollout
    if cfg.reward.name == "env" and not r.env and algo.samples:
        raise ConfigError("reward=env takes the environment's reward alone, and no rollout.env is set: name one "
                          "(rollout.env=letters or my_env:Env) or pick a reward (reward=letters, reward=custom ...)")
    if not (r.tools or r.env):
        if r.max_turns > 1:
            raise ConfigError(f"rollout.max_turns={r.max_turns} needs something to answer the model between turns: "
                              "rollout.tools=[calculator] or rollout.env=my_env:Env (or set rollout.max_turns=1)")
        return
    if not algo.samples:
        raise ConfigError(f"rollout.tools and rollout.env shape the episodes an algorithm samples; algo="
                          f"{cfg.algo.name} learns from fixed rows: use algo=grpo, rloo, reinforce or ppo")
    if r.tools and r.max_turns < 2:
        raise ConfigError("rollout.tools need rollout.max_turns >= 2 (a turn to call a tool and one to read its "
                          "result): add rollout=multi_turn or set rollout.max_turns=4")
    if r.env and r.max_turns < 2:  # refused, not implied: the run's printed config must be the one that runs
        raise ConfigError(f"rollout.env={env_text(r.env)} needs rollout.max_turns >= 2 (with one turn the environment "
                          "never answers the model): add rollout=multi_turn or set rollout.max_turns=4")
    if r.max_episode_tokens is not None and r.max_episode_tokens < r.max_new_tokens:
        raise ConfigError(f"rollout.max_episode_tokens={r.max_episode_tokens} is below rollout.max_new_tokens="
                          f"{r.max_new_tokens}: not even one whole turn fits; raise it or set it to null")


def _check_sweep(cfg) -> None:
    if cfg.sweep.direction is not None:
        check_choice("sweep.direction", cfg.sweep.direction, DIRECTIONS)
    if cfg.sweep.objective.startswith("eval/") and not cfg.trainer.eval_every:
        raise ConfigError(f"sweep.objective={cfg.sweep.objective} is logged only when the run evaluates: set "
                          "trainer.eval_every=N (or choose a training metric such as reward/mean)")


def _check_data_override(cfg, key: str) -> None:
    """The section `key` (eval.data, sft_warmup.data) holds data settings, of their types, that make
    a valid data config over `data`."""
    override = OmegaConf.select(cfg, key)
    if not override:
        return
    valid = list(cfg.data.keys())
    for name in override:
        if name not in valid:
            raise ConfigError(f"{key}.{name} is not a data setting; valid keys: {', '.join(valid)}")
    try:
        merged = OmegaConf.merge(cfg.data, override)
    except ValidationError as e:
        raise ConfigError(f"{key}.{e.key}: {str(e).splitlines()[0]}") from None
    check_data_config(merged, cfg.trainer)


def _check_precision(hardware) -> None:
    """hardware.precision=bf16 on a CPU without bf16 units, refused by every command that checks a
    config (rlnotes check too), not only once a run starts."""
    if hardware.precision != "bf16" or hardware.device not in ("cpu", "auto"):
        return
    from rlnotes.engine.hardware.devices import check_precision, resolve_device  # optional: torch, seconds to import

    check_precision("bf16", resolve_device(hardware.device))


def validate(cfg) -> Algorithm:
    """Check the values that a schema type cannot: choices, ranges, and batch arithmetic. Returns
    the algorithm that algo.name names."""
    algo = algorithm(cfg.algo.name)
    choices = {"optim.schedule": SCHEDULES, "hardware.device": DEVICES, "hardware.precision": PRECISIONS,
               "rollout.env_style": ENV_STYLES, **algo.choices}
    for key, valid in choices.items():
        if OmegaConf.select(cfg, key, default=None) is not None:
            check_choice(key, OmegaConf.select(cfg, key), valid)
    check_ranges(cfg, algo)
    check_threads(cfg.hardware.threads)
    check_env(cfg.rollout.env)
    _check_precision(cfg.hardware)
    if algo.samples and cfg.eval.generate is False:
        raise ConfigError(f"eval.generate=false: algo={cfg.algo.name} evaluates by generating completions; drop it, "
                          "or set trainer.eval_every=null for no evaluation")
    _check_sweep(cfg)
    check_model_source(cfg.model.name_or_path)  # a missing or half-written model dir, before anything loads
    check_data_config(cfg.data, cfg.trainer)
    _check_data_override(cfg, "eval.data")
    _check_data_override(cfg, "sft_warmup.data")
    if algo.samples:
        if cfg.reward.name == "model" and not cfg.reward.path:
            raise ConfigError("reward=model needs the reward model's directory: reward.path=RUN_DIR/final "
                              "(the final/ dir of an algo=rm run) or a Hugging Face reward model dir")
        check_reward_config(cfg.reward)
        _check_engine(cfg)
    _check_episodes(cfg, algo)
    _check_checkpointing(cfg.trainer)
    if cfg.sft_warmup.steps >= cfg.trainer.steps:
        raise ConfigError(f"sft_warmup.steps={cfg.sft_warmup.steps} leaves none of trainer.steps={cfg.trainer.steps} "
                          f"to algo={cfg.algo.name}: the warm-up steps are the run's first; raise trainer.steps")
    _check_micro_batch(cfg, algo)
    _check_layout(cfg)
    algo.check(cfg)
    check_backends(cfg.logging)  # a chosen tracker's package is installed
    return algo


# The name of the run's schema in Hydra's config store: conf/config.yaml's defaults list starts with it.
SCHEMA = "train_schema"


def register() -> None:
    """Store the schemas where conf/ finds them: the run's (train_schema) and each algorithm's
    (algo_<name>_schema, pulled in by conf/algo/<preset>.yaml), as its module declares it. A schema
    stored already, the same class, is not stored again (each store converts the class anew: 15 ms
    of every command, which registers twice)."""
    store = ConfigStore.instance()
    schemas = {SCHEMA: (TrainConfig, None),
               **{f"algo_{name}_schema": (d.schema, "algo") for name, d in declarations().items()}}
    for name, (node, package) in schemas.items():
        if _stored.get(name) is not node or f"{name}.yaml" not in store.repo:
            store.store(name=name, node=node, package=package)
            _stored[name] = node


_stored: Dict[str, type] = {}  # {name: the schema class register() last stored under it}
