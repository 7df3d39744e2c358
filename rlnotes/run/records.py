"""A finished (or running) run's records on disk: its metrics rows, its overrides, its result.

A run dir holds `metrics.jsonl` (one JSON object per logged step) and Hydra's
`.hydra/overrides.yaml` (the command-line overrides of that run); a multirun sweep dir holds
`multirun.yaml` and one numbered run dir per member, each of which writes `result.json` (the
objective it returned to the sweeper) when it ends. Everything here reads those files only, so
it works on runs that are still going and on runs copied from another machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

from rlnotes.run import files

METRICS_FILE = "metrics.jsonl"
SWEEP_FILE = "multirun.yaml"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
# What a sweep member returned: {"status": "completed" | "failed", "objective": metric,
# "direction": "maximize" | "minimize", "value": x, "error": line}.
RESULT_FILE = "result.json"
# What Hydra's Optuna sweeper writes into the sweep dir at the end of a study.
OPTUNA_FILE = "optimization_results.yaml"

# The metrics a summary shows, in this order, when at least one run logged them, each with the
# direction that is better ("max", "min", or None where neither is: only the final value is shown).
KEY_METRICS: Tuple[Tuple[str, Optional[str]], ...] = (
    ("reward/mean", "max"), ("eval/accuracy", "max"), ("eval/reward", "max"),
    ("dpo/accuracy", "max"), ("dpo/margin", "max"), ("eval/dpo_accuracy", "max"), ("eval/dpo_margin", "max"),
    ("rm/accuracy", "max"), ("eval/rm_accuracy", "max"), ("eval/sft_loss", "min"),
    ("loss", None), ("kl/ref", None), ("completion/len_mean", None),
)
# Words in a metric's name that make lower values better when it is not in KEY_METRICS.
LOWER_IS_BETTER = ("loss", "kl", "ppl", "time/", "grad_norm", "truncated", "zero_std", "failures", "skipped", "len")


class RunError(ValueError):
    """A path that is not a run or a sweep, or a metric no run logged; the message says what to pass."""


@dataclass
class Run:
    """One run dir: its metrics rows (in step order) and its command-line overrides."""

    path: Path
    rows: List[Dict[str, Optional[float]]]
    overrides: List[str] = field(default_factory=list)
    # RESULT_FILE's content for a sweep member that finished (or failed); None otherwise.
    result: Optional[Dict[str, object]] = None

    def metrics(self) -> List[str]:
        """Every metric name the run logged, in first-seen order."""
        return list(dict.fromkeys(k for row in self.rows for k in row if k != "step"))

    def series(self, key: str) -> Tuple[List[float], List[float]]:
        """(steps, values) of `key`, leaving out the rows where it is missing or null."""
        points = [(row["step"], row[key]) for row in self.rows if row.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    def final(self, key: str) -> Optional[float]:
        """The last logged value of `key` (None if never logged)."""
        values = self.series(key)[1]
        return values[-1] if values else None

    def best(self, key: str, direction: Optional[str]) -> Optional[float]:
        """The largest ("max") or smallest ("min") logged value of `key`."""
        values = self.series(key)[1]
        if not values or direction is None:
            return None
        return max(values) if direction == "max" else min(values)

    @property
    def steps(self) -> Optional[int]:
        return int(self.rows[-1]["step"]) if self.rows else None

    @property
    def wall_s(self) -> Optional[float]:
        """Seconds from the start of training to the last logged row."""
        return self.final("time/elapsed_s")


def read_metrics(path: Path) -> List[Dict[str, Optional[float]]]:
    """The rows of a metrics.jsonl; a line that does not parse (a run killed mid-write) is skipped,
    and a step lower than the one before (a run resumed from an earlier checkpoint) replaces the
    rows from that step on."""
    rows: List[Dict[str, Optional[float]]] = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or "step" not in row:
            continue
        if rows and row["step"] < rows[-1]["step"]:
            rows = [r for r in rows if r["step"] < row["step"]]
        rows.append(row)
    return rows


def read_overrides(run_dir: Path) -> List[str]:
    """The run's command-line overrides as Hydra recorded them (empty for a run started without Hydra)."""
    path = Path(run_dir) / OVERRIDES_FILE
    if not path.exists():
        return []
    return [str(o) for o in (yaml.safe_load(path.read_text()) or [])]


def read_result(run_dir: Path) -> Optional[Dict[str, object]]:
    """A sweep member's RESULT_FILE, or None (not a member, or one still running or killed)."""
    path = Path(run_dir) / RESULT_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_result(run_dir: Path, status: str, objective: Tuple[str, str], value: Optional[float],
                 error: str = "") -> None:
    """Record what a sweep member returned: its (metric, direction) objective and value; a failed
    member has value None and its error line."""
    result = {"status": status, "objective": objective[0], "direction": objective[1],
              "value": value if value is not None and math.isfinite(value) else None, "error": error}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    files.write_text(Path(run_dir) / RESULT_FILE, json.dumps(result) + "\n")  # aside and renamed: never through a link


def load_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    result = read_result(run_dir)
    if not (run_dir / METRICS_FILE).exists():
        if result is not None:  # a member that failed before its first step
            return Run(run_dir, [], read_overrides(run_dir), result)
        raise RunError(f"{run_dir} has no {METRICS_FILE}; pass a run dir (one with {METRICS_FILE}) or a sweep dir")
    return Run(run_dir, read_metrics(run_dir / METRICS_FILE), read_overrides(run_dir), result)


def _member_order(path: Path) -> Tuple[int, str]:
    return (int(path.name), "") if path.name.isdigit() else (1 << 30, path.name)


def sweep_members(sweep_dir: Path) -> List[Path]:
    """The run dirs of a multirun sweep (its subdirs with a metrics.jsonl, or with a result of a
    member that failed before logging), by job number."""
    found = {p.parent for name in (METRICS_FILE, RESULT_FILE) for p in Path(sweep_dir).glob(f"*/{name}")}
    return sorted(found, key=_member_order)


def has_runs(path: Path) -> bool:
    """Whether `path` is a run dir with metrics or a sweep dir with members (not, for instance, the
    dir of a run that stopped before its first step)."""
    return (Path(path) / METRICS_FILE).exists() or bool(sweep_members(path))


def expand(paths: Iterable[Path]) -> List[Path]:
    """Run dirs from a mix of run dirs and sweep dirs, in the order given (a sweep's by job number)."""
    runs: List[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise RunError(f"{path} is not a directory; pass a run dir or a sweep dir")
        if (path / METRICS_FILE).exists():
            runs.append(path)
            continue
        members = sweep_members(path)
        if not members:
            raise RunError(f"{path} has no {METRICS_FILE} and no run dirs with one; pass a run dir or a sweep dir")
        runs.extend(members)
    return runs


def is_sweep(path: Path) -> bool:
    """True for a sweep dir: Hydra's multirun.yaml, or no metrics of its own but run dirs with them."""
    path = Path(path)
    return (path / SWEEP_FILE).exists() or (not (path / METRICS_FILE).exists() and bool(sweep_members(path)))


# ---------------------------------------------------------------------------------------------
# Telling runs apart by their overrides


def split_override(override: str) -> Tuple[str, str]:
    """(key, value) of an override as Hydra records it: "+trainer.steps=2" -> ("trainer.steps", "2")."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def differing_overrides(overrides: Sequence[Sequence[str]]) -> List[List[str]]:
    """For each run, its overrides whose key is missing from or set differently in another run.

    [["seed=0", "trainer.steps=2"], ["seed=1", "trainer.steps=2"]] -> [["seed=0"], ["seed=1"]].
    """
    parsed = [dict(split_override(o) for o in run) for run in overrides]
    keys = list(dict.fromkeys(k for run in parsed for k in run))
    varying = [k for k in keys if len({run.get(k) for run in parsed}) > 1]
    return [[f"{k}={run[k]}" for k in varying if k in run] for run in parsed]


def labels(runs: Sequence[Run]) -> List[str]:
    """A short, distinct name per run for legends and tables: the overrides that set it apart,
    else its dir name; a clash is resolved by prefixing the parent dir's name."""
    names = [" ".join(d) or run.path.name for d, run in zip(differing_overrides([r.overrides for r in runs]), runs)]
    if len(set(names)) < len(names):
        names = [f"{run.path.parent.name}/{run.path.name}" + (f" {n}" if n != run.path.name else "")
                 for n, run in zip(names, runs)]
    return names


def sweep_dir_of(run_dir: Path) -> Optional[Path]:
    """The sweep dir a run belongs to (the parent with Hydra's multirun.yaml), or None."""
    parent = Path(run_dir).resolve().parent
    return parent if (parent / SWEEP_FILE).exists() else None


def swept_keys(sweep_overrides: Sequence[str]) -> List[str]:
    """The keys a sweep's command line varies: ["seed"] for ["seed=0,1", "trainer.steps=2"]."""
    parsed = OverridesParser.create().parse_overrides(list(sweep_overrides))
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def swept_overrides(run_dir: Path) -> List[str]:
    """The overrides of a sweep member that its sweep varied ("seed=1" for `-m seed=0,1 x=2`).
    Empty outside a sweep."""
    sweep = sweep_dir_of(run_dir)
    if sweep is None:
        return []
    config = yaml.safe_load((sweep / SWEEP_FILE).read_text()) or {}
    keys = set(swept_keys(((config.get("hydra") or {}).get("overrides") or {}).get("task") or []))
    return [o for o in read_overrides(run_dir) if split_override(o)[0] in keys]


# ---------------------------------------------------------------------------------------------
# The objective a sweep member returns to its sweeper


def direction(metric: str) -> str:
    """Which way `metric` is better, for sorting: its KEY_METRICS direction, else by its name."""
    known = dict(KEY_METRICS).get(metric)
    if known:
        return known
    return "min" if any(word in metric for word in LOWER_IS_BETTER) else "max"


# The held-out score an algorithm's runs always log (their own eval_every): the auto objective.
def objective_metric(sweep, eval_every: int, algo) -> Tuple[str, str]:
    """(metric, "maximize" or "minimize") of the `sweep` section's objective and direction, auto
    resolved: the algorithm `algo`'s held-out score when the run evaluates (trainer.eval_every),
    else its training metric (reward/mean when it samples); the sense follows the metric."""
    metric = sweep.objective
    if metric == "auto":
        metric = algo.objective if eval_every else algo.train_objective
    return metric, sweep.direction or ("maximize" if direction(metric) == "max" else "minimize")


def objective_value(rows: Sequence[Dict[str, Optional[float]]], metric: str, last_steps: int) -> Optional[float]:
    """A held-out metric (eval/*): its final value, the score of the trained policy. A training
    metric: its mean over the last `last_steps` rows that logged it. None if never logged."""
    values = [row[metric] for row in rows if row.get(metric) is not None]
    if not values:
        return None
    if metric.startswith("eval/"):
        return float(values[-1])
    tail = values[-last_steps:]
    return float(sum(tail) / len(tail))
