"""The run's console and metrics.jsonl: plain and live progress, the samples table, the summary,
the trackers' sinks, diagnostics warnings, and the library noise kept off the screen."""

import io
import json
import signal
import warnings

import pytest
from rich.console import Console
from rich.control import Control

from rlnotes.commands.train import train
from rlnotes.run.diagnostics import Alert
from rlnotes.run.display import fmt, pick, plain_line, shorten, summarize, summary_table
from rlnotes.run.logger import LOG, MetricsLogger, RunConsole, quiet_libraries
from tests.conftest import compose


def capture(width: int = 200, terminal: bool = False) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)


def text(console: Console) -> str:
    return console.file.getvalue()


ROWS = [
    {"step": 1, "reward/mean": 0.1, "kl/ref": None, "loss": 0.5, "time/elapsed_s": 1.0},
    {"step": 2, "reward/mean": 0.5, "kl/ref": 0.02, "loss": 0.4, "eval/accuracy": 0.25},
    {"step": 3, "reward/mean": 0.3, "kl/ref": 0.03, "loss": 0.45},
]


def test_summary_has_final_and_best_of_each_key_metric():
    by_key = {s["key"]: s for s in summarize(ROWS)}
    assert [s["key"] for s in summarize(ROWS)] == ["reward/mean", "eval/accuracy", "kl/ref", "loss"]
    assert by_key["reward/mean"]["final"] == 0.3 and by_key["reward/mean"]["best"] == 0.5
    assert by_key["reward/mean"]["best_step"] == 2
    # A metric logged now and then: its final value is its last one, wherever that row is.
    assert by_key["eval/accuracy"]["final"] == 0.25 and by_key["eval/accuracy"]["final_step"] == 2
    # kl and loss are neither better high nor low: no best.
    assert by_key["kl/ref"]["final"] == 0.03 and by_key["kl/ref"]["best"] is None
    assert by_key["loss"]["best"] is None


def test_summary_screen(tmp_path):
    console = capture()
    alerts = [Alert("truncation", 7, "cut off")]
    console.print(summary_table(ROWS, tmp_path, 6.0, alerts, tmp_path / "final"))
    out = text(console)
    assert "done: 3 steps in 6.0 s (2 s/step)" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["reward"] == ["reward", "0.300", "0.500", "2"]
    assert lines["kl"] == ["kl", "0.030"]
    assert "eval acc" in out and "warned at step 7: truncation" in out
    assert f"run dir: {tmp_path}" in out and f"policy:  {tmp_path / 'final'}" in out


def test_numbers_and_text_fit_a_narrow_screen():
    assert [fmt(v) for v in (0.8125, 0.0, 16.0, 123.456, 2e-5, -0.25, None)] == [
        "0.812", "0.000", "16.0", "123.5", "2e-05", "-0.250", "-"]
    assert shorten("short", 10) == "short"
    assert shorten("line one\nline two", 40) == "line one⏎line two"
    cut = shorten("abcdefghijklmnopqrstuvwxyz", 11)
    assert cut == "abcde…vwxyz" and len(cut) == 11
    assert pick(32, 4) == [0, 8, 16, 24] and pick(3, 4) == [0, 1, 2]


def test_plain_mode_prints_a_line_every_print_every_steps(tmp_path):
    console = capture()
    logger = MetricsLogger(tmp_path, 10, console, progress=False, print_every=4)
    for step in range(1, 11):
        logger.log(step, {"reward/mean": step / 10, "loss": 1.0, "perf/tokens": 3.0})
    logger.close()
    lines = text(console).splitlines()
    assert [line.split()[1] for line in lines] == ["4/10", "8/10", "10/10"]  # and always the last step
    assert lines[0].startswith("step 4/10  reward 0.400  loss 1.000  ")
    assert "steps/s" in lines[0] and "eta" in lines[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[2]["reward/mean"] == pytest.approx(0.3)


def test_plain_line_keeps_metrics_seen_earlier():
    line = plain_line(5, 10, {"reward/mean": 0.5, "eval/accuracy": 0.25, "time/step_s": 1.0}, elapsed=10.0)
    assert line == "step 5/10  reward 0.500  eval acc 0.250  2 s/step  eta 00:00:10"


def test_progress_on_a_non_terminal_prints_plain_lines(tmp_path):
    console = capture()
    logger = MetricsLogger(tmp_path, 2, console, progress=True)
    assert logger.progress is None
    logger.log(1, {"reward/mean": 0.25})
    logger.log(2, {"reward/mean": 0.5})
    logger.close()
    assert text(console).splitlines()[-1].startswith("step 2/2  reward 0.500")


def test_live_progress_on_a_terminal_shows_the_key_metrics(tmp_path):
    console = capture(width=120, terminal=True)
    logger = MetricsLogger(tmp_path, 4, console, progress=True)
    assert logger.progress is not None and logger.metrics_panel() is None  # nothing logged yet
    for step in range(1, 5):
        logger.observe(step, {})
        logger.log(step, {"reward/mean": 0.25 * step, "kl/ref": 0.01, "loss": 0.1, "time/step_s": 0.2})
    logger.close()
    out = text(console)
    assert "4/4" in out and "steps/s" in out and "eta" in out
    assert "reward" in out and "1.000" in out and "kl" in out
    assert "step 4/4" not in out  # no plain lines beside the live display


def test_samples_table_every_samples_every_steps(tmp_path):
    console = capture(width=100)
    logger = MetricsLogger(tmp_path, 6, console, progress=False, samples_every=3, samples_shown=2, print_every=100)
    samples = {"prompts": [f"prompt {i}" for i in range(8)],
               "completions": ["x" * 200] + [f"answer {i}" for i in range(1, 8)], "rewards": [0.0, 1.0] * 4}
    for step in range(1, 7):
        logger.observe(step, {}, samples)
    logger.observe(7, {}, None)  # a step that sampled nothing (DPO, SFT): no table
    logger.close()
    out = text(console)
    assert "samples at step 3" in out and "samples at step 6" in out
    assert "samples at step 1" not in out and "samples at step 7" not in out
    assert "prompt 0" in out and "prompt 4" in out and "prompt 1" not in out  # two picks spread over the batch
    assert "…" in out and "x" * 100 not in out  # the long completion is shortened
    saved = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"], s["reward"]) for s in saved] == [
        (3, "prompt 0", 0.0), (3, "prompt 4", 0.0), (6, "prompt 0", 0.0), (6, "prompt 4", 0.0)]
    assert saved[0]["completion"] == "x" * 200  # the file keeps the whole text


def test_samples_table_shows_a_conversation_as_its_turns_and_the_file_keeps_the_messages(tmp_path):
    console = capture(width=160)
    logger = MetricsLogger(tmp_path, 1, console, progress=False, samples_every=1, samples_shown=1, print_every=100)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write the letter a"}]
    logger.observe(1, {}, {"prompts": [prompt], "completions": [[{"role": "assistant", "content": "aaa"}]],
                           "rewards": [1.0]})
    logger.close()
    assert "system: Be brief.⏎user: Write the letter a" in text(console) and "assistant: aaa" in text(console)
    saved = json.loads((tmp_path / "samples.jsonl").read_text())
    assert saved["prompt"] == prompt and saved["completion"] == [{"role": "assistant", "content": "aaa"}]


def test_a_resumed_run_keeps_its_schedules_and_speed(tmp_path):
    """Resumed at step 50: no samples table or plain line for having crossed 20 and 40 before, and
    the speed counts this process's steps only."""
    earlier = [{"step": s, "reward/mean": 0.9 if s == 30 else s / 100} for s in range(1, 51)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in earlier))
    console = capture()
    logger = MetricsLogger(tmp_path, 60, console, progress=False, samples_every=20, print_every=20)
    logger.begin(50)
    samples = {"prompts": ["p"], "completions": ["c"], "rewards": [1.0]}
    for step in range(51, 61):
        logger.observe(step, {}, samples)
        logger.log(step, {"reward/mean": step / 100})
    logger.close()
    logger.start -= 10.0  # as if these 10 steps took 10 s
    logger.summary()
    out = text(console)
    assert out.count("samples at step") == 1 and "samples at step 60" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["60/60"]
    assert "done: 60 steps, resumed at step 50: 10 steps in 10." in out
    best = [line.split() for line in out.splitlines() if line.strip().startswith("reward")][0]
    assert best == ["reward", "0.600", "0.900", "30"]  # over the whole run's metrics.jsonl


def test_a_resumed_training_run_counts_from_its_checkpoint(tmp_path):
    train(compose("logging.progress=false", "trainer.steps=4", "trainer.save_every=2"), tmp_path, capture())
    console = capture()
    train(compose("logging.progress=false", "trainer.steps=6", "trainer.resume=auto", "logging.print_every=1"),
          tmp_path, console)
    out = text(console)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["5/6", "6/6"]
    assert "done: 6 steps, resumed at step 4: 2 steps in" in out


class FakeSink:
    def __init__(self):
        self.rows, self.closed = [], 0

    def log(self, step, row):
        self.rows.append((step, row))

    def close(self):
        self.closed += 1


def test_sinks_get_every_row_and_are_closed_once(tmp_path):
    sinks = [FakeSink(), FakeSink()]
    logger = MetricsLogger(tmp_path, 3, capture(), progress=False, sinks=sinks)
    logger.log(1, {"reward/mean": 0.5, "kl/ref": float("nan")})
    logger.log(3, {"reward/mean": 0.75})
    logger.close()
    logger.close()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for sink in sinks:
        assert [step for step, _ in sink.rows] == [1, 3] and sink.closed == 1
        assert [row for _, row in sink.rows] == written  # the very rows of metrics.jsonl, NaN as None
    assert written[0]["kl/ref"] is None


class FirstCallWatcher:
    """Returns one alert, at step 2."""

    def observe(self, step, metrics):
        return [Alert("kl_blowup", step, "lower optim.lr")] if step == 2 else []


def test_a_warning_goes_to_the_screen_and_warnings_log(tmp_path):
    console = capture()
    logger = MetricsLogger(tmp_path, 3, console, progress=False, watcher=FirstCallWatcher(), print_every=100)
    for step in (1, 2, 3):
        logger.observe(step, {"kl/ref": 5.0})
    logger.close()
    logger.summary()
    out = text(console)
    assert "warning at step 2 (kl_blowup): lower optim.lr" in out
    assert "warned at step 2: kl_blowup" in out
    assert (tmp_path / "warnings.log").read_text() == "step 2 kl_blowup: lower optim.lr\n"


def test_library_deprecation_notices_are_silenced():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        warnings.warn("old api", FutureWarning)
        warnings.warn("old api", DeprecationWarning)
        warnings.warn("something real", UserWarning)
    assert [str(w.message) for w in caught] == ["something real"]


def test_a_tiny_run_prints_its_batches_samples_and_summary(tmp_path):
    console = capture(width=160)
    cfg = compose("logging.progress=false", "trainer.steps=4", "logging.samples_every=2", "logging.samples_shown=3",
                  "logging.print_every=2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_libraries()
        train(cfg, tmp_path, console)
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    out = text(console)
    assert "batch: 8 prompts x 4 = 32 completions; 1 optimizer step per batch;" in out
    assert "run: 4 optimizer steps = 4 batches = 32 prompts = 0.032 epochs of the train set" in out
    assert out.count("samples at step") == 2 and "samples at step 4" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["2/4", "4/4"]
    assert "done: 4 steps in" in out and f"run dir: {tmp_path}" in out and f"policy:  {tmp_path / 'final'}" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("  reward")}
    assert final["reward"] == fmt(rows[-1]["reward/mean"])
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 6
    assert not (tmp_path / "warnings.log").exists()


# ---------------------------------------------------------------------------------------------
# RUN_DIR/train.log: what the run's console said, as plain text


def test_the_run_log_starts_when_the_run_owns_its_dir_and_keeps_what_was_said_before(tmp_path):
    console = RunConsole(file=io.StringIO(), width=100, color_system=None)
    console.print("[yellow]rlnotes grpo on tiny[/] -> somewhere")  # the start line: the run may yet be refused
    assert not (tmp_path / LOG).exists()
    console.open_log(tmp_path)
    console.print(Control.home())  # cursor moves are not text
    console.print("[red]rlnotes: error:[/] a line")
    assert (tmp_path / LOG).read_text() == "rlnotes grpo on tiny -> somewhere\nrlnotes: error: a line\n"
    quiet = RunConsole(file=io.StringIO(), quiet=True)  # a rank other than 0
    quiet.open_log(tmp_path / "q")
    quiet.print("said")
    assert not (tmp_path / "q" / LOG).exists()


def test_with_the_live_bar_the_log_gets_the_plain_lines(tmp_path):
    console = RunConsole(file=io.StringIO(), width=100, force_terminal=True)
    console.open_log(tmp_path)
    logger = MetricsLogger(tmp_path, 4, console, progress=True, print_every=2)
    for step in range(1, 5):
        logger.log(step, {"reward/mean": step / 10})
    logger.close()
    lines = (tmp_path / LOG).read_text().splitlines()
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"] and "reward 0.400" in lines[1]
    assert "\x1b" not in "".join(lines)


def test_train_log_holds_every_line_the_run_printed_and_how_to_resume(tmp_path, monkeypatch, capsys):
    from rlnotes.commands.cli import main
    from tests.test_checkpoint import stop_at

    monkeypatch.chdir(tmp_path)
    args = ["train", "trainer.steps=4", "trainer.batch_size=4", "logging.progress=false"]
    assert main([*args, "hydra.run.dir=whole"]) == 0
    printed = capsys.readouterr().err.splitlines()
    log = (tmp_path / "whole" / LOG).read_text().splitlines()
    assert printed[0].startswith("data: ") and log == printed  # the start lines to the summary, as shown
    with monkeypatch.context() as patch:
        stop_at(patch, "grpo", 3, signal.SIGINT)
        main([*args, "hydra.run.dir=split"])
    resume = (tmp_path / "split" / LOG).read_text().splitlines()[-1].split()
    assert resume[:2] == ["rlnotes", "train"] and "trainer.resume=auto" in resume
    assert main(resume[1:]) == 0  # the printed command, run as printed
    log = (tmp_path / "split" / LOG).read_text()
    assert "SIGINT at step 2" in log and "resuming from" in log and log.rstrip().endswith(str(tmp_path / "split" / "final"))
