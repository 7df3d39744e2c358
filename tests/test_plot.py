"""`rlnotes plot` and the sweep summary: figures and tables from a real two-run sweep, and the
table's arithmetic (final, best, sorting, labels) on metrics files written by hand."""

import csv
import json
import sys
from pathlib import Path

import pytest
import yaml

from rlnotes.commands.cli import main
from rlnotes.commands.plot import FIGURES, ema, plot, plot_metrics
from rlnotes.commands.sweep import summarize, to_markdown
from rlnotes.run.records import (
    RunError,
    differing_overrides,
    expand,
    labels,
    load_run,
    swept_overrides,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real two-member sweep: `rlnotes train -m trainer.steps=2 seed=0,1`."""
    out = tmp_path_factory.mktemp("sweep")
    code = main(["train", "-m", "trainer.steps=2", "seed=0,1", f"hydra.sweep.dir={out}", "logging.progress=false"])
    assert code == 0
    return out


def _finals(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def _run(root: Path, name: str, rows, overrides=()) -> Path:
    """A run dir written by hand: metrics.jsonl rows and Hydra's overrides.yaml."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    return run


def test_sweep_writes_a_summary_of_every_member_sorted_by_its_objective(sweep):
    finals = {n: _finals(sweep / n) for n in ("0", "1")}
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    # The objective each member returned: reward/mean over its last (here: both) steps.
    objectives = {n: sum(load_run(sweep / n).series("reward/mean")[1]) / 2 for n in finals}
    order = sorted(finals, key=lambda n: -objectives[n])
    assert [r["run"] for r in rows] == order
    assert [float(r["objective"]) for r in rows] == pytest.approx([objectives[n] for n in order])
    assert {r["status"] for r in rows} == {"completed"}
    for row in rows:
        final = finals[row["run"]]
        assert row["overrides"] == f"seed={row['run']}" and int(row["steps"]) == 2
        assert float(row["reward/mean"]) == final["reward/mean"] and float(row["loss"]) == final["loss"]
        assert float(row["wall_s"]) == final["time/elapsed_s"]
        rewards = load_run(sweep / row["run"]).series("reward/mean")[1]
        assert len(rewards) == 2 and float(row["reward/mean best"]) == max(rewards)
    md = (sweep / "summary.md").read_text()
    assert md.startswith("sorted by objective (reward/mean, mean of the last sweep.last_steps steps), best first") and md.count("| seed=") == 2
    assert swept_overrides(sweep / "1") == ["seed=1"]


def test_plot_of_a_sweep_draws_the_logged_metrics_and_prints_the_table(sweep, tmp_path, capsys):
    assert main(["plot", str(sweep), "--out", str(tmp_path), "--sort", "kl/ref"]) == 0
    out = capsys.readouterr().out
    assert "sorted by kl/ref" in out and "seed=0" in out and "seed=1" in out
    drawn = {p.stem for p in tmp_path.glob("*.png")}
    logged = set(load_run(sweep / "0").metrics())
    assert drawn == {stem for stem, _, metrics in FIGURES if logged & set(metrics)}
    assert {"reward", "kl", "loss", "length"} <= drawn and "dpo_margin" not in drawn
    assert all(p.read_bytes().startswith(PNG) for p in tmp_path.glob("*.png"))
    kls = {n: _finals(sweep / n)["kl/ref"] for n in ("0", "1")}
    with (tmp_path / "summary.csv").open() as f:
        assert [r["run"] for r in csv.DictReader(f)] == sorted(kls, key=kls.get)  # lower KL first
    assert labels([load_run(p) for p in expand([sweep])]) == ["seed=0", "seed=1"]


def test_plot_metrics_makes_one_figure_for_a_readme(sweep, tmp_path):
    from PIL import Image

    path = plot_metrics([sweep], ["reward/mean", "kl/ref"], tmp_path / "docs" / "reward.png")
    width, height = Image.open(path).size
    assert width > 1.8 * height  # two panels side by side
    with pytest.raises(RunError, match="no run logged eval/accuracy; logged: .*reward/mean"):
        plot_metrics([sweep], ["reward/mean", "eval/accuracy"], tmp_path / "x.png")
    with pytest.raises(RunError, match="1 names for 2 runs"):
        plot_metrics([sweep], ["reward/mean"], tmp_path / "y.png", names=["only one"])
    assert plot_metrics([sweep], ["reward/mean"], tmp_path / "z.png", names=["a", "b"]).is_file()


def test_dpo_runs_get_margin_and_accuracy_figures_with_held_out_dashed(tmp_path):
    rows = [{"step": s, "loss": 0.7 - 0.1 * s, "dpo/margin": 0.1 * s, "dpo/accuracy": 0.5 + 0.1 * s} for s in (1, 2, 3)]
    rows[-1].update({"eval/dpo_margin": 0.2, "eval/dpo_accuracy": 0.7})
    a = _run(tmp_path, "a", rows, ["algo=dpo", "algo.beta=0.1"])
    b = _run(tmp_path, "b", rows[:2], ["algo=dpo", "algo.beta=0.5"])
    result = plot([a, b], out=tmp_path / "figs")
    assert {p.stem for p in result.figures} == {"loss", "dpo_margin", "dpo_accuracy"}
    assert result.summary.sort_by == "dpo/accuracy"
    assert [r["overrides"] for r in result.summary.rows] == ["algo.beta=0.1", "algo.beta=0.5"]
    assert {s for s, _, metrics in FIGURES if "eval/dpo_margin" in metrics} == {"dpo_margin"}


def test_summary_final_best_sorting_and_missing_values(tmp_path):
    a = _run(tmp_path, "a", [{"step": 1, "reward/mean": 0.5, "kl/ref": 0.1}, {"step": 2, "reward/mean": 0.25,
                                                                              "kl/ref": None, "time/elapsed_s": 3.0}],
             ["seed=1", "optim.lr=0.01"])
    b = _run(tmp_path, "b", [{"step": 1, "reward/mean": 0.375}], ["seed=2", "optim.lr=0.01"])
    c = _run(tmp_path, "c", [{"step": 4, "loss": 1.0}], ["seed=3", "optim.lr=0.01"])
    with (a / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')  # a run killed mid-write: the partial line is skipped
    runs = [load_run(p) for p in (a, b, c)]
    summary = summarize(runs)
    assert summary.sort_by == "reward/mean"
    assert [r["run"] for r in summary.rows] == ["b", "a", "c"]  # 0.375 > 0.25 (final, not best); none last
    row_a = summary.rows[1]
    assert (row_a["reward/mean"], row_a["reward/mean best"], row_a["kl/ref"]) == (0.25, 0.5, 0.1)
    assert (row_a["steps"], row_a["wall_s"], row_a["overrides"]) == (2, 3.0, "seed=1")
    assert [r["run"] for r in summarize(runs, "kl/ref").rows][0] == "a"
    assert "| b | seed=2 | 1 | - | 0.375 | 0.375 |" in to_markdown(summary)
    with pytest.raises(RunError, match="sort metric 'eval/accuracy' was not logged by these runs; choose one of: "
                                       "reward/mean, kl/ref, time/elapsed_s, loss"):
        summarize(runs, "eval/accuracy")


def test_a_resumed_run_keeps_the_rows_of_its_last_pass(tmp_path):
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3)] + [{"step": s, "loss": 10.0 + s} for s in (2, 3, 4)]
    run = load_run(_run(tmp_path, "run", rows))
    assert run.series("loss") == ([1, 2, 3, 4], [1.0, 12.0, 13.0, 14.0])


def test_labels_use_only_the_overrides_that_differ():
    assert differing_overrides([["a=1", "b=2", "+c=3"], ["a=1", "b=3"]]) == [["b=2", "c=3"], ["b=3"]]
    assert differing_overrides([["a=1"], ["a=1"]]) == [[], []]


def test_ema_is_bias_corrected():
    assert ema([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.5 * 0.5 + 0.5 * 3.0) / 0.75])
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([1.0, 5.0], 0.0) == [1.0, 5.0]


def test_several_runs_without_out_go_beside_the_first_and_the_command_says_where(tmp_path, capsys):
    day = tmp_path / "outputs" / "2026-12-03"
    a = _run(day, "12-00-00-grpo", [{"step": 1, "reward/mean": 0.5}], ["algo=grpo"])
    b = _run(tmp_path / "elsewhere", "12-05-00-rloo", [{"step": 1, "reward/mean": 0.25}], ["algo=rloo"])
    assert main(["plot", str(a), str(b)]) == 0
    out = day / "plot-12-00-00-grpo+12-05-00-rloo"
    assert (out / "reward.png").read_bytes().startswith(PNG) and (out / "summary.md").is_file()
    assert f"no --out given: figures and table written to {out}" in capsys.readouterr().out
    assert not (a / "reward.png").exists()  # the first run's own dir is left as it was


def test_members_of_one_sweep_without_out_go_into_the_sweep(sweep, capsys):
    assert main(["plot", str(sweep / "1"), str(sweep / "0")]) == 0
    assert (sweep / "reward.png").read_bytes().startswith(PNG)
    assert f"written to {sweep}" in capsys.readouterr().out


def test_plot_errors_are_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    run = _run(tmp_path, "run", [{"step": 1, "reward/mean": 0.5}])
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert main(["plot", str(run), "--smooth", "1.5"]) == 2
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("rlnotes: error: ") for line in err)
    assert "missing is not a directory" in err[0] and "has no metrics.jsonl and no run dirs" in err[1]
    assert "--smooth 1.5 must be in [0, 1)" in err[2]
    assert err[3] == "rlnotes: error: rlnotes plot needs matplotlib; install it with: pip install 'rlnotes[plot]'"


def test_figures_and_summaries_replace_a_link_planted_in_their_place(tmp_path):
    """A figure or summary name in the out dir that is a link to a file of the user's: before,
    savefig and the summary wrote through it (the user's file overwritten); now each is written
    aside and renamed over the link, and the file it pointed to is kept."""
    mine = tmp_path / "mine.txt"
    mine.write_text("kept\n")
    a = _run(tmp_path, "a", [{"step": 1, "reward/mean": 0.5}], ["seed=0"])
    b = _run(tmp_path, "b", [{"step": 1, "reward/mean": 0.25}], ["seed=1"])
    out = tmp_path / "figs"
    out.mkdir()
    for name in ("reward.png", "summary.md", "summary.csv"):
        (out / name).symlink_to(mine)
    plot([a, b], out=out)
    assert mine.read_text() == "kept\n"
    assert not any((out / name).is_symlink() for name in ("reward.png", "summary.md", "summary.csv"))
    assert (out / "reward.png").read_bytes().startswith(PNG) and "reward/mean" in (out / "summary.md").read_text()


def test_figures_are_not_written_into_a_runs_final_or_checkpoints(tmp_path, capsys):
    """--out inside a run's final/ or checkpoints/: the run's next save or resume would delete them."""
    from rlnotes.run import config_file
    from tests.conftest import compose

    run = _run(tmp_path, "run", [{"step": 1, "reward/mean": 0.5}])
    config_file.write(run / "config.yaml", compose())
    assert main(["plot", str(run), "--out", str(run / "final" / "figs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlnotes: error: --out {run / 'final' / 'figs'} is inside {run / 'final'}, the final/ folder of "
                   f"the run in {run}, which rlnotes replaces or prunes; choose a dir outside it"]
    assert not (run / "final").exists()


def test_dirs_without_runs_among_several_are_left_out_and_named(tmp_path, capsys):
    """`rlnotes plot outputs/DATE/*` picks up the dir of a run that stopped before its first step."""
    a = _run(tmp_path, "a", [{"step": 1, "reward/mean": 0.5}])
    b = _run(tmp_path, "b", [{"step": 1, "reward/mean": 0.7}])
    stopped = tmp_path / "stopped"
    (stopped / ".hydra").mkdir(parents=True)
    assert main(["plot", str(a), str(stopped), str(b), "--out", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    assert f"left out (no metrics.jsonl, no runs): {stopped}" in out and (tmp_path / "fig" / "reward.png").exists()
    assert main(["plot", str(stopped), str(tmp_path / "stopped")]) == 2  # nothing but such dirs: the one-line error
