"""scripts/bench_trl.py: its arguments, how it reads rlnotes' metrics, its medians and ratios and,
where TRL is installed (pip extra bench), a two-step tiny run of each tool."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_trl", ROOT / "scripts" / "bench_trl.py")
bench = sys.modules["bench_trl"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(bench)


def test_defaults_are_the_full_benchmark():
    args = bench.parse_args([])
    assert args.models == ["tiny", "smollm2-135m"]
    assert args.shapes == ["grpo", "grpo-long", "dpo"]
    assert (args.rounds, args.steps, args.warmup, args.threads, args.seed, args.precisions) == (3, 0, 1, None, 0,
                                                                                             ["fp32"])
    assert bench.default_threads("tiny") == ["default", "1"]
    assert bench.default_threads("smollm2-135m") == [str(os.cpu_count())]
    assert bench.SHAPES["grpo"] == bench.Shape("grpo", prompts=8, group=4, new_tokens=32)
    assert bench.SHAPES["grpo-long"] == bench.Shape("grpo", prompts=8, group=8, new_tokens=64, prompt_tokens=200,
                                                    micro_batch=16)
    assert args.shape_table == bench.SHAPES


def test_micro_batch_flag_sets_every_grpo_shape():
    table = bench.parse_args(["--micro-batch", "8"]).shape_table
    assert table["grpo"].micro_batch == table["grpo-long"].micro_batch == 8 and table["dpo"].micro_batch == 0
    assert bench.parse_args(["--micro-batch", "0", "--shapes", "grpo-long"]).shape_table["grpo-long"].micro_batch == 0


@pytest.mark.parametrize("argv", [["--threads", "two"], ["--threads", "0"], ["--steps", "2", "--warmup", "2"],
                                  ["--rounds", "0"], ["--shapes", "ppo"], ["--micro-batch", "5"]])
def test_bad_arguments_stop_before_any_run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_rlnotes_metrics_become_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/dpo_margin": 0.0},  # an evaluation row without a step's times
            {"step": 1, "time/step_s": 2.0, "time/generate_s": 1.0, "time/reference_s": 0.25, "time/policy_s": 0.7,
             "completion/len_mean": 10.0},
            {"step": 2, "time/step_s": 3.0, "time/reference_s": 0.5, "eval/dpo_accuracy": 1.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = bench.rlnotes_steps(path, bench.Shape("grpo", prompts=8, group=4))
    assert [s["step"] for s in steps] == [1, 2]
    first, second = steps
    assert first["train_s"] == pytest.approx(0.75)
    assert first["completion_tokens"] == 320 and first["tokens_per_s"] == 160
    assert first["policy_s"] == 0.7 and not first["evaluated"]
    assert second["generate_s"] == 0.0 and second["train_s"] == 2.5 and second["completion_tokens"] is None
    assert second["evaluated"]


def _run(tool, step_times, tokens=None, rss=1.0, code=0, evaluated=(), precision="fp32"):
    steps = [bench.step_row(i + 1, t, 0.1 * t, 0.2 * t, tokens, evaluated=i + 1 in evaluated)
             for i, t in enumerate(step_times)]
    return {"tool": tool, "model": "tiny", "shape": "grpo", "threads": "1", "precision": precision, "returncode": code,
            "peak_rss_gib": rss, "steps": steps, "load_before": 1.0, "load_after": 2.0}


def test_medians_leave_out_warmup_evaluations_and_failed_runs():
    runs = [_run("rlnotes", [50.0, 2.0, 4.0, 90.0], tokens=100.0, rss=1.0, evaluated={4}),
            _run("trl", [50.0, 6.0, 6.0], tokens=150.0, rss=3.0),
            _run("rlnotes", [50.0, 3.0, 3.0], tokens=100.0, rss=2.0),
            _run("trl", [50.0, 6.0, 6.0], tokens=150.0, rss=5.0),
            _run("trl", [0.001], code=1, rss=99.0)]
    summary = bench.summarize(runs, warmup=1)
    rl, trl = summary[("tiny", "grpo", "1", "fp32")]["rlnotes"], summary[("tiny", "grpo", "1", "fp32")]["trl"]
    assert rl["n_steps"] == 4 and rl["step_s"] == 3.0 and rl["peak_rss_gib"] == 1.5
    assert trl["n_steps"] == 4 and trl["step_s"] == 6.0 and trl["peak_rss_gib"] == 4.0
    assert rl["generate_s"] == pytest.approx(0.3) and rl["train_s"] == pytest.approx(2.1)
    r = bench.ratios(rl, trl)
    assert r["step_s"] == pytest.approx(2.0) and r["train_s"] == pytest.approx(2.0)
    # rlnotes 100 tokens in 3 s, TRL 150 in 6 s: rlnotes spends 0.03 s a token, TRL 0.04
    assert r["s_per_token"] == pytest.approx((100 / 3) / (150 / 6))
    assert r["peak_rss_gib"] == pytest.approx(4.0 / 1.5)
    table = bench.tables(summary)
    assert "| tiny | grpo | 1 | fp32 | 2.00x | 2.00x | 2.00x | 2.00x | 1.33x | 2.67x |" in table
    assert "| tiny | grpo | 1 | fp32 | rlnotes | 4 | 3 | 0.3 | 0.6 | 2.1 | 100 | 33.3 | 1.50 |" in table
    assert "fp32 / bf16" not in table  # one precision: no such ratios


def test_both_precisions_give_each_tools_fp32_over_bf16_ratios():
    runs = [_run("rlnotes", [9.0, 4.0], tokens=100.0), _run("trl", [9.0, 8.0], tokens=100.0),
            _run("rlnotes", [9.0, 2.0], tokens=100.0, precision="bf16"),
            _run("trl", [9.0, 6.0], tokens=100.0, rss=2.0, precision="bf16")]
    table = bench.tables(bench.summarize(runs, warmup=1))
    assert "| tiny | grpo | 1 | bf16 | 3.00x | 3.00x | 3.00x | 3.00x | 3.00x | 2.00x |" in table  # TRL / rlnotes
    assert "| tiny | grpo | 1 | rlnotes | 2.00x | 2.00x | 2.00x | 2.00x | 2.00x | 1.00x |" in table  # fp32 / bf16
    assert "| tiny | grpo | 1 | trl | 1.33x | 1.33x | 1.33x | 1.33x | 1.33x | 0.50x |" in table
    assert bench.load_line(runs).startswith("1-minute load average: 1.00 at the start of the first run, 2.00 at")


def test_a_case_without_both_tools_is_marked_failed():
    table = bench.tables(bench.summarize([_run("rlnotes", [1.0, 1.0]), _run("trl", [1.0, 1.0], code=1)], warmup=1))
    assert "| tiny | grpo | 1 | fp32 | failed |" in table


def test_prompts_long_enough_and_pairs_that_differ():
    count = len  # a character tokenizer, as the tiny model's
    rows = bench.make_rows(bench.SHAPES["grpo-long"], 16, chat=False, count_tokens=count)
    assert len(rows) == 16 and all(200 <= len(r["prompt"]) < 220 for r in rows)
    assert all(r["prompt"].endswith("Answer with just the number.") and r["answer"].isdigit() for r in rows)
    pairs = bench.make_rows(bench.SHAPES["dpo"], 8, chat=True, count_tokens=count)
    assert all(p["prompt"][0]["role"] == "user" and p["chosen"][0]["role"] == "assistant" for p in pairs)
    assert all(0 < abs(int(p["chosen"][0]["content"]) - int(p["rejected"][0]["content"])) <= 3 for p in pairs)


def test_rlnotes_command_has_the_shape_and_threads(tmp_path):
    prep = {"model_dir": "/m", "chat": True, "seed": 3}
    cmd = bench.rlnotes_command(prep, "smollm2-135m", bench.SHAPES["grpo-long"], "/d.jsonl", "2", 5, tmp_path)
    assert "seed=3" in cmd and bench.trl_spec(prep, bench.SHAPES["grpo"], "/d.jsonl", "2", 5, tmp_path)["seed"] == 3
    for arg in ("algo=grpo", "model.name_or_path=/m", "algo.group_size=8", "rollout.max_new_tokens=64",
                "trainer.micro_batch_size=16",
                "trainer.batch_size=8", "trainer.steps=5", "algo.beta=0.04", "hardware.threads=2",
                "model.system_prompt=null", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                "data.path=/d.jsonl", f"hydra.run.dir={tmp_path}"):
        assert arg in cmd
    assert "hardware.precision=fp32" in cmd
    default = bench.rlnotes_command(prep, "tiny", bench.SHAPES["dpo"], "/d.jsonl", "default", 5, tmp_path)
    assert "algo=dpo" in default and not any(a.startswith("hardware.threads") for a in default)
    bf16 = bench.rlnotes_command(prep, "tiny", bench.SHAPES["grpo"], "/d.jsonl", "1", 5, tmp_path, "bf16")
    assert "hardware.precision=bf16" in bf16
    assert bench.trl_spec(prep, bench.SHAPES["grpo"], "/d.jsonl", "1", 5, tmp_path, "bf16")["precision"] == "bf16"


def test_prompt_lengths_and_prompts_that_differ_are_reported():
    preps = {"tiny": {"prompt_tokens": {"grpo": 43.0}, "batches": {"grpo": [["a", "b"], ["c", "d"]]}}}
    run = _run("trl", [1.0, 1.0])
    for s, n, prompts in zip(run["steps"], (42.0, 44.0), (["a", "b"], ["c", "d"])):
        s["prompt_tokens"], s["prompts"] = n, prompts
    assert bench.prompt_mismatches(preps, [run]) == []
    run["steps"][0]["prompt_tokens"] = 45.0
    assert "TRL's prompts have 44.50 tokens" in bench.prompt_mismatches(preps, [run])[0]
    run["steps"][0]["prompt_tokens"], run["steps"][1]["prompts"] = 42.0, ["d", "c"]
    assert bench.prompt_mismatches(preps, [run]) == ["tiny grpo: at step(s) 2 TRL sampled other prompts than "
                                                     "rlnotes; lengths and times of those steps do not compare"]


def test_trl_reads_the_rows_in_the_order_rlnotes_draws_them(tmp_path):
    """TRL's prompt file holds rlnotes' file's rows in the order rlnotes' data sampler draws them
    with the bench's seed, one batch per step (TRL reads it unshuffled)."""
    from rlnotes.data.sampler import PromptSampler

    table = {"grpo": bench.SHAPES["grpo"]}
    prep = bench.prepare("tiny", tmp_path, table, steps=3, seed=5)
    ours = [json.loads(line) for line in Path(prep["data"]["grpo"]).read_text().splitlines()]
    theirs = [json.loads(line) for line in Path(prep["trl_data"]["grpo"]).read_text().splitlines()]
    sampler = PromptSampler(ours, 8, 5)
    drawn = [sampler.next_batch() for _ in range(3)]
    assert theirs == [r for batch in drawn for r in batch] and theirs != ours
    assert prep["batches"]["grpo"] == [[bench.prompt_key(r["prompt"]) for r in batch] for batch in drawn]


def test_without_trl_it_says_how_to_install_it(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "trl" else find_spec(name))
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path / "out")])
    assert 'pip install -e ".[bench]"' in str(e.value.code)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape", ["grpo", "dpo"])
def test_a_tiny_round_of_each_tool(shape, tmp_path):
    pytest.importorskip("trl")
    table = {shape: bench.replace(bench.SHAPES[shape], micro_batch=16) if shape == "grpo" else bench.SHAPES[shape]}
    prep = bench.prepare("tiny", tmp_path, table, steps=2)
    for tool in bench.TOOLS:
        run = bench.run_one(tool, prep, "tiny", shape, table[shape], "1", 2, tmp_path / tool, timeout=120)
        assert run["returncode"] == 0, run.get("error")
        assert [s["step"] for s in run["steps"]] == [1, 2]
        assert all(s["step_s"] > 0 and s["reference_s"] > 0 and s["train_s"] > 0 for s in run["steps"])
        assert 0.1 < run["peak_rss_gib"] < 8
        if shape == "grpo":
            assert all(s["generate_s"] > 0 and 0 < s["completion_tokens"] <= 8 * 4 * 32 for s in run["steps"])
    if shape == "grpo":  # TRL sampled, step by step, the prompts rlnotes' sampler draws
        assert [s["prompts"] for s in run["steps"]] == prep["batches"]["grpo"]
    assert bench.prompt_mismatches({"tiny": prep}, [run]) == []


def test_a_tiny_bf16_round_of_each_tool(tmp_path):
    """--precisions bf16: rlnotes with hardware.precision=bf16 and TRL with bf16=True, where the CPU
    has bf16 units; on a CPU without them rlnotes refuses bf16 (exit 2) and says why."""
    pytest.importorskip("trl")
    import torch

    from rlnotes.engine.hardware.devices import bf16_units

    table = {"grpo": bench.SHAPES["grpo"]}
    prep = bench.prepare("tiny", tmp_path, table, steps=2)
    native = bf16_units(torch.device("cpu")) is not None
    for tool in bench.TOOLS if native else ("rlnotes",):
        run = bench.run_one(tool, prep, "tiny", "grpo", table["grpo"], "1", 2, tmp_path / tool, timeout=120,
                            precision="bf16")
        if not native:
            assert run["returncode"] == 2 and "has no bf16 matmul instructions" in run["error"]
            return
        assert run["returncode"] == 0, run.get("error")
        assert run["precision"] == "bf16" and [s["step"] for s in run["steps"]] == [1, 2]
        assert run["load_before"] >= 0 and run["load_after"] >= 0
    log = (tmp_path / "rlnotes" / "output.log").read_text()
    assert "bf16 (" in log  # the start line names the bf16 units


# ------------------------------------------------------------------------------ a step's floor

floor = bench.step_floor


def _counted_flops(dims, prompts, prompt_len, lengths, passes):
    """The products of a step counted token by token: every token 2 N below the LM head, a
    completion's (answer's) tokens 2 H in it, and the query at position i (from 1) 4 d i per layer
    in attention; each prompt once, each completion at the positions after its prompt."""
    body, head, d, layers = dims["body"], dims["head"], dims["d"], dims["layers"]
    total = 0
    for _ in range(prompts):
        total += sum(2 * body + 4 * d * layers * i for i in range(1, prompt_len + 1))
        for length in lengths:
            after = range(prompt_len + 1, prompt_len + length + 1)
            total += sum(2 * body + 2 * head + 4 * d * layers * i for i in after)
    return passes * total


def test_step_flops_count_what_a_slow_count_token_by_token_gives():
    dims = {"body": 1000, "head": 300, "d": 8, "layers": 3}
    grpo = floor.step_flops(dims, "grpo", prompts=2, prompt_tokens=5, group=3, completion_tokens=4)
    assert grpo == _counted_flops(dims, 2, 5, [4, 4, 4], passes=4)  # sampling, reference, forward + backward
    assert floor.step_flops(dims, "grpo", 2, 5, 3, 4, reference=False) == _counted_flops(dims, 2, 5, [4] * 3, 3)
    dpo = floor.step_flops(dims, "dpo", prompts=2, prompt_tokens=5, answer_tokens=6)  # two answers of 3
    assert dpo == _counted_flops(dims, 2, 5, [3, 3], passes=3)
    unshared = floor.step_flops(dims, "grpo", 2, 5, 3, 4, shared_prompt=False)  # a prompt with each completion
    assert unshared == _counted_flops(dims, 2, 5, [4] * 3, 1) + 3 * 3 * _counted_flops(dims, 2, 5, [4], 1)
    with pytest.raises(ValueError, match="no floor for algo 'ppo'"):
        floor.step_flops(dims, "ppo", 2, 5)


def test_model_dims_are_the_models_linear_layers(tmp_path):
    import torch

    from rlnotes.core.schema import TinyModelConfig
    from rlnotes.engine.model.loading import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model(TinyModelConfig(), len(tokenizer))
    model.save_pretrained(tmp_path)
    dims = floor.model_dims(str(tmp_path))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert dims["body"] + dims["head"] == sum(m.weight.numel() for m in linears)
    assert dims["head"] == model.get_output_embeddings().weight.numel() > 0
    assert sum(c for _, _, c in dims["linears"]) == len(linears)
    assert (dims["d"], dims["layers"]) == (model.config.hidden_size, model.config.num_hidden_layers)
    rate, per_shape = floor.matmul_rate(dims, threads=1, repeats=2)
    assert sorted(per_shape) == sorted(f"{i}x{o}" for i, o, _ in dims["linears"])
    assert min(per_shape.values()) <= rate <= max(per_shape.values())  # a mean of the shapes' rates


def test_the_rate_takes_each_of_torchs_products_that_compute_the_same():
    """The floor's rate is that of the faster product: torch's default and, where this torch has it,
    oneDNN's with the weight packed, both giving x @ W^T."""
    import torch

    from rlnotes.engine.policy import packed

    x, w = torch.randn(9, 20), torch.randn(30, 20)
    ways = floor.products(x, w)
    assert len(ways) == (2 if packed.available() else 1)
    for product in ways:
        torch.testing.assert_close(product(), x @ w.T, atol=1e-5, rtol=1e-5)
    assert floor.best_time(ways[0], repeats=2) > 0


def test_each_step_is_printed_beside_its_floor():
    dims = {"body": 10**6, "head": 10**5, "d": 16, "layers": 2}
    prep = {"dims": dims, "prompt_tokens": {"grpo": 10.0}}
    runs = [_run("rlnotes", [9.0, 4.0], tokens=320.0), _run("trl", [9.0, 8.0], tokens=320.0)]
    flops = floor.step_flops(dims, "grpo", 8, 10.0, 4, 10.0, reference=bench.GRPO_BETA > 0)
    table = bench.floor_table(bench.summarize(runs, warmup=1), {"tiny": prep}, {"grpo": bench.SHAPES["grpo"]},
                              {("tiny", "1", "fp32"): flops / 2.0})  # a floor of 2 s
    assert "| tiny | grpo | 1 | fp32 | " in table
    assert "| rlnotes | 2 | 4 | 2.00x |" in table and "| trl | 2 | 8 | 4.00x |" in table
