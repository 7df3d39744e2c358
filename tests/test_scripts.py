"""Each script in scripts/ runs on a tiny input. scripts/bench_trl.py has its own tests
(tests/test_bench_trl.py); a script's documented commands also run in tests/test_documented_commands.py.

Scripts that start a process per measurement (bench.py, bench_threads.py) run here with that
process replaced by the same work in this one (8 s of imports each saved); their slow variants
start the processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tests.conftest import compose
from tests.test_documented_commands import ROOT, _script, composed


def _in_process(monkeypatch, module):
    """`module.subprocess.run` of `python -m rlnotes ...` runs rlnotes.commands.cli.main here."""
    from rlnotes.commands.cli import main

    def run(cmd, **kwargs):
        assert cmd[1:3] == ["-m", "rlnotes"], cmd
        return subprocess.CompletedProcess(cmd, main(list(cmd[3:])), "", "")

    monkeypatch.setattr(module.subprocess, "run", run)


# --------------------------------------------------------------------------------------------- bench.py


def test_bench_prints_a_row_per_model(tmp_path, monkeypatch, capsys):
    bench = _script("bench")

    def worker(cmd, **kwargs):  # the `--one MODEL` process, in this one
        assert cmd[2] == "--one"
        return subprocess.CompletedProcess(cmd, 0, json.dumps(bench.run_one(cmd[3], int(cmd[5]))) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", worker)
    monkeypatch.setattr(bench.step_floor, "matmul_rate", lambda dims, threads: (50e9, {}))  # timing: not the point
    monkeypatch.setattr(sys, "argv", ["bench.py", "--models", "tiny", "--steps", "2"])
    bench.main()
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("model | threads | step s")
    row = out[2].split(" | ")
    assert row[0] == "tiny" and row[1] == "1" and float(row[2]) > 0 and float(row[-1]) > 0, out


def test_bench_precision_sets_bf16_log_probs_against_fp32s(capsys):
    """--precision on the tiny model (SmolLM2 as documented): bf16 against fp32 and each precision's
    sampler against its training pass, with figures that show bf16 ran (not 0) and float32 agrees."""
    import re

    _script("bench").precision_check("tiny", 1, 8)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tiny, ") and "bf16 units: " in out[0]
    means = {line.split(":")[0]: float(re.search(r"mean ([0-9.]+)", line).group(1)) for line in out[1:]}
    assert list(means) == ["bf16 training pass against fp32's, fp32's samples", "fp32 sampler against fp32 training "
                           "pass", "bf16 sampler against bf16 training pass"]
    assert 1e-4 < means["bf16 training pass against fp32's, fp32's samples"] < 0.05
    assert means["fp32 sampler against fp32 training pass"] < 1e-4


@pytest.mark.parametrize("choice", ["own-pass", "frozen-packs"])
def test_bench_choice_times_a_steps_phases_with_the_choice_on_and_off(choice, monkeypatch, capsys):
    """--choice: both arms ran (times above 0) and the choice is back on after (what rlnotes runs)."""
    from rlnotes.engine.policy import head, llama, packed, passes

    bench = _script("bench")
    monkeypatch.setattr(sys, "argv", ["bench.py", "--models", "tiny", "--choice", choice, "--rounds", "1"])
    seen = []
    switch = bench.switch
    monkeypatch.setattr(bench, "switch", lambda c, on: seen.append(on) or switch(c, on))
    bench.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"tiny, {choice}, ") and set(seen) == {True, False}
    for line, arm in zip(out[1:], ("on", "off")):
        assert line.startswith(f"{arm}: sampling ") and all(float(x) > 0 for x in re.findall(r"([0-9.]+) s", line))
    assert passes.LlamaLayers is llama.LlamaLayers and llama.frozen_linear is packed.frozen_linear
    assert head.packed_frozen is packed.packed_frozen


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--models", "tiny", "--steps", "2"],
                                  ["--shared-prompt", "--layers", "1", "--rounds", "1", "--threads", "1"]])
def test_bench_as_a_command(argv, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *argv], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert done.returncode == 0 and "failed" not in done.stdout, done.stdout + done.stderr


# --------------------------------------------------------------------------------------------- bench_threads.py


def test_bench_threads_times_one_and_all_cores(monkeypatch, capsys):
    bench = _script("bench_threads")
    _in_process(monkeypatch, bench)
    monkeypatch.setattr(sys, "argv", ["bench_threads.py", "--widths", "64", "--steps", "1", "--rounds", "1"])
    bench.main()
    row = capsys.readouterr().out.strip().splitlines()[-1].split(" | ")
    assert row[0] == "tiny hidden 64" and 0.05 < float(row[1]) < 1 and float(row[2]) > 0 and float(row[3]) > 0, row


@pytest.mark.slow
def test_bench_threads_as_a_command(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_threads.py"), "--widths", "64", "--steps",
                           "3", "--rounds", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0 and "tiny hidden 64 |" in done.stdout, done.stdout + done.stderr


# --------------------------------------------------------------------------------------------- arith_vs_trl.py


@pytest.mark.parametrize("name, runner", [("arith_vs_trl", "run_rlnotes"), ("calculator_vs_trl", "rlnotes_side")])
def test_vs_trl_without_trl_says_so_in_a_line_before_any_run(name, runner, tmp_path, monkeypatch):
    vs = _script(name)
    find_spec = vs.importlib.util.find_spec
    monkeypatch.setattr(vs.importlib.util, "find_spec", lambda name: None if name == "trl" else find_spec(name))
    monkeypatch.setattr(vs, runner, lambda *a: pytest.fail("an rlnotes run started"))
    with pytest.raises(SystemExit) as e:
        vs.main(["--out", str(tmp_path / "out")])
    assert 'pip install -e ".[bench]"' in str(e.value.code) and "\n" not in str(e.value.code)
    assert not (tmp_path / "out").exists()


def test_arith_vs_trl_reads_the_recipe_and_a_run(tmp_path):
    """Its rlnotes half on the tiny model: the experiment's problems (held-out ones apart) and the
    curve and table of a run's evaluations."""
    import torch

    from rlnotes.engine.hardware.devices import bf16_units

    vs = _script("arith_vs_trl")
    cfg, train, test = vs.recipe(0, ["model=tiny", "data.train_size=16", "data.eval_size=8"])
    assert cfg.model.name_or_path == "tiny" and len(train) == 16 and len(test) == 8
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    spec = vs.recipe_spec(cfg, 0, train, test)  # TRL's SFT learns from the warm-up's column, at rlnotes' precision
    assert spec["warmup_column"] == "worked" and all(r["worked"].endswith(r["answer"]) for r in spec["train"])
    assert spec["precision"] == ("bf16" if bf16_units(torch.device("cpu")) else "fp32")  # the recipe's auto
    rows = [{"step": 0, "eval/accuracy": 0.25, "time/eval_s": 3.0, "time/elapsed_s": 3.0},
            {"step": 1, "time/step_s": 2.0, "time/elapsed_s": 5.0},
            {"step": 2, "eval/accuracy": 0.75, "time/eval_s": 1.0, "time/elapsed_s": 8.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = vs.rlnotes_curve(tmp_path)
    assert curve == [{"step": 0, "train_s": 0.0, "accuracy": 0.25}, {"step": 2, "train_s": 4.0, "accuracy": 0.75}]
    assert vs.time_to(curve, 0.5) == 4.0 and vs.time_to(curve, 0.9) is None
    table = vs.table({"rlnotes": curve, "TRL 1.16": curve[:1]})
    assert "| training time to 50% | 0.1 min | not reached |" in table and "| final accuracy | 75.0% | 25.0% |" in table


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_arith_vs_trl_two_steps_of_each_tool(tmp_path):
    """The whole comparison, cut to 2 steps (a warm-up step and a GRPO step) and 8 held-out problems,
    on SmolLM2 (its TRL side renders chat prompts: the tiny model has no chat template)."""
    pytest.importorskip("trl")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "arith_vs_trl.py"), "--out", str(tmp_path),
                           "trainer.steps=2", "sft_warmup.steps=1", "trainer.eval_every=1", "data.eval_size=8"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| final accuracy |" in done.stdout


# --------------------------------------------------------------------------------------------- calculator_vs_trl.py

# SmolLM2-135M-Instruct's own chat template.
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")


def _calculator_tokenizers():
    """(a tokenizer with SmolLM2's template, one with calculator_vs_trl's template for TRL)."""
    from rlnotes.engine.model.loading import tiny_tokenizer

    ours, theirs = tiny_tokenizer(), tiny_tokenizer()
    ours.chat_template, theirs.chat_template = SMOLLM2_TEMPLATE, _script("calculator_vs_trl").tools_chat_template()
    return ours, theirs


def test_calculator_template_for_trl_renders_rlnotes_text():
    """TRL's template renders the tools, a demonstration, and a call as TRL writes it (tool_calls) in
    the text rlnotes renders with SmolLM2's own template (the tools block in the system message)."""
    from rlnotes.agents.builtin import calculator
    from rlnotes.agents.rendering import Renderer, assistant_text
    from rlnotes.agents.tools import tool_schema
    from rlnotes.data.tasks import calculator_demo
    from rlnotes.engine.prompts import as_messages

    ours, theirs = _calculator_tokenizers()
    schemas = [tool_schema(calculator)]
    renderer = Renderer.of(ours, True, schemas)
    demo = calculator_demo({"prompt": "What is 123+456? Answer with just the number.", "answer": "579"})
    prompt, whole = as_messages(demo[:1], "Call the calculator."), as_messages(demo, "Call the calculator.")
    expected = renderer.render(renderer.prompt_messages(prompt), True)
    assert '"name": "calculator"' in expected and expected.endswith("<|im_start|>assistant\n")
    assert theirs.apply_chat_template(prompt, tools=[calculator], tokenize=False, add_generation_prompt=True) == expected
    assert theirs.apply_chat_template(whole, tools=schemas, tokenize=False) == \
        renderer.render(renderer.prompt_messages(whole), False)
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "1+2"}}}]}
    text = theirs.apply_chat_template(prompt + [call], tools=schemas, tokenize=False)
    assert text == expected + assistant_text(call) + "<|im_end|>\n" and "<tool_call>\n{" in text
    assert theirs.apply_chat_template(demo, tokenize=False) == ours.apply_chat_template(demo, tokenize=False)


def test_calculator_template_is_one_trl_takes_for_tools():
    """TRL's own checks: SmolLM2's template cannot render a tool call, the script's can, and only appends."""
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    ours, theirs = _calculator_tokenizers()
    assert not chat_template_utils.supports_tool_calling(ours)
    assert chat_template_utils.supports_tool_calling(theirs)
    assert chat_template_utils.is_chat_template_prefix_preserving(theirs)


def test_calculator_vs_trl_report_takes_medians_and_ratios():
    calc = _script("calculator_vs_trl")
    step = lambda stage, s, gen=0.0: {"stage": stage, "step_s": s, "generate_s": gen, "turns": 2.0}  # noqa: E731
    run = {"returncode": 0, "train_s": 120.0, "peak_rss_gib": 3.0, "load_before": 4.0, "load_after": 5.0}
    runs = {"rlnotes": [{**run, "steps": [step("warm-up", 2.0), step("GRPO", 10.0, 4.0), step("GRPO", 12.0, 6.0)],
                         "accuracy": 0.995}],
            "trl": [{**run, "steps": [step("warm-up", 8.0), step("GRPO", 33.0, 15.0)], "accuracy": None,
                     "generate_calls": 3}]}
    table = calc.report(runs)
    assert "| warm-up step, s | 2 | 8 | 4.00 |" in table
    assert "| GRPO step, s | 11 | 33 | 3.00 |" in table
    assert "| sampling the 16 episodes, s | 5 | 15 | 3.00 |" in table
    assert "| the rest of the GRPO step (rewards, training pass), s | 6 | 18 | 3.00 |" in table
    assert "| 1 | rlnotes | 2.00 | 99.5% | 3.00 | 4.00 -> 5.00 |" in table and "| 1 | TRL 1.16 | 2.00 | - |" in table


# --------------------------------------------------------------------------------------------- smollm2_arith_report.py


def test_smollm2_arith_report_of_a_tiny_run(tmp_path, monkeypatch, capsys):
    """The recipe on the tiny model (a warm-up step, a GRPO step, evaluations), then its report."""
    from rlnotes.commands.train import train

    run = tmp_path / "run"
    train(compose("experiment=smollm2_arith", "model=tiny", "trainer.steps=2", "sft_warmup.steps=1",
                  "trainer.eval_every=1", "eval.size=4", "data.train_size=16", "data.eval_size=4",
                  "logging.progress=false"), run, Console(quiet=True))
    one_digit = tmp_path / "one-digit"  # what `rlnotes eval ... eval.out=DIR` writes: its metrics row
    one_digit.mkdir()
    (one_digit / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.75}) + "\n")
    report = _script("smollm2_arith_report")
    monkeypatch.setattr(sys, "argv", ["smollm2_arith_report.py", str(run), "--out", str(tmp_path / "fig.png"),
                                      "--one-digit", str(one_digit)])
    report.main()
    out = capsys.readouterr().out
    assert (tmp_path / "fig.png").stat().st_size > 0
    assert f"## {run} (seed 0)" in out and "SFT warm-up: 1 steps" in out and "held-out problems fixed" in out
    assert "one-digit accuracy after: 0.750" in out


# --------------------------------------------------------------------------------------------- gpu_check.sh

# Stand-ins for the venv's python, rlnotes and pip: a GPU machine as the script sees one (two GPUs,
# vllm installs); rlnotes records its command line.
FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *device_count\\(\\)\\)*) echo 2 ;;
  *assert*) echo "2 GPU(s): a stand-in" ;;
  -*) cat > /dev/null ;;
esac
"""
FAKE_RLNOTES = """#!/bin/sh
printf '%s\\n' "$*" >> "$(dirname "$0")/../../rlnotes_calls.log"
"""


def test_gpu_check_parses_and_its_runs_compose_on_a_gpu(tmp_path, monkeypatch):
    """gpu_check.sh needs CUDA to do its work: here it runs against stand-ins for a GPU machine's
    venv (no process but bash starts), and every `rlnotes train` it would run is composed and
    validated as on a GPU (vllm, not installed here, is the only error allowed)."""
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    (tmp_path / "scripts").mkdir()
    shutil.copy(script, tmp_path / "scripts" / "gpu_check.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("rlnotes", FAKE_RLNOTES), ("pip", "#!/bin/sh\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_check.sh"), "out"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in (tmp_path / "rlnotes_calls.log").read_text().splitlines()]
    assert len(calls) == 6 and all(c[0] == "train" for c in calls), calls  # 3 on one GPU, ddp, 2 vllm
    for call in calls:
        composed(call[1:], " ".join(call), monkeypatch, "scripts/gpu_check.sh")


# --------------------------------------------------------------------------------------------- calculator_passes.py


@pytest.mark.long
def test_calculator_passes_times_the_three_ways_on_the_tiny_model(capsys):
    passes = _script("calculator_passes")
    passes.main(["--rounds", "1", "--threads", "1", "model=tiny", "trainer.micro_batch_tokens=2000"])
    out = capsys.readouterr().out
    assert "| grpo | " in out and "| warm-up | " in out and "prefix once" in out and "load average" in out
