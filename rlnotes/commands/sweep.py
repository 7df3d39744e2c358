"""The summary of runs and sweeps: one table of their final and best metrics, the members of a
sweep grouped over their seeds, an Optuna study's best trial and history; printed, and written as
summary.md and summary.csv. After `rlnotes train -m ...` the SweepSummary callback (named in
conf/config.yaml) writes it into the sweep dir; `rlnotes plot` shows it for any runs.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf
from rich.table import Table

from rlnotes.run import files
from rlnotes.run.display import stdout_console
from rlnotes.run.records import (
    KEY_METRICS,
    OPTUNA_FILE,
    Run,
    RunError,
    differing_overrides,
    direction,
    expand,
    load_run,
    split_override,
)


def sort_metric(runs: Sequence[Run], sort_by: Optional[str]) -> Optional[str]:
    """The metric to sort by: `sort_by` (which some run must have logged), else the first key
    metric any run logged."""
    logged = list(dict.fromkeys(m for run in runs for m in run.metrics()))
    if sort_by is not None:
        if sort_by not in logged:
            raise RunError(f"sort metric {sort_by!r} was not logged by these runs; choose one of: {', '.join(logged)}")
        return sort_by
    return next((m for m, _ in KEY_METRICS if m in logged), None)


@dataclass
class Summary:
    """One row per run: run, overrides, steps, wall_s, then `<metric>` (final) and `<metric> best`."""

    columns: List[str]
    rows: List[Dict[str, object]]
    sort_by: Optional[str]


def _sort(rows: List[Dict[str, object]], key: Optional[str], sense: Optional[str]) -> None:
    """Best first by column `key` ("max" or "min" better); rows without it last, in their order."""
    if key is not None:
        sign = -1.0 if sense == "max" else 1.0
        rows.sort(key=lambda r: (r[key] is None, sign * r[key] if r[key] is not None else 0.0))


def summarize(runs: Sequence[Run], sort_by: Optional[str] = None) -> Summary:
    """Final and best values of the key metrics of every run, best run first by `sort_by`; sweep
    members add their status and the objective they returned, which ranks them unless `sort_by`
    is given."""
    metric = sort_metric(runs, sort_by)
    logged = {m for run in runs for m in run.metrics()}
    shown = [(m, d) for m, d in KEY_METRICS if m in logged]
    if metric is not None and metric not in dict(shown):
        shown.insert(0, (metric, None))
    results = [run.result for run in runs if run.result is not None]
    failed = any(r.get("status") == "failed" for r in results)
    columns = ["run", "overrides"] + (["status", "objective"] if results else []) + ["steps", "wall_s"]
    for m, d in shown:
        columns += [m, f"{m} best"] if d else [m]
    columns += ["error"] if failed else []
    same_parent = len({run.path.resolve().parent for run in runs}) == 1
    rows = []
    for run, label in zip(runs, differing_overrides([r.overrides for r in runs])):
        row: Dict[str, object] = {"run": run.path.name if same_parent else str(run.path),
                                  "overrides": " ".join(label), "steps": run.steps, "wall_s": run.wall_s}
        if results:  # a member without a result is still running, or was killed
            result = run.result or {}
            row.update(status=result.get("status", "unfinished"), objective=result.get("value"))
        if failed:
            row["error"] = (run.result or {}).get("error") or None
        for m, d in shown:
            row[m] = run.final(m)
            if d:
                row[f"{m} best"] = run.best(m, d)
        rows.append(row)
    key, sense = metric, direction(metric) if metric is not None else None
    if sort_by is None and results:
        key, sense = "objective", objective_sense(runs)
        name = str(results[0].get("objective"))  # a training metric's objective is its recent mean (objective_value)
        metric = f"objective ({name}{'' if name.startswith('eval/') else ', mean of the last sweep.last_steps steps'})"
    _sort(rows, key, sense)
    return Summary(columns, rows, metric)


def _mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (n - 1; None for one value) of the finite values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, std


def seed_groups(runs: Sequence[Run], sort_by: Optional[str] = None) -> Optional[Summary]:
    """Members that differ only by their seed, one row per configuration: its seeds (completed of
    all) and the mean and spread (sample std) over them of the objective and of the key metrics'
    final values, best configuration first. None when no configuration ran with several seeds."""
    unseeded = differing_overrides([[o for o in run.overrides if split_override(o)[0] != "seed"] for run in runs])
    groups: Dict[str, List[Run]] = {}
    for run, label in zip(runs, unseeded):
        groups.setdefault(" ".join(label), []).append(run)
    if all(len(members) < 2 for members in groups.values()):
        return None
    results = [run.result for run in runs if run.result is not None]
    logged = {m for run in runs for m in run.metrics()}
    metrics = [(m, d) for m, d in KEY_METRICS if d and m in logged]
    if sort_by is not None and sort_by not in dict(metrics):
        metrics.insert(0, (sort_by, direction(sort_by)))
    if results:
        metrics.insert(0, ("objective", objective_sense(runs)))
    columns = ["configuration", "seeds"] + [f"{m} {stat}" for m, _ in metrics for stat in ("mean", "std")]
    rows = []
    for label, members in groups.items():
        done = [r for r in members if (r.result or {}).get("status", "completed") == "completed"]
        row: Dict[str, object] = {"configuration": label or "(one configuration)",
                                  "seeds": f"{len(done)}/{len(members)}"}
        for m, _ in metrics:
            values = [(r.result or {}).get("value") if m == "objective" else r.final(m) for r in done]
            row[f"{m} mean"], row[f"{m} std"] = _mean_std(values)
        rows.append(row)
    key, sense = (f"{metrics[0][0]} mean", metrics[0][1]) if metrics else (None, None)
    if sort_by is not None:
        key, sense = f"{sort_by} mean", direction(sort_by)
    _sort(rows, key, sense)
    return Summary(columns, rows, key)


def optuna_best(sweep_dir: Path) -> Optional[str]:
    """The best trial of an Optuna study as a line (its overrides and objective) from what Hydra's
    optuna sweeper wrote into the sweep dir; None for other sweeps (or a multi-objective study:
    its Pareto front stays in OPTUNA_FILE)."""
    path = Path(sweep_dir) / OPTUNA_FILE
    best = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    if "best_params" not in best:
        return None
    overrides = " ".join(f"{k}={v}" for k, v in (best.get("best_params") or {}).items())
    return f"best trial: {overrides} with objective {_cell(best.get('best_value'))}"


def optuna_section(sweep_dir: Path, summary: Summary, sense: str) -> Optional[str]:
    """Markdown for an Optuna study: its best trial and its history, trial by trial with the best
    objective so far."""
    best = optuna_best(sweep_dir)
    if best is None:
        return None
    lines = ["## Optuna study", "", best, "", "| trial | status | objective | best so far | overrides |",
             "|---|---|---|---|---|"]
    lines += [f"| {h['trial']} | {h['status']} | {_cell(h['objective'])} | {_cell(h['best'])} | {h['overrides']} |"
              for h in optuna_history(summary, sense)]
    return "\n".join(lines) + "\n"


def objective_sense(runs: Sequence[Run]) -> str:
    """"max" or "min": which way the objective of these sweep members is better ("max" without one)."""
    result = next((run.result for run in runs if run.result is not None), {})
    return "min" if result.get("direction") == "minimize" else "max"


def optuna_history(summary: Summary, sense: str) -> List[Dict[str, object]]:
    """The members of a sweep summary in trial order (job number), each with the best objective so
    far (`sense`: "max" or "min" is better)."""
    rows = sorted((r for r in summary.rows if str(r["run"]).isdigit()), key=lambda r: int(str(r["run"])))
    history, best = [], None
    pick = min if sense == "min" else max
    for row in rows:
        value = row.get("objective")
        if value is not None:
            best = value if best is None else pick(best, value)
        history.append({"trial": int(str(row["run"])), "status": row.get("status"), "objective": value,
                        "best": best, "overrides": row["overrides"]})
    return history


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def to_markdown(summary: Summary) -> str:
    """The summary as a GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(summary.columns) + " |", "|" + "---|" * len(summary.columns)]
    lines += ["| " + " | ".join(_cell(row[c]).replace("|", "\\|") for c in summary.columns) + " |"
              for row in summary.rows]
    return "\n".join(lines) + "\n"


def write_csv(summary: Summary, path: Path) -> Path:
    """The summary's rows at full precision; an empty cell for a missing value. Written aside and
    renamed (rlnotes.run.files), like every file of a summary: never through a link."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=summary.columns)
    writer.writeheader()
    writer.writerows({c: ("" if row[c] is None else row[c]) for c in summary.columns} for row in summary.rows)
    files.write_text(path, text.getvalue())
    return Path(path)


def write_summary(summary: Summary, out_dir: Path, sections: Sequence[str] = ()) -> List[Path]:
    """summary.md (a markdown table, then `sections`) and summary.csv (full precision) in `out_dir`."""
    out_dir = Path(out_dir)
    md = out_dir / "summary.md"
    note = f"sorted by {summary.sort_by}, best first\n\n" if summary.sort_by else ""
    files.write_text(md, note + to_markdown(summary) + "".join(f"\n{section}" for section in sections))
    return [md, write_csv(summary, out_dir / "summary.csv")]


def print_summary(summary: Summary, console=None, title: Optional[str] = None) -> None:
    """The summary as a rich table on `console` (stdout by default)."""
    console = console or stdout_console()
    sorted_by = f" (sorted by {summary.sort_by}, best first)" if summary.sort_by else ""
    table = Table(title=(title or "runs") + sorted_by, title_justify="left")
    for column in summary.columns:
        text = column in ("run", "overrides", "configuration", "error")
        table.add_column(column, justify="left" if text else "right", overflow="fold", no_wrap=not text)
    for row in summary.rows:
        table.add_row(*(_cell(row[c]) for c in summary.columns))
    console.print(table)


def sweep_sections(sweep_dir: Path, runs: Sequence[Run], summary: Summary,
                   sort_by: Optional[str] = None) -> Tuple[List[str], Optional[Summary]]:
    """What summary.md adds below the table for a sweep: its configurations over their seeds (also
    returned, for summary_by_config.csv) and an Optuna study's best trial and history."""
    sections = []
    groups = seed_groups(runs, sort_by)
    if groups is not None:
        sections.append("## Configurations over their seeds (mean and sample std)\n\n" + to_markdown(groups))
    study = optuna_section(sweep_dir, summary, objective_sense(runs))
    if study is not None:
        sections.append(study)
    return sections, groups


def summarize_sweep(sweep_dir: Path, sort_by: Optional[str] = None, console=None) -> Summary:
    """Summarize every member of a sweep: print the table and write summary.md/csv into the sweep
    dir; with several seeds per configuration also their mean and spread (summary_by_config.csv),
    and for an Optuna study its best trial and history (in summary.md)."""
    runs = [load_run(p) for p in expand([sweep_dir])]
    summary = summarize(runs, sort_by)
    print_summary(summary, console, title=f"sweep {Path(sweep_dir)}")
    sections, groups = sweep_sections(sweep_dir, runs, summary, sort_by)
    written = write_summary(summary, sweep_dir, sections)
    if groups is not None:
        print_summary(groups, console, title="configurations over their seeds")
        written.append(write_csv(groups, Path(sweep_dir) / "summary_by_config.csv"))
    best = optuna_best(sweep_dir)
    if console is not None:
        if best is not None:
            console.print(best, highlight=False)
        console.print(f"written: {', '.join(map(str, written))}")
    return summary


def failed_members(summary: Summary) -> List[str]:
    """The runs of a sweep summary whose member failed."""
    return [str(row["run"]) for row in summary.rows if row.get("status") == "failed"]


class SweepSummary(Callback):
    """Hydra callback (see conf/config.yaml): after `rlnotes train -m ...`, the summary table of
    every member, printed and written to the sweep dir, sorted by `logging.sort_by` (else by the
    objective the members returned). The members that failed are kept in `failed` for the command's
    exit status."""

    failed: List[str] = []

    def on_multirun_end(self, config, **kwargs) -> None:
        console = stdout_console()
        sweep_dir = Path(config.hydra.sweep.dir)
        sort_by = OmegaConf.select(config, "logging.sort_by", default=None)
        # The runs are done and saved: a summary that cannot be made must not fail the sweep.
        for attempt in (sort_by, None) if sort_by is not None else (None,):
            try:
                summary = summarize_sweep(sweep_dir, attempt, console)
            except RunError as e:
                console.print(f"[yellow]rlnotes: {e}[/]" + (" (logging.sort_by)" if attempt else ""))
                continue
            SweepSummary.failed = failed_members(summary)
            if SweepSummary.failed:
                console.print(f"[red]rlnotes: {len(SweepSummary.failed)} of {len(summary.rows)} members failed[/] "
                              f"(runs {', '.join(SweepSummary.failed)} of {sweep_dir}: the error column of "
                              "summary.md, and their logs)", highlight=False)
            return
