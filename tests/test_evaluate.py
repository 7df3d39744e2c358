"""Evaluation: pass@k against brute force, greedy completions against transformers' own greedy
decoding, the trainer.eval_every hook, and the `rlnotes eval` command."""

import itertools
import json
import sys
import types

import pytest
import torch
from rich.console import Console

from rlnotes.commands.cli import main
from rlnotes.commands.train import train
from rlnotes.engine.model.loading import load_base
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.prompts import encode_prompts
from rlnotes.rewards.scoring import Rewards
from rlnotes.training.evaluation import evaluate, pass_at_k
from tests.conftest import compose


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 3, 6), (3, 3, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_one(n, c, k):
    labels = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(labels, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


@pytest.fixture
def starts_with_a(monkeypatch):
    """A checker module: 1.0 when the completion starts with 'a' (an arbitrary, known rule)."""
    module = types.ModuleType("evalcheck")
    module.starts_with_a = lambda prompts, completions, **_: [float(c.startswith("a")) for c in completions]
    module.always = lambda prompts, completions, **_: [1.0] * len(completions)
    monkeypatch.setitem(sys.modules, "evalcheck", module)
    return module


@pytest.mark.parametrize("greedy, n, batch, sizes", [(True, 1, 4, [4, 2]), (False, 4, 8, [8, 8, 8]),
                                                    (False, 4, 3, [4] * 6)])
def test_a_generation_batch_holds_at_most_eval_batch_size_completions(starts_with_a, monkeypatch, greedy, n, batch,
                                                                      sizes):
    """eval.batch_size bounds the completions a generation batch holds (its KV cache grows with them):
    batch_size // samples_per_prompt prompts at a time, one at least; every prompt still gets its n."""
    import rlnotes.training.evaluation as evaluation

    cfg = compose("eval.reward=evalcheck.always", "rollout.max_new_tokens=4", f"eval.batch_size={batch}",
                  f"eval.greedy={str(greedy).lower()}", f"eval.samples_per_prompt={n}")
    model, tokenizer = load_base(cfg.model)
    real, seen = evaluation._sample_and_score, []

    def recorded(model, tokenizer, multi_turn, rows, n, *args):
        rollout, rewards, episodes = real(model, tokenizer, multi_turn, rows, n, *args)
        seen.append(len(rollout.texts))
        return rollout, rewards, episodes

    monkeypatch.setattr(evaluation, "_sample_and_score", recorded)
    rows = [{"prompt": f"Write the letter {c}{s}", "letter": c} for c in "abc" for s in (":", "!")]
    result = evaluate(Policy(model.eval(), tokenizer, reference=model), cfg, rows, Rewards(evaluation.checker_config(cfg)))
    assert seen == sizes and len(result.samples) == 6 * (1 if greedy else n)


def test_greedy_eval_matches_transformers_generate(starts_with_a):
    """Our greedy completions are transformers' greedy completions, and the metrics are those
    of the known rule applied to them."""
    cfg = compose("eval.reward=evalcheck.starts_with_a", "rollout.max_new_tokens=8", "eval.batch_size=3")
    model, tokenizer = load_base(cfg.model)
    policy = Policy(model.eval(), tokenizer, reference=model)
    rows = [{"prompt": f"Write the letter {c}{s}", "letter": c} for c in "abc" for s in (":", "!")]
    from rlnotes.training.evaluation import checker_config

    result = evaluate(policy, cfg, rows, Rewards(checker_config(cfg)))

    expected = []
    for row in rows:
        ids = torch.tensor([encode_prompts(tokenizer, [row["prompt"]], cfg.model.chat_template)[0]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert [s["completion"] for s in result.samples] == expected
    correct = [e.startswith("a") for e in expected]
    assert result.metrics["eval/accuracy"] == pytest.approx(sum(correct) / len(rows))
    assert [s["correct"] for s in result.samples] == correct
    assert [s["letter"] for s in result.samples] == [r["letter"] for r in rows]


def test_sampled_eval_reports_pass_at_k(starts_with_a):
    cfg = compose("eval.reward=evalcheck.always", "eval.greedy=false", "eval.samples_per_prompt=4")
    model, tokenizer = load_base(cfg.model)
    rows = [{"prompt": "Write the letter a:", "letter": "a"}] * 3
    from rlnotes.training.evaluation import checker_config

    result = evaluate(Policy(model, tokenizer, reference=model), cfg, rows, Rewards(checker_config(cfg)))
    assert len(result.samples) == 12
    assert result.metrics["eval/pass@1"] == 1.0 and result.metrics["eval/pass@4"] == 1.0
    assert len({s["completion"] for s in result.samples}) > 1  # sampled, not greedy


def test_eval_every_logs_before_during_and_after(tmp_path):
    cfg = compose("logging.progress=false", "trainer.steps=5", "trainer.eval_every=2", "eval.size=6")
    train(cfg, tmp_path, Console(quiet=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 4, 5]
    assert [json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0, 2, 4, 5]
    samples = (tmp_path / "eval" / "step_000005.jsonl").read_text().splitlines()
    assert len(samples) == 6 and {"prompt", "completion", "reward", "correct", "letter"} <= set(json.loads(samples[0]))


def test_eval_command_uses_the_trained_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "trainer.steps=2", "logging.progress=false", f"hydra.run.dir={run_dir}",
                 "data.letters=b"]) == 0
    out = tmp_path / "ev"
    assert main(["eval", f"eval.policy={run_dir}/final", "data.eval_size=5", f"eval.out={out}"]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 5 and all(s["letter"] == "b" for s in samples)  # the run's data, not the default
    metrics = json.loads((out / "eval.jsonl").read_text())
    assert 0 <= metrics["eval/accuracy"] <= 1 and metrics["eval/len_mean"] > 0
    assert "eval/accuracy" in capsys.readouterr().out


def test_eval_command_rejects_a_missing_policy(tmp_path, capsys):
    assert main(["eval", f"eval.policy={tmp_path}/nope"]) == 2  # the user's input is wrong: as a usage error
    assert "eval.policy" in capsys.readouterr().err


def test_eval_data_evaluates_another_split(tmp_path):
    """eval.data merges over data for the eval split: train on one letter, evaluate on another."""
    cfg = compose("logging.progress=false", "trainer.steps=1", "trainer.eval_every=1", "data.letters=a",
                  "+eval.data={letters: c}", "data.eval_size=4")
    train(cfg, tmp_path, Console(quiet=True))
    samples = [json.loads(line) for line in (tmp_path / "eval" / "step_000001.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {s["letter"] for s in samples} == {"c"}


def test_eval_every_follows_steps_that_jump(tmp_path):
    """PPO takes 4 optimizer steps a batch by default (steps 4, 8, 12): trainer.eval_every=3
    evaluates after every batch that passed a multiple of 3, not only at exact multiples."""
    cfg = compose("algo=ppo", "logging.progress=false", "trainer.steps=12", "trainer.eval_every=3", "eval.size=4")
    train(cfg, tmp_path, Console(quiet=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 4, 8, 12]


def test_eval_command_refuses_a_checker_argument_no_column_fills_before_the_model_loads(monkeypatch, capsys):
    """An eval.reward taking a required argument that the data lacks: one line naming the function,
    the argument and the columns, before any model loads."""
    import rlnotes.commands.eval  # imported now, so that the patch below replaces the name it calls

    module = types.ModuleType("evalneeds")
    module.accuracy = lambda completions, solution, **kwargs: [1.0] * len(completions)
    monkeypatch.setitem(sys.modules, "evalneeds", module)
    monkeypatch.setattr(rlnotes.commands.eval, "load_base", lambda *a: pytest.fail("the model loaded"))
    assert main(["eval", "eval.reward=evalneeds.accuracy"]) == 2
    err = capsys.readouterr().err
    assert "no column 'solution', which reward accuracy needs; its columns: letter, prompt" in err


def test_eval_command_uses_the_runs_file_reward_and_system_prompt(tmp_path, monkeypatch, capsys):
    """A run on a user's file with their own reward: `rlnotes eval eval.policy=RUN/final` scores with
    that reward, on that file's rows, with that system prompt, and the command line still wins."""
    (tmp_path / "evalmod_run_reward.py").write_text(
        "def quarter(prompts, completions, **kwargs):\n    return [0.25] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say a {i}"}], "letter": "a"}) + "\n"
                            for i in range(20)))
    run_dir = tmp_path / "run"
    assert main(["train", f"data.path={path}", "reward=custom", "reward.target=evalmod_run_reward.quarter",
                 "data.system_prompt=Be brief.", "trainer.steps=1", "trainer.batch_size=4", "logging.progress=false",
                 f"hydra.run.dir={run_dir}"]) == 0
    out = tmp_path / "ev"
    trust = "eval.trust_run_code=true"  # the run names its own reward module: this user's own run
    assert main(["eval", f"eval.policy={run_dir}/final", f"eval.out={out}", trust]) == 0, capsys.readouterr().err
    assert json.loads((out / "eval.jsonl").read_text())["eval/reward"] == pytest.approx(0.25)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(s["prompt"][0]["content"].startswith("Say a") for s in samples)  # 10% of 20
    from omegaconf import OmegaConf

    used = OmegaConf.load(out / "config.yaml")
    assert used.data.system_prompt == "Be brief." and used.reward.target == "evalmod_run_reward.quarter"
    assert main(["eval", f"eval.policy={run_dir}/final", f"eval.out={tmp_path / 'ev2'}", "eval.reward=letter_share",
                 "data.system_prompt=null", trust]) == 0
    used = OmegaConf.load(tmp_path / "ev2" / "config.yaml")
    assert used.data.system_prompt is None and used.eval.reward == "letter_share"
    held_out = tmp_path / "held_out.jsonl"  # a file of its own for the run's data=file: its rows, the run's reward
    held_out.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say b {i}"}], "letter": "b"})
                                + "\n" for i in range(3)))
    capsys.readouterr()
    assert main(["eval", f"eval.policy={run_dir}/final", f"eval.out={tmp_path / 'ev3'}",
                 f"data.eval_path={held_out}", trust]) == 0, capsys.readouterr().err
    said = capsys.readouterr()
    assert f"3 eval rows (from {held_out})" in said.err, said.err
    assert f"on{held_out}(3completions)" in "".join(said.out.split())  # the table's title, however it wraps
    samples = [json.loads(line) for line in (tmp_path / "ev3" / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"][-1]["content"] for s in samples] == ["Say b 0", "Say b 1", "Say b 2"]
    assert json.loads((tmp_path / "ev3" / "eval.jsonl").read_text())["eval/reward"] == pytest.approx(0.25)
    sys.modules.pop("evalmod_run_reward", None)


def test_eval_command_on_a_file_smaller_than_a_training_batch(tmp_path, capsys):
    """Evaluating draws no training batch: 5 rows evaluate under the default trainer.batch_size=8."""
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say a {i}", "letter": "a"}) + "\n" for i in range(5)))
    out = tmp_path / "ev"
    assert main(["eval", f"data.path={path}", f"data.eval_path={path}", "reward=letters",
                 f"eval.out={out}"]) == 0, capsys.readouterr().err
    assert len((out / "samples.jsonl").read_text().splitlines()) == 5


def test_a_run_writes_rows_whose_columns_json_cannot_hold_and_keeps_its_own_sample_fields(tmp_path):
    """A parquet file's timestamps (in a column and inside a prompt's messages) are written as their text
    in every file of rows (the eval samples, samples.jsonl), not a TypeError at the first evaluation; a
    column named like a sample's own field (an SFT row's reference completion, a `correct` column) is
    kept as row.<name> and never stands for the sampled completion or its score."""
    import pandas as pd

    when = pd.Timestamp("2024-01-02 03:04:05")
    rows = [{"prompt": [{"role": "user", "content": f"Write the letter a: {i}", "sent": when}], "letter": "a",
             "when": when, "completion": "REFERENCE", "correct": "no"} for i in range(12)]
    path = tmp_path / "rows.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = compose("logging.progress=false", "trainer.steps=1", "trainer.eval_every=1", f"data.path={path}",
                  "reward=letters", "data.eval_size=4", "logging.samples_every=1")
    train(cfg, tmp_path / "run", Console(quiet=True))
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step_000001.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        assert s["when"] == "2024-01-02 03:04:05" and s["prompt"][0]["sent"] == "2024-01-02 03:04:05"
        assert s["row.completion"] == "REFERENCE" and s["completion"] != "REFERENCE"
        assert s["row.correct"] == "no" and s["correct"] is (s["reward"] >= 1.0)
    accuracy = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])["eval/accuracy"]
    assert accuracy == sum(s["correct"] for s in samples) / 4
    assert (tmp_path / "run" / "samples.jsonl").read_text()


def test_sampled_eval_takes_any_seed_torch_takes(starts_with_a):
    """The eval generator's seed (seed, step) stays within torch's range for the largest and smallest seeds."""
    from rlnotes.training.evaluation import checker_config

    for seed in (2 ** 64 - 1, -2 ** 63):
        cfg = compose("eval.reward=evalcheck.always", "eval.greedy=false", "eval.samples_per_prompt=2", f"seed={seed}")
        model, tokenizer = load_base(cfg.model)
        result = evaluate(Policy(model, tokenizer, reference=model), cfg, [{"prompt": "Write the letter a:"}],
                          Rewards(checker_config(cfg)), step=7)
        assert len(result.samples) == 2


def test_eval_command_names_the_policies_of_a_run_dir_given_as_the_policy(tmp_path, capsys):
    """eval.policy=RUN_DIR (not RUN_DIR/final) was blamed on model.name_or_path ("not a whole model ...
    copy the model again")."""
    run_dir = tmp_path / "run"
    assert main(["train", "trainer.steps=2", "trainer.save_every=1", "logging.progress=false",
                 f"hydra.run.dir={run_dir}"]) == 0
    capsys.readouterr()
    for given in (run_dir, run_dir / "checkpoints"):
        assert main(["eval", f"eval.policy={given}", f"eval.out={tmp_path / 'ev'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"rlnotes: error: eval.policy={given} is a run's {'checkpoints ' * (given != run_dir)}dir, not "
                       f"a policy it saved; give {run_dir / 'final'} (or {run_dir / 'checkpoints' / 'step_000002'})")
    assert main(["eval", f"eval.policy={tmp_path}", f"eval.out={tmp_path / 'ev'}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"rlnotes: error: eval.policy={tmp_path} holds neither a LoRA adapter (adapter_config.json) nor a whole model "
        "(config.json); give a run's final/ dir (RUN_DIR/final) or a checkpoint (RUN_DIR/checkpoints/step_N)")
    assert not (tmp_path / "ev").exists()


def test_eval_command_output_keeps_long_paths_whole_when_piped(tmp_path, capsys):
    """stdout and stderr captured (not a terminal: rich's 80 columns): the line naming what was
    evaluated on which rows, and the one naming the results' dir, each keep their paths whole."""
    long = tmp_path / ("a_dir_with_a_long_name_" * 5)
    long.mkdir()
    path = long / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say a {i}", "letter": "a"}) + "\n" for i in range(3)))
    out = long / "evaluation"
    assert main(["eval", f"data.path={path}", f"data.eval_path={path}", "reward=letters",
                 f"eval.out={out}"]) == 0
    said = capsys.readouterr()
    assert f"tiny on {path} (3 completions)" in said.out.splitlines(), said.out
    assert any("eval/accuracy" in line for line in said.out.splitlines())
    assert f"config.yaml, eval.jsonl and samples.jsonl written to {out}" in said.err.splitlines(), said.err


def test_eval_of_a_run_that_held_out_nothing_says_its_rows_were_trained_on(tmp_path, capsys):
    """A run on a whole file (no eval split, no trainer.eval_every) holds nothing out; `rlnotes eval`
    of its policy holds out 10% of that file, rows the run trained on: one line says so, on the
    console and in eval.jsonl. Rows of an eval file of their own, or a run that held rows out, are
    held-out figures and get no such line."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say a {i}", "letter": "a"}) + "\n" for i in range(20)))
    common = [f"data.path={path}", "reward=letters", "trainer.steps=1", "trainer.batch_size=4",
              "logging.progress=false"]
    assert main(["train", *common, f"hydra.run.dir={tmp_path / 'whole'}"]) == 0
    assert main(["train", *common, "data.eval_size=4", f"hydra.run.dir={tmp_path / 'held'}"]) == 0
    capsys.readouterr()
    note = (f"note: the policy's run trained on every row of {path} (it held none out), these eval rows included, so "
            "these scores are not held-out figures; evaluate on rows it never saw (data.eval_path=FILE), or hold rows "
            "out when training (data.eval_size=N, or data.eval_path=FILE)")
    assert main(["eval", f"eval.policy={tmp_path / 'whole' / 'final'}", f"eval.out={tmp_path / 'ev'}"]) == 0
    assert note in capsys.readouterr().err.splitlines()
    assert json.loads((tmp_path / "ev" / "eval.jsonl").read_text())["note"] == note.removeprefix("note: ")
    other = tmp_path / "other.jsonl"
    other.write_text(path.read_text())
    for policy, extra in (("whole", [f"data.eval_path={other}"]), ("held", [])):
        out = tmp_path / f"ev_{policy}"
        assert main(["eval", f"eval.policy={tmp_path / policy / 'final'}", f"eval.out={out}", *extra]) == 0
        assert "note:" not in capsys.readouterr().err
        assert "note" not in json.loads((out / "eval.jsonl").read_text())


def test_seen_in_training_follows_how_the_run_held_rows_out():
    """Data.held_out's rule, read from two data configs: the run held none out of the rows the
    evaluation holds its eval rows out of."""
    from omegaconf import OmegaConf

    from rlnotes.core.data_schema import DataConfig
    from rlnotes.data.fitting import seen_in_training

    def data(**settings):
        return OmegaConf.merge(OmegaConf.structured(DataConfig), {"source": "hub", "name": "org/set", **settings})

    assert seen_in_training(data(), False, data())                           # nothing held out, nothing evaluated
    assert not seen_in_training(data(), True, data())                        # the run held out the default 10%
    assert not seen_in_training(data(eval_size=5), False, data(eval_size=5))
    assert seen_in_training(data(eval_size=0), False, data(eval_size=5))
    assert seen_in_training(data(eval_split="test"), True, data())           # trained on all of train, eval on its rows
    assert not seen_in_training(data(), False, data(eval_split="test"))      # rows of a split of their own
    assert not seen_in_training(data(), False, data(split="validation"))     # other rows
    assert not seen_in_training(data(source="task", name="arith"), False, data(source="task", name="arith"))
