"""Reward functions and their weighted sum.

Every reward function has the signature TRL uses, so users can bring theirs unchanged:

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

where `columns` are the dataset row's other fields, one list per column. None means "no
opinion" and leaves that function out of the sample's weighted sum.
"""

from __future__ import annotations

import importlib
import math
import re
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> Optional[str]:
    """The last number in `text` ("1,234" -> "1234"), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def number_match(prompts, completions, answer, **_) -> List[float]:
    """1.0 when the last number in the completion equals the `answer` column, else 0.0."""
    out = []
    for text, ans in zip(completions, answer):
        got = last_number(text)
        try:
            out.append(float(got is not None and float(got) == float(ans)))
        except ValueError:
            out.append(0.0)
    return out


def letter_share(prompts, completions, letter, **_) -> List[float]:
    """Share of the completion's characters that are the row's `letter` (0 for an empty one)."""
    return [text.count(c) / len(text) if text else 0.0 for text, c in zip(completions, letter)]


_REWARD_MODELS: Dict[tuple, tuple] = {}   # (path, device) -> loaded reward model, loaded once per process


def reward_model(prompts, completions, path, device="cpu", batch_size=16, **_) -> List[float]:
    """r(x, y) of a reward model trained with algo=rm (rlnotes.reward_model), read from `path`
    (its run's final/ dir) on first use; scored without gradients, `batch_size` sequences a pass."""
    from rlnotes.models import resolve_device
    from rlnotes.offline import encode
    from rlnotes.reward_model import load, sequence_rewards

    dev = resolve_device(device)
    if (str(path), str(dev)) not in _REWARD_MODELS:
        _REWARD_MODELS[(str(path), str(dev))] = load(path, dev)
    model, head, tokenizer, model_cfg = _REWARD_MODELS[(str(path), str(dev))]
    out: List[float] = []
    with torch.no_grad():
        for i in range(0, len(completions), batch_size):
            seqs = encode(tokenizer, prompts[i:i + batch_size], completions[i:i + batch_size], dev,
                          model_cfg.chat_template, model_cfg.system_prompt)
            out += sequence_rewards(model, head, seqs).tolist()
    return out


REWARDS: Dict[str, Callable] = {"number_match": number_match, "letter_share": letter_share,
                                "reward_model": reward_model}


def resolve(name: str) -> Callable:
    """A built-in reward by name, or a user's function by import path 'pkg.module.fn'."""
    from rlnotes.config import ConfigError

    if name in REWARDS:
        return REWARDS[name]
    module, _, attr = name.rpartition(".")
    if not module:
        raise ConfigError(f"reward function {name!r} is not built in ({', '.join(REWARDS)}) "
                          "and not an import path like mypkg.rewards.my_fn")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward function {name!r} could not be imported ({type(e).__name__}: {e}); "
                          "make its module importable (install it or add its folder to PYTHONPATH)") from None
    if not callable(fn):
        raise ConfigError(f"reward function {name!r} is not callable")
    return fn


def function_specs(cfg) -> List[tuple[str, float, dict]]:
    """(name, weight, args) of every configured function; `reward.target` adds one of weight 1."""
    from rlnotes.config import ConfigError

    if cfg.name == "custom" and not cfg.target:
        raise ConfigError("reward=custom needs the import path of your function: reward.target=mypkg.rewards.my_fn")
    specs = [(f.fn, float(f.weight), dict(f.args)) for f in cfg.functions]
    specs += [(cfg.target, 1.0, {})] if cfg.target else []
    if not specs:
        raise ConfigError("no reward function is configured; pick a built-in (reward=arith, reward=letters) or "
                          "name yours: reward=custom reward.target=mypkg.rewards.my_fn")
    return specs


def check_reward_config(cfg) -> None:
    for name, _, _ in function_specs(cfg):
        resolve(name)


@dataclass
class RewardFn:
    name: str
    fn: Callable
    weight: float
    args: dict


class RewardFailure(RuntimeError):
    pass


class Rewards:
    """The weighted sum of the configured reward functions, robust to a function that fails.

    A batched call that raises is retried sample by sample; a failing sample or a NaN gets
    `fallback`. A function that fails on every sample of a batch stops the run.
    """

    def __init__(self, cfg, console=None):
        self.fns = [RewardFn(name, resolve(name), weight, args) for name, weight, args in function_specs(cfg)]
        self.fallback = float(cfg.fallback)
        self.console = console
        self._shown_traceback = False

    def _call(self, rf: RewardFn, prompts, completions, columns) -> tuple[List[Optional[float]], int]:
        try:
            values = list(rf.fn(prompts, completions, **columns, **rf.args))
            if len(values) != len(completions):
                raise RewardFailure(f"returned {len(values)} values for {len(completions)} completions")
        except Exception:  # noqa: BLE001 - a user's function may raise anything
            self._show(rf.name)
        else:
            failed = sum(_bad(v) for v in values)
            if failed == len(completions):
                raise RewardFailure(f"reward function {rf.name!r} returned no finite value for any sample of the "
                                    "batch; fix the function")
            return [self._clean(v) for v in values], failed
        values, failed = [], 0
        for i in range(len(completions)):
            try:
                (v,) = rf.fn(prompts[i:i + 1], completions[i:i + 1],
                             **{k: col[i:i + 1] for k, col in columns.items()}, **rf.args)
            except Exception:  # noqa: BLE001
                v = float("nan")
            failed += _bad(v)
            values.append(self._clean(v))
        if failed == len(completions):
            raise RewardFailure(f"reward function {rf.name!r} failed on every sample of the batch; "
                                "see the traceback above and fix the function")
        return values, failed

    def _clean(self, v) -> Optional[float]:
        return None if v is None else (self.fallback if _bad(v) else float(v))

    def _show(self, name: str) -> None:
        if not self._shown_traceback and self.console is not None:
            self.console.print(f"[yellow]reward function {name!r} raised; retrying sample by sample "
                               f"(failures get {self.fallback}). First traceback:[/]\n{traceback.format_exc()}")
        self._shown_traceback = True

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 columns: Dict[str, list]) -> tuple[torch.Tensor, Dict[str, float]]:
        """Total rewards [N] and metrics: each function's mean and the count of failed samples."""
        total = torch.zeros(len(completions))
        metrics: Dict[str, float] = {}
        failures = 0
        for rf in self.fns:
            values, failed = self._call(rf, list(prompts), list(completions), columns)
            failures += failed
            given = [v for v in values if v is not None]
            total += torch.tensor([rf.weight * v if v is not None else 0.0 for v in values])
            metrics[f"reward/{rf.name.rpartition('.')[2]}"] = sum(given) / len(given) if given else float("nan")
        metrics["reward/failures"] = failures
        return total, metrics


def _bad(v) -> bool:
    if v is None:
        return False
    try:
        return not math.isfinite(float(v))
    except (TypeError, ValueError):
        return True
