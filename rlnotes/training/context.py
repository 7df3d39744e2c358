"""What the train loop and an algorithm's steps share, in typed parts: what the run is and where it
stands (Run), what trains (Model), the data and rewards (Data), how batches are sampled (Rollouts)
and the run dir and logging (Output). rlnotes.training.setup makes them; a helper takes the parts or
the values it reads, so that its signature says what it depends on.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional

import torch

from rlnotes.engine.hardware import distributed
from rlnotes.engine.hardware.beside import ReferenceProcess
from rlnotes.engine.hardware.devices import mixed_precision

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from rich.console import Console

    from rlnotes.agents.multi_turn import MultiTurn
    from rlnotes.data.sampler import PromptSampler
    from rlnotes.data.tasks import Row
    from rlnotes.engine.policy.policy import Policy
    from rlnotes.engine.prompts import PromptFormat
    from rlnotes.engine.sampling.settings import SamplingSettings
    from rlnotes.engine.sampling.vllm_engine import VLLMEngine
    from rlnotes.rewards.scoring import Rewards
    from rlnotes.run.logger import MetricsLogger


@dataclass
class Run:
    """What the run is and where it stands: its seed and length, its random stream, the optimizer
    steps taken, and what is kept from one step to the next."""
    seed: int
    steps: int                 # trainer.steps: the optimizer steps of the whole run
    generator: torch.Generator  # completions and PPO's minibatch order draw from it
    step: int = 0              # optimizer steps taken
    bad_steps: int = 0         # consecutive skipped updates
    # An optimizer update has run since the last completed step: a stop now cannot go back to that
    # step's state (see signals.StopSignals); set by optimizer_step, cleared by the train loop.
    updating: bool = False
    # An algorithm's own state kept across steps (e.g. REINFORCE's running-mean baseline): plain numbers,
    # strings and tensors, saved in checkpoints (see rlnotes.run.checkpoint.RECOMPUTED for what is not).
    cache: Dict[str, object] = field(default_factory=dict)
    # The current step's wall times, `time/<name>_s` (see timed).
    timers: Dict[str, float] = field(default_factory=dict)
    # The last sampled batch (prompts, completions, rewards: lists of N) for the samples table.
    samples: Optional[Dict[str, list]] = None

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the block's wall time to `time/<name>_s` of the current step."""
        start = time.perf_counter()
        yield
        self.add_time(name, time.perf_counter() - start)

    def add_time(self, name: str, seconds: float) -> None:
        """Add `seconds` to `time/<name>_s` of the current step."""
        self.timers[f"time/{name}_s"] = self.timers.get(f"time/{name}_s", 0.0) + seconds


@dataclass(frozen=True)
class Batching:
    """How a batch's passes are cut, the trainer section's micro-batch keys: at most
    micro_batch_size rows a pass, else a token budget (micro_batch_tokens, or micro_batch_memory GiB
    of activations; see token_budget), else the whole batch at once."""
    micro_batch_size: Optional[int] = None
    micro_batch_tokens: Optional[int] = None
    micro_batch_memory: Optional[float] = None

    @classmethod
    def of(cls, trainer) -> "Batching":
        return cls(trainer.micro_batch_size, trainer.micro_batch_tokens, trainer.micro_batch_memory)


@dataclass
class Model:
    """What trains: the policy (its reference is the adapter switched off), how prompts reach it,
    the heads trained beside it, the optimizer and its learning-rate schedule, where they compute
    and how a batch's passes are cut into micro-batches."""
    policy: Policy
    prompt_format: PromptFormat    # model.chat_template and the system prompt
    device: torch.device
    precision: str                 # hardware.precision
    batching: Batching             # trainer.micro_batch_size / micro_batch_tokens / micro_batch_memory
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lr: float                      # optim.lr, which a head joins at
    lr_factor: Callable[[int], float]   # the schedule: optimizer step -> factor of lr
    max_grad_norm: Optional[float]      # optim.max_grad_norm
    # Modules an algorithm trains beside the policy (a reward model's scalar head), made on its first
    # step and added with add_head: clipped with the policy, saved next to it as <name>.safetensors.
    heads: Dict[str, torch.nn.Module] = field(default_factory=dict)
    # A core idles beside the passes' one thread (hardware.threads=auto on a small model): the reference
    # pass runs there, in a process of its own, beside the policy's (rlnotes.engine.hardware.beside).
    spare_core: bool = False
    beside: Optional[ReferenceProcess] = field(default=None, repr=False)

    def reference_process(self) -> Optional[ReferenceProcess]:
        """The process of the reference pass on the spare core, forked at its first use; None where no
        core is spare."""
        if self.spare_core and self.beside is None:
            self.beside = ReferenceProcess(self.policy)
        return self.beside

    def close(self) -> None:
        """End the reference process, if one started."""
        if self.beside is not None:
            self.beside.close()
            self.beside = None

    def autocast(self):
        """The forward passes' precision context (hardware.precision): bf16 autocast or nothing."""
        return mixed_precision(self.precision, self.device)

    def add_head(self, name: str, head: torch.nn.Module, step: int) -> torch.nn.Module:
        """Train `head` from now on: into heads and the optimizer, with the same learning-rate
        schedule (the scheduler is rebuilt at `step`, the one the run has reached, e.g. after an SFT
        warm-up)."""
        self.heads[name] = head
        distributed.broadcast_parameters(head.parameters())  # a random init must be the same on every rank
        self.optimizer.add_param_group({"params": list(head.parameters()), "initial_lr": self.lr})
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor, last_epoch=step - 1)
        return head

    def trainable_parameters(self) -> List[torch.nn.Parameter]:
        """The policy's and the heads'."""
        return self.policy.trainable_parameters() + [p for head in self.heads.values() for p in head.parameters()]


@dataclass
class Data:
    """The data and the rewards: the train rows in batches (and the SFT warm-up's order over them),
    the held-out rows, the reward functions that score samples and the checker of evaluations."""
    sampler: PromptSampler
    eval_rows: List[Row]
    rewards: Optional[Rewards]     # None for algorithms that do not sample (DPO, SFT, RM)
    # Scores trainer.eval_every evaluations (the task's checker); None when evaluation is off.
    scorer: Optional[Rewards]
    # The sha256 of the train rows in order (restore.rows_sha256), kept in each checkpoint: a resume on
    # other rows is refused.
    rows_sha256: Optional[str]
    # The SFT warm-up's rows when sft_warmup.data sets them apart; None: the train rows.
    warmup_rows: Optional[List[Row]] = None
    # The SFT warm-up's order over its rows (training.warmup), made on its first step.
    warmup_sampler: Optional[PromptSampler] = None


@dataclass
class Rollouts:
    """How batches are sampled (the rollout section): each draw's settings, whether completions are
    seeded by (seed, step, prompt) (rollout.per_prompt_seed, resolved for the number of processes),
    the sampling forms of the weights, the cap of the importance weights, and the vLLM engine and
    the multi-turn side (tools, an environment) when the run has them."""
    sampling: SamplingSettings
    per_prompt_seed: bool
    merge_adapter: bool
    pack_weights: bool
    tis_cap: Optional[float]
    # The vLLM engine that samples when rollout.engine=vllm; None: the policy samples.
    engine: Optional[VLLMEngine] = None
    # The tools and environment of multi-turn episodes (rollout.tools / rollout.env); None: one turn.
    multi_turn: Optional[MultiTurn] = None


@dataclass
class Output:
    """The run dir and logging: where the run writes, its metrics log (a NullLogger until the run
    may write its dir) and its console."""
    run_dir: Path
    logger: MetricsLogger
    console: Console


@dataclass
class Context:
    """What the train loop and an algorithm's steps share: the composed config (an algorithm reads
    its own algo section) and the parts."""
    cfg: DictConfig
    run: Run
    model: Model
    data: Data
    rollouts: Rollouts
    out: Output
