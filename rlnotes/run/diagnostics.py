"""Why is my reward not increasing? The batch arithmetic of a run, and the warnings that watch it.

`batch_arithmetic(trainer, shape)` derives from the trainer settings and the algorithm alone what
a run will do: prompts and completions per batch, micro-batches, minibatches, policy updates per
sampled batch, sampled batches, the completion tokens of a batch at most, and the prompts it will
see (and so the epochs over the train set). The run prints it at the start (`describe_batches`).

`Watcher` gets every step's metrics and warns once per kind when one of these holds over the
last WINDOW = 5 steps (a mean over the window; a step here is one sampled batch, which is
several optimizer steps in PPO):

- zero_variance: reward/zero_std_frac >= 0.8, with group-relative advantages (GRPO, RLOO).
  Try a larger algo.group_size or rollout.temperature, easier data, a denser reward.
- entropy_collapse: policy/entropy < 0.1 nats per token. Try a higher rollout.temperature, a
  lower optim.lr, a larger algo.beta.
- kl_blowup: kl/ref > max(1 nat, the policy's entropy over the first WINDOW steps) per token.
  Try a lower optim.lr, a larger algo.beta.
- truncation: completion/truncated_frac >= 0.5 while the reward has not risen since the start.
  Try a larger rollout.max_new_tokens, a length penalty.
- reward_failures: 10% or more of the window's completions got reward.fallback because a reward
  function failed. Fix the function.
- clip_fraction: policy/clip_frac > 0.3. Try a lower optim.lr, fewer algo.epochs.

Why these lines: a group whose rewards are all equal has advantage 0 and adds nothing to a
group-relative gradient, so when 4 groups in 5 are like that the batch is mostly wasted. A
per-token entropy under 0.1 nats means the sampled token has probability above ~0.9 on average:
the G samples of a prompt come out nearly identical. The KL line scales with the model: a
per-token KL to the reference larger than the reference's own per-token entropy means the
policy now writes text its reference finds more surprising than its own samples; a tiny random
model (entropy ~4.3 nats) may drift 3 nats while learning a task, a pretrained one (~1 nat) may
not. Truncation is harmless for a task whose answer needs no ending (the letters task runs every
completion to the cap while its reward climbs), so it warns only while the reward is flat: the
mean reward of the last WINDOW steps is not above that of the first WINDOW by half the typical
within-batch reward std. PPO's clip fraction is usually 0.05-0.2; above 0.3 a large share of
the batch's gradient is clipped away.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from rlnotes.core.algorithm import Algorithm, Shape

# Steps (sampled batches) over which a condition must hold, as a mean, and the lines (see above).
WINDOW = 5
ZERO_STD_FRAC = 0.8
MIN_ENTROPY = 0.1
KL_FLOOR = 1.0
TRUNCATED_FRAC = 0.5
FAILURE_FRAC = 0.1
CLIP_FRAC = 0.3

# ---------------------------------------------------------------------------------------------
# batch arithmetic


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def batch_arithmetic(trainer, shape: Shape, train_rows: Optional[int] = None,
                     steps: Optional[int] = None) -> Dict[str, object]:
    """The numbers a run derives from its `trainer` config section, before any model loads.

    Keys: unit (what a batch row is: prompts, pairs or rows), prompts_per_batch, completions_per_batch
    (sequences the policy scores per batch: B*G sampled, 2B for pairs), micro_batch_size and
    micro_batches (forward/backward passes per optimizer step; with a token budget instead, its
    micro_batch_tokens or micro_batch_memory, the passes depend on each batch's lengths), minibatches
    (optimizer steps per pass over a batch), updates_per_batch (optimizer steps per batch), batches
    (batches sampled or read; PPO: at least, target_kl can stop a batch early), optimizer_steps, max_tokens_per_batch
    (completion tokens of a batch at most; None without sampling), prompts_seen (and
    prompts_seen_max with DAPO dynamic sampling), and epochs (over `train_rows`: the train split's
    size; None when unknown). `shape`: the algorithm's own arithmetic of a step (its declaration's
    shape(cfg)). `steps`: the algorithm's optimizer steps when not all of trainer.steps (an SFT warm-up
    takes the first ones).
    """
    b, steps = trainer.batch_size, trainer.steps if steps is None else steps
    completions, minibatches, updates, per_update = shape.sequences, shape.minibatches, shape.updates, shape.per_update
    micro = trainer.micro_batch_size or per_update
    tokens = None if trainer.micro_batch_size else trainer.micro_batch_tokens
    batches = _ceil_div(steps, updates)
    seen = batches * b
    rounds = shape.rounds
    return {
        "unit": shape.unit,
        "prompts_per_batch": b,
        "completions_per_batch": completions,
        "micro_batch_size": micro,
        "micro_batches": _ceil_div(per_update, micro),
        "micro_batch_tokens": tokens,
        "micro_batch_memory": None if trainer.micro_batch_size or tokens else trainer.micro_batch_memory,
        "minibatches": minibatches,
        "updates_per_batch": updates,
        "batches": batches,
        "optimizer_steps": steps,
        "max_tokens_per_batch": completions * shape.max_new_tokens if shape.max_new_tokens else None,
        "prompts_seen": seen,
        "prompts_seen_max": seen * rounds,
        "epochs": seen / train_rows if train_rows else None,
        "epochs_max": seen * rounds / train_rows if train_rows else None,
    }


def describe_batches(a: Mapping[str, object]) -> str:
    """`batch_arithmetic` in two lines for the start of a run."""
    unit, b, n = a["unit"], a["prompts_per_batch"], a["completions_per_batch"]
    if unit == "prompts":
        parts = [f"batch: {b} prompts x {n // b} = {n} completions"]
    else:
        parts = [f"batch: {b} {unit}" + (f" ({n} sequences)" if n != b else "")]
    updates, minibatches = a["updates_per_batch"], a["minibatches"]
    steps = f"{updates} optimizer step{'s' if updates > 1 else ''} per batch"
    if minibatches > 1:
        steps = f"{updates // minibatches} epochs x {minibatches} minibatches of {n // minibatches} = " + steps
    elif updates > 1:
        steps = f"{updates} epochs = " + steps
    parts.append(steps)
    what = "completions" if unit == "prompts" else unit
    passes = a["micro_batches"]
    if a.get("micro_batch_tokens"):
        parts.append(f"micro-batches of at most {a['micro_batch_tokens']:,} tokens")
    elif a.get("micro_batch_memory"):
        parts.append(f"micro-batches of at most {a['micro_batch_memory']:g} GiB of activations")
    else:
        parts.append(f"micro-batches of {a['micro_batch_size']} {what} ({passes} per optimizer step)")
    if a["max_tokens_per_batch"] is not None:
        parts.append(f"at most {a['max_tokens_per_batch']:,} completion tokens per batch")
    seen = f"{a['prompts_seen']:,}"
    if a["prompts_seen_max"] != a["prompts_seen"]:
        seen += f" to {a['prompts_seen_max']:,}"
    second = f"run: {a['optimizer_steps']} optimizer steps = {a['batches']} batches = {seen} {unit}"
    if a["epochs"] is not None:
        epochs = f"{a['epochs']:.3g}" + (f" to {a['epochs_max']:.3g}" if a["epochs_max"] != a["epochs"] else "")
        second += f" = {epochs} epochs of the train set"
    return "; ".join(parts) + "\n" + second


# ---------------------------------------------------------------------------------------------
# warnings


@dataclass(frozen=True)
class Alert:
    """A diagnostic that fired: its kind, the step, and one message with what to try."""
    kind: str
    step: int
    message: str


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Series:
    """What the checks need of one metric's finite values: the first WINDOW, the last WINDOW,
    and the count and sum of all (constant memory however long the run)."""

    def __init__(self, window: int = WINDOW):
        self.window, self.first, self.last = window, [], deque(maxlen=window)
        self.count, self.total = 0, 0.0

    def add(self, value: float) -> None:
        if len(self.first) < self.window:
            self.first.append(value)
        self.last.append(value)
        self.count, self.total = self.count + 1, self.total + value


class History:
    """Each metric's Series, fed one step's metrics at a time; non-finite and missing values skipped."""

    def __init__(self, window: int = WINDOW):
        self.window = window
        self.series: Dict[str, Series] = {}

    @classmethod
    def of(cls, rows: Sequence[Mapping[str, float]], window: int = WINDOW) -> "History":
        history = cls(window)
        for row in rows:
            history.add(row)
        return history

    def add(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if _finite(value):
                self.series.setdefault(key, Series(self.window)).add(float(value))

    def count(self, key: str) -> int:
        return self.series[key].count if key in self.series else 0

    def recent(self, key: str) -> Optional[float]:
        """Mean of the last `window` values of `key`; None until there are that many."""
        s = self.series.get(key)
        return sum(s.last) / self.window if s and s.count >= self.window else None

    def start(self, key: str) -> Optional[float]:
        """Mean of the first `window` values of `key`; None until there are that many."""
        s = self.series.get(key)
        return sum(s.first) / self.window if s and s.count >= self.window else None

    def mean(self, key: str) -> Optional[float]:
        s = self.series.get(key)
        return s.total / s.count if s and s.count else None

    def recent_sum(self, key: str) -> Optional[float]:
        s = self.series.get(key)
        return sum(s.last) if s and s.count >= self.window else None


def reward_flat(history: History) -> Optional[bool]:
    """True when the mean reward of the last `window` steps is not above that of the first
    `window` by half the mean within-batch reward std; None until the two windows are disjoint."""
    if history.count("reward/mean") < 2 * history.window:
        return None
    tolerance = 0.5 * (history.mean("reward/std") or 0.0)
    return history.recent("reward/mean") - history.start("reward/mean") <= tolerance


@dataclass(frozen=True)
class Settings:
    """What the checks need of a run besides its metrics: the settings their advice quotes, and two
    facts of its algorithm. Built once from the run's config (`of`)."""
    temperature: float                  # rollout.temperature
    lr: float                           # optim.lr
    max_new_tokens: int                 # rollout.max_new_tokens
    fallback: float                     # reward.fallback
    group_size: Optional[int] = None    # algo.group_size, where the algorithm has one
    beta: Optional[float] = None        # algo.beta, where the algorithm has one
    epochs: Optional[int] = None        # algo.epochs, where the algorithm has one
    group_relative: bool = True         # the advantage is relative to the prompt's group (GRPO, RLOO)
    completions_per_batch: int = 1      # the sequences a step scores (the algorithm's shape)

    @classmethod
    def of(cls, cfg, algo: Algorithm) -> "Settings":
        """The settings of the run `cfg` of `algo`."""
        return cls(temperature=cfg.rollout.temperature, lr=cfg.optim.lr, max_new_tokens=cfg.rollout.max_new_tokens,
                   fallback=cfg.reward.fallback, group_size=getattr(cfg.algo, "group_size", None),
                   beta=getattr(cfg.algo, "beta", None), epochs=getattr(cfg.algo, "epochs", None),
                   group_relative=algo.group_relative(cfg.algo), completions_per_batch=algo.shape(cfg).sequences)


def check_zero_variance(history: History, settings: Settings) -> Optional[str]:
    """With group-relative advantages (settings.group_relative: GRPO, RLOO) a group whose rewards
    are all equal teaches nothing."""
    frac = history.recent("reward/zero_std_frac")
    if frac is None or frac < ZERO_STD_FRAC or not settings.group_relative:
        return None
    return (f"{frac:.0%} of groups over the last {history.window} steps got the same reward for every completion: "
            f"their advantage is 0 and they teach nothing. Try a larger algo.group_size (now {settings.group_size}) or "
            f"rollout.temperature (now {settings.temperature}), easier data, or a denser reward that gives "
            "partial credit")


def check_entropy_collapse(history: History, settings: Settings) -> Optional[str]:
    entropy = history.recent("policy/entropy")
    if entropy is None or entropy >= MIN_ENTROPY:
        return None
    return (f"entropy collapsed: {entropy:.3f} nats per sampled token over the last {history.window} steps, so a "
            f"prompt's completions come out nearly identical. Try a higher rollout.temperature (now "
            f"{settings.temperature}), a lower optim.lr (now {settings.lr:g}) or a larger algo.beta")


def check_kl_blowup(history: History, settings: Settings) -> Optional[str]:
    kl, start_entropy = history.recent("kl/ref"), history.start("policy/entropy")
    if kl is None or start_entropy is None:
        return None
    line = max(KL_FLOOR, start_entropy)
    if kl <= line:
        return None
    beta = settings.beta
    return (f"KL to the reference blew up: {kl:.2f} nats per token over the last {history.window} steps, above "
            f"{line:.2f} (the larger of {KL_FLOOR:g} and the policy's entropy at the start). Try a lower optim.lr "
            f"(now {settings.lr:g})" + (f" or a larger algo.beta (now {beta:g})" if beta is not None else ""))


def check_truncation(history: History, settings: Settings) -> Optional[str]:
    frac = history.recent("completion/truncated_frac")
    if frac is None or frac < TRUNCATED_FRAC or not reward_flat(history):
        return None
    return (f"{frac:.0%} of completions over the last {history.window} steps hit rollout.max_new_tokens="
            f"{settings.max_new_tokens} and the reward has not risen since the start: answers may be cut off. "
            "Try a larger rollout.max_new_tokens, or a length penalty in the reward")


def check_reward_failures(history: History, settings: Settings) -> Optional[str]:
    failed = history.recent_sum("reward/failures")
    if failed is None:
        return None
    share = failed / (history.window * settings.completions_per_batch)
    if share < FAILURE_FRAC:
        return None
    return (f"the reward failed on {share:.0%} of the completions of the last {history.window} steps (they got "
            f"reward.fallback={settings.fallback}); fix the reward function (its first traceback is above)")


def check_clip_fraction(history: History, settings: Settings) -> Optional[str]:
    frac = history.recent("policy/clip_frac")
    if frac is None or frac <= CLIP_FRAC:
        return None
    epochs = settings.epochs
    return (f"{frac:.0%} of tokens had their ratio clipped over the last {history.window} steps: each update moves the "
            f"policy too far. Try a lower optim.lr (now {settings.lr:g})"
            + (f" or fewer algo.epochs (now {epochs})" if epochs is not None else ""))


# kind -> check(history, settings) -> message or None, in the order they are tried.
CHECKS: Dict[str, Callable[[History, Settings], Optional[str]]] = {
    "zero_variance": check_zero_variance,
    "entropy_collapse": check_entropy_collapse,
    "kl_blowup": check_kl_blowup,
    "truncation": check_truncation,
    "reward_failures": check_reward_failures,
    "clip_fraction": check_clip_fraction,
}


class Watcher:
    """Feeds each step's metrics to the CHECKS and returns the warnings that fire, once per kind."""

    def __init__(self, settings: Settings, checks: Optional[Mapping[str, Callable]] = None):
        """`settings`: the run's, which the checks read (Settings.of)."""
        self.settings = settings
        self.checks = dict(CHECKS if checks is None else checks)
        self.history = History()
        self.fired: List[Alert] = []

    def observe(self, step: int, metrics: Mapping[str, float]) -> List[Alert]:
        self.history.add(metrics)
        done = {w.kind for w in self.fired}
        new = []
        for kind, check in self.checks.items():
            if kind in done:
                continue
            message = check(self.history, self.settings)
            if message:
                new.append(Alert(kind, step, message))
        self.fired.extend(new)
        return new

    def restore(self, rows: Sequence[Mapping[str, float]], alerts: Sequence[Alert]) -> None:
        """Continue a resumed run: the metrics rows of its steps so far (its metrics.jsonl up to the
        checkpoint), and the warnings it gave in them, which are not given again."""
        for row in rows:
            self.history.add({k: v for k, v in row.items() if k != "step"})
        self.fired.extend(alerts)
