"""The `rlnotes` command: a real run through the console script, sweeps, and one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlnotes
from rlnotes.commands.cli import main
from tests.conftest import RLNOTES

REQUIRED = ("step", "reward/mean", "reward/std", "loss", "kl/ref", "policy/clip_frac", "completion/len_mean",
            "optim/grad_norm", "optim/lr", "time/elapsed_s", "perf/tokens_per_s")


@pytest.mark.long
def test_console_script_trains_and_saves_a_loadable_adapter(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [RLNOTES, "train", "algo=grpo", "model=tiny", "trainer.steps=3", f"hydra.run.dir={tmp_path}"]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(key in rows[-1] for key in REQUIRED)

    from omegaconf import OmegaConf
    from peft import PeftModel

    from rlnotes.core.schema import ModelConfig
    from rlnotes.engine.model.loading import load_base

    base, _ = load_base(OmegaConf.structured(ModelConfig()))
    model = PeftModel.from_pretrained(base, tmp_path / "final")
    assert any("lora_B" in name and p.abs().sum() > 0 for name, p in model.named_parameters())


def test_multirun_gives_one_run_dir_per_combination(tmp_path):
    code = main(["train", "-m", "seed=1,2", "trainer.steps=2", "logging.progress=false",
                 f"hydra.sweep.dir={tmp_path}"])
    assert code == 0
    runs = sorted(p.parent for p in tmp_path.glob("*/metrics.jsonl"))
    assert [p.name for p in runs] == ["0", "1"]
    seeds = [int(line.split(":")[1]) for p in runs for line in (p / "config.yaml").read_text().splitlines()
             if line.startswith("seed:")]
    assert seeds == [1, 2]


def test_run_dirs_and_the_start_line_name_the_chosen_algorithm(tmp_path, monkeypatch, capsys):
    """algo=rloo is served by the reinforce runner, but the run is rloo's: outputs/DATE/TIME-rloo."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "algo=rloo", "trainer.steps=1", "logging.progress=false"]) == 0
    assert [p.name.split("-")[-1] for p in tmp_path.glob("outputs/*/*")] == ["rloo"]
    assert "rlnotes rloo on tiny" in capsys.readouterr().err
    run = next(tmp_path.glob("outputs/*/*"))
    assert "  preset: rloo\n  name: reinforce\n" in (run / "config.yaml").read_text()


def test_a_sweep_over_presets_shares_one_sweep_dir_named_for_them(tmp_path, monkeypatch):
    """Each member resolves the dir pattern to its own choice; the sweep must still be one dir."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-m", "algo=dr_grpo,dapo", "trainer.steps=1", "trainer.batch_size=2",
                 "logging.progress=false"]) == 0
    sweeps = list(tmp_path.glob("multirun/*/*"))
    assert [p.name.split("-", 3)[-1] for p in sweeps] == ["dr_grpo+dapo"], sweeps
    assert sorted(p.name for p in sweeps[0].iterdir() if p.is_dir()) == ["0", "1"]
    assert (sweeps[0] / "summary.md").is_file()
    from omegaconf import OmegaConf

    from rlnotes.run.tracking import run_info

    member = sweeps[0] / "1"
    name = run_info(OmegaConf.load(member / "config.yaml").logging, member, {}).name  # the trackers' run name
    assert name == f"{sweeps[0].name}/1 algo=dapo" and name.split("-", 3)[-1].startswith("dr_grpo+dapo/1")


def test_every_algo_option_names_itself():
    from tests.conftest import compose

    for name in _options("algo").split(", "):
        assert compose(f"algo={name}").algo.preset == name


def _options(group):
    """The options of a config group, as Hydra lists them: the YAML files of conf/<group>/."""
    return ", ".join(sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / group).glob("*.yaml")))


@pytest.mark.parametrize("override, expected", [
    ("algo=foo", f"algo=foo is not an option; choose one of: {_options('algo')}"),
    # A hub id or path where a preset's name goes (Hydra reads model=ORG/NAME as the group model/ORG).
    ("model=HuggingFaceTB/SmolLM2-135M", "model=HuggingFaceTB/SmolLM2-135M: model= takes a preset, one of: "
     f"{_options('model')}; to load HuggingFaceTB/SmolLM2-135M give model.name_or_path=HuggingFaceTB/SmolLM2-135M"),
    ("data=runs/rows.jsonl", "to load runs/rows.jsonl give data.path=runs/rows.jsonl"),
    ("algo=a/b", f"algo=a/b: algo= takes a preset, one of: {_options('algo')}"),
    ("trainer.foo=1", "trainer.foo is not a setting; valid keys under trainer: steps, batch_size"),
    ("data.eval_pth=x.jsonl", "data.eval_pth is not a setting; did you mean data.eval_path? valid keys under data:"),
    ("optim.lr=abc", "optim.lr: Value 'abc' of type 'str' could not be converted to Float"),
    ("rollout.merge_adapter=maybe", "rollout.merge_adapter: Value 'maybe' is not a valid bool (true or false)"),
    ("model.lora={r: 8, rank: 2}", "model.lora.rank is not a setting; valid keys under model.lora: r, alpha"),
    ("algo.aggregation=bogus", "algo.aggregation='bogus' is not valid; choose one of: token-mean"),
    ("reward=custom", "reward=custom needs the import path of your function: reward.target="),
    ("seed=1,2", "add -m"),
    ("algo.group_size=1", "GRPO needs at least 2"),
    ("trainer.batch_size=0", "trainer.batch_size=0 must be at least 1"),
    # Values Hydra's grammar reads only quoted: the line gives the override as the shell should pass it.
    ("hydra.run.dir=/tmp/ü/run", "only in quotes; give it as \"hydra.run.dir='/tmp/ü/run'\""),
    ("hydra.run.dir=~/runs/a", f"give it as \"hydra.run.dir={os.path.expanduser('~/runs/a')}\""),
    ("trainer.steps=[1,", "Hydra cannot read this override"),
])
def test_a_wrong_override_fails_in_one_line(override, expected, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: ") and expected in err and "\n" not in err, err


@pytest.mark.parametrize("argv, expected", [
    (["--confg-name", "mine"], "unrecognized arguments: --confg-name; did you mean --config-name?"),
    (["--cfg", "jbo"], "invalid choice: 'jbo' (choose from 'job', 'hydra', 'all')"),
    (["--config-dir"], "--config-dir/-cd: expected one argument"),
])
def test_a_wrong_flag_fails_in_one_line(argv, expected, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: ") and expected in err and "\n" not in err, err


def test_every_sweep_member_is_checked_before_any_run(capsys, tmp_path):
    assert main(["train", "-m", "trainer.steps=2,0", f"hydra.sweep.dir={tmp_path}"]) == 2
    assert "trainer.steps=0 must be at least 1" in capsys.readouterr().err
    assert not list(tmp_path.glob("*/metrics.jsonl"))


def test_unknown_command_and_usage(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'; commands: train" in capsys.readouterr().err
    assert main([]) == 0 and "rlnotes train" in capsys.readouterr().out


def test_version_prints_the_one_version(capsys):
    """rlnotes.__version__ is the version's one copy: pyproject.toml reads it (tests/test_package.py
    checks the wheel's), and each run's config.yaml records it (tests/test_checkpoint.py)."""
    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        assert capsys.readouterr().out == f"rlnotes {rlnotes.__version__}\n"
    assert main(["--help"]) == 0 and "rlnotes --version" in capsys.readouterr().out


def test_usage_and_a_mistyped_command_answer_before_torch_is_imported():
    """The environment the commands set (threads, hub timeouts) must be in place before torch and
    the Hugging Face libraries load, and `rlnotes --help` needs neither."""
    probe = ("import sys; from rlnotes.commands.cli import main; main(['--help']); main(['--version']); "
             "main(['trian']); "
             "print(sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_help_lists_the_config_groups(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for group in ("algo", "model", "reward", "data"):
        assert f"{group}: {_options(group)}" in text
    assert "model: smollm2-135m, tiny" in text


def test_eval_help_prints_help_and_evaluates_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--help"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("rlnotes eval: ") and "eval.policy=RUN_DIR/final" in out.out
    assert not (tmp_path / "outputs").exists()


def test_auto_data_and_reward_follow_the_algorithm_and_task():
    from tests.conftest import compose

    cfg = compose()
    assert cfg.data.name == "letters" and [f.fn for f in cfg.reward.functions] == ["letter_share"]
    cfg = compose("data=arith")
    assert [f.fn for f in cfg.reward.functions] == ["number_match"]
    cfg = compose("data=arith", "reward=letters")
    assert [f.fn for f in cfg.reward.functions] == ["letter_share"]


def test_weighted_rewards_from_a_users_config_dir(tmp_path, monkeypatch):
    """A user's own reward module and a YAML of weighted functions in their --config-dir."""
    (tmp_path / "userrewards.py").write_text(
        "def brevity(prompts, completions, letter, **_):\n"
        "    assert len(letter) == len(completions)  # the row's columns arrive as keywords\n"
        "    return [1.0 / (1 + len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "conf" / "reward").mkdir(parents=True)
    (tmp_path / "conf" / "reward" / "mix.yaml").write_text(
        "functions:\n  - {fn: letter_share, weight: 1.0}\n  - {fn: userrewards.brevity, weight: 0.5}\n")
    run = tmp_path / "run"
    assert main(["train", "--config-dir", str(tmp_path / "conf"), "reward=mix", "trainer.steps=1",
                 "logging.progress=false", f"hydra.run.dir={run}"]) == 0
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = row["reward/letter_share"] + 0.5 * row["reward/brevity"]
    assert row["reward/mean"] == pytest.approx(expected, rel=1e-5)
    assert 0 < row["reward/brevity"] < 1


@pytest.mark.long
def test_every_algorithm_runs_through_the_console_script(tmp_path):
    """One sweep over every algo option with no other override: each picks its own data and reward."""
    algos = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "algo").glob("*.yaml"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([RLNOTES, "train", "-m", f"algo={','.join(algos)}", "trainer.steps=2",
                          "logging.progress=false", f"hydra.sweep.dir={tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    for i, algo in enumerate(algos):
        run = tmp_path / str(i)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert rows and rows[-1]["step"] == 2, algo
        assert (run / "final").is_dir(), algo
