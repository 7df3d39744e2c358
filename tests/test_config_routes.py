"""Every route a config takes into a run gets the one check the command line gets, before anything
loads: a --config-name file (with --config-dir), the group files of a --config-dir, each member of
a sweep. A bad value, a key that is not a setting and a YAML syntax error are each one line naming
the file and the line; the check imports neither torch nor transformers."""

import subprocess
import sys

import pytest

from rlnotes.commands.cli import main
from rlnotes.engine.policy.policy import Policy

MINE_HEAD = "defaults:\n  - config\n  - _self_\n\n"


@pytest.fixture
def conf(tmp_path, monkeypatch):
    """A user's config dir, the working directory inside which the files are named; no model may load."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Policy, "from_config", classmethod(lambda *a: pytest.fail("the model loaded")))
    (tmp_path / "myconf" / "experiment").mkdir(parents=True)
    (tmp_path / "myconf" / "reward").mkdir()
    return tmp_path / "myconf"


def refused(capsys, *argv) -> str:
    assert main(["train", *argv, "logging.progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: ") and "\n" not in err, err
    return err.removeprefix("rlnotes: error: ")


@pytest.mark.parametrize("body, line, expected", [
    ("algo:\n  beta: -0.1\n", 6, "algo.beta=-0.1 must be at least 0 (the weight of the KL penalty"),
    ("optim:\n  lr: 5.0\nrollout:\n  temperature: 0.7\n", 6, "optim.lr=5 must be in (0, 1]"),
    ("rollout:\n  temperature: 0\n", 6, "rollout.temperature=0 must be greater than 0"),
    ("trainer:\n  steps: many\n", 6, "trainer.steps: Value 'many' of type 'str' could not be converted to Integer"),
])
def test_a_bad_value_in_a_config_name_file_names_the_file_and_line(conf, capsys, body, line, expected):
    (conf / "mine.yaml").write_text(MINE_HEAD + body)
    err = refused(capsys, "--config-dir", "myconf", "--config-name", "mine")
    assert err.startswith(f"myconf/mine.yaml, line {line}: {expected}"), err


def test_the_command_line_wins_over_the_file_and_is_named_as_itself(conf, capsys):
    (conf / "mine.yaml").write_text(MINE_HEAD + "algo:\n  beta: 0.1\n")
    err = refused(capsys, "--config-dir", "myconf", "--config-name", "mine", "algo.beta=-2")
    assert err.startswith("algo.beta=-2 must be at least 0")


def test_a_bad_value_in_a_group_file(conf, capsys):
    (conf / "experiment" / "port.yaml").write_text("# @package _global_\noptim:\n  lr: 5.0\n")
    err = refused(capsys, "--config-dir", "myconf", "experiment=port")
    assert err.startswith("myconf/experiment/port.yaml, line 3: optim.lr=5 must be in (0, 1]"), err
    (conf / "reward" / "mix.yaml").write_text("functions:\n  - fn: exact_match\n    weight: 1.0\ntimeout_s: -1\n")
    err = refused(capsys, "--config-dir", "myconf", "reward=mix")
    assert err.startswith("myconf/reward/mix.yaml, line 4: reward.timeout_s=-1.0 must be > 0"), err


@pytest.mark.parametrize("where, argv, body, expected", [
    ("mine.yaml", ["--config-name", "mine"], MINE_HEAD + "trainer:\n  stpes: 3\n",
     "myconf/mine.yaml, line 6: trainer.stpes is not a setting; did you mean trainer.steps? valid keys under "
     "trainer: steps, batch_size"),
    ("experiment/port.yaml", ["experiment=port"], "# @package _global_\nrollout:\n  temprature: 0.7\n",
     "myconf/experiment/port.yaml, line 3: rollout.temprature is not a setting; did you mean rollout.temperature?"),
    ("reward/mix.yaml", ["reward=mix"], "functions:\n  - fn: exact_match\n    wieght: 1.0\n",
     "myconf/reward/mix.yaml, line 3: reward.functions[0].wieght is not a setting; did you mean "
     "reward.functions[0].weight? valid keys under reward.functions[0]: fn, weight, args, name"),
])
def test_a_typo_in_a_users_file_names_the_file_line_key_and_the_closest_key(conf, capsys, where, argv, body, expected):
    (conf / where).write_text(body)
    assert refused(capsys, "--config-dir", "myconf", *argv).startswith(expected)


def test_an_experiment_that_does_not_exist_is_refused_not_skipped(conf, capsys):
    """experiment= is a group like the others: a misspelled recipe (rlnotes' own or a user's) is one
    line with the closest name, not the default run trained in its place."""
    (conf / "experiment" / "port.yaml").write_text("# @package _global_\ntrainer:\n  steps: 2\n")
    assert refused(capsys, "experiment=smollm2_arithh").startswith(
        "experiment=smollm2_arithh is not an option; did you mean experiment=smollm2_arith? choose one of: letters_env,")
    err = refused(capsys, "--config-dir", "myconf", "experiment=prot")
    assert err.startswith("experiment=prot is not an option; did you mean experiment=port?") and "port" in err, err
    assert not (conf.parent / "outputs").exists()


@pytest.mark.parametrize("where, argv, body, line", [
    ("mine.yaml", ["--config-name", "mine"], MINE_HEAD + "trainer:\n  steps: 3\n   batch_size: 2\n", 7),
    ("experiment/port.yaml", ["experiment=port"], "# @package _global_\ntrainer:\n  steps: [3\n", 4),
])
def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_line(conf, capsys, where, argv, body, line):
    (conf / where).write_text(body)
    err = refused(capsys, "--config-dir", "myconf", *argv)
    assert err.startswith(f"myconf/{where}, line {line}: not valid YAML ("), err


def test_a_config_name_file_without_defaults_says_the_line_it_needs(conf, capsys):
    (conf / "mine.yaml").write_text("algo:\n  beta: 0.1\n")
    err = refused(capsys, "--config-dir", "myconf", "--config-name", "mine")
    assert err.startswith("myconf/mine.yaml does not start from rlnotes' settings: put `defaults: [config, _self_]` "
                          "on its first line"), err
    (conf / "mine.yaml").write_text("defaults: [config, _self_]\nalgo:\n  beta: -0.1\n")  # what it says is enough
    assert refused(capsys, "--config-dir", "myconf", "--config-name", "mine").startswith(
        "myconf/mine.yaml, line 3: algo.beta=-0.1")


@pytest.mark.parametrize("body", ["trainer:\n  steps: 3\n", "defaults: [config, _self_]\ntrainer:\n  steps: 3\n"])
def test_a_config_yaml_of_the_users_that_hides_rlnotes_own_says_to_rename_it(conf, capsys, body):
    (conf / "config.yaml").write_text(body)  # listing `config` would list itself
    err = refused(capsys, "--config-dir", "myconf")
    assert err.startswith("myconf/config.yaml hides rlnotes' own config.yaml (a --config-dir is searched first): "
                          "rename it"), err


def test_each_sweep_member_is_checked_with_its_files(conf, capsys, tmp_path):
    (conf / "experiment" / "good.yaml").write_text("# @package _global_\noptim:\n  lr: 0.01\n")
    (conf / "experiment" / "bad.yaml").write_text("# @package _global_\noptim:\n  lr: 0.0\n")
    err = refused(capsys, "-m", "--config-dir", "myconf", "experiment=good,bad", f"hydra.sweep.dir={tmp_path / 's'}")
    assert err.startswith("myconf/experiment/bad.yaml, line 3: optim.lr=0 must be in (0, 1]"), err
    assert not (tmp_path / "s").exists()


def test_cfg_job_prints_the_config_the_run_will_have(conf, capsys):
    (conf.parent / "d.jsonl").write_text('{"prompt": "q", "answer": "a"}\n')
    assert main(["train", "--cfg", "job", "data.path=d.jsonl", "reward=exact"]) == 0
    out = capsys.readouterr().out
    assert "data:\n  source: file\n  name: file\n  path: d.jsonl\n" in out and "hydra:" not in out
    assert main(["train", "--cfg", "job", "-p", "data.source", "data.path=d.jsonl", "reward=exact"]) == 0
    assert capsys.readouterr().out == "file\n"


def test_the_check_imports_neither_torch_nor_transformers(tmp_path):
    """A mistake costs the check alone (well under 2 s), not the seconds the training modules take to import."""
    (tmp_path / "mine.yaml").write_text(MINE_HEAD + "algo:\n  beta: -0.1\n")
    probe = ("import sys, time; from rlnotes.commands.cli import main; t = time.perf_counter(); "
             f"codes = [main(['train', 'trainer.stpes=3']), main(['train', '--config-dir', {str(tmp_path)!r}, "
             "'--config-name', 'mine'])]; "
             "print(codes, sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules), "
             "round(time.perf_counter() - t, 2))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("[2, 2] []"), (out.stdout, out.stderr)  # exit 2 each, none of them imported
    assert "did you mean trainer.steps?" in out.stderr and "mine.yaml, line 6: algo.beta=-0.1" in out.stderr


@pytest.mark.parametrize("argv, says", [
    (["hardware.device=cuda"], "hardware.device=cuda but torch sees no GPU"),
    (["data.path=bad.jsonl", "reward=letters"], "bad.jsonl line 2, column 15: not valid JSON"),
])
def test_the_users_input_found_wrong_during_the_run_exits_2_as_a_usage_error(tmp_path, monkeypatch, capsys, argv, says):
    """The hardware or data a config names, found wrong only when the run starts: the user's input, as a
    typo is (exit 1 is a run that failed otherwise: tests/test_multiturn.py, an environment that raised)."""
    import torch

    if argv[0] == "hardware.device=cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "letter": "a"}\n{"prompt": "b"\n')
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv, "trainer.steps=1", "logging.progress=false", f"hydra.run.dir={tmp_path / 'run'}"])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_rlnotes_eval_checks_a_config_name_file_too(conf, capsys):
    (conf / "mine.yaml").write_text(MINE_HEAD + "eval:\n  size: 0\n")
    assert main(["eval", "--config-dir", "myconf", "--config-name", "mine"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: myconf/mine.yaml, line 6: eval.size=0 must be at least 1"), err
    assert "\n" not in err


def test_a_value_set_again_after_the_users_file_is_not_blamed_on_it(tmp_path):
    """The last of the user's files to set a key is named only if the composed config holds its value:
    one of rlnotes' own configs, merged later, may have set the key again."""
    from omegaconf import OmegaConf

    from rlnotes.commands.hydra import UserFile
    from rlnotes.commands.userfiles import setter

    (tmp_path / "mine.yaml").write_text("defaults:\n  - grpo\n  - _self_\ngroup_size: 3\n")
    file = UserFile("algo/mine", tmp_path / "mine.yaml", "algo")
    assert setter([file], [], "algo.group_size") == (file, 4)
    assert setter([file], [], "algo.group_size", OmegaConf.create({"algo": {"group_size": 3}})) == (file, 4)
    assert setter([file], [], "algo.group_size", OmegaConf.create({"algo": {"group_size": 8}})) is None
    assert setter([file], ["algo.group_size=3"], "algo.group_size") is None  # the command line's
    assert setter([file], ["algo={group_size: 3}"], "algo.group_size") is None


def test_a_config_dir_that_does_not_exist_is_one_line_and_nothing_is_made(conf, capsys):
    """Hydra's own check came after the run dir was made (and exited 1): now one line, exit 2."""
    assert refused(capsys, "--config-dir", "nope") == "--config-dir: no such directory: nope"
    (conf.parent / "afile").write_text("")
    assert refused(capsys, "--config-dir", "afile") == "--config-dir: not a directory: afile"
    assert not (conf.parent / "outputs").exists()


def test_a_config_name_the_dir_lacks_lists_the_yaml_files_it_has(conf, capsys):
    (conf / "mine.yaml").write_text(MINE_HEAD)
    (conf / "other.yaml").write_text(MINE_HEAD)
    assert refused(capsys, "--config-dir", "myconf", "--config-name", "mien") == (
        "--config-name mien: no mien.yaml in --config-dir myconf; its YAML files: mine.yaml, other.yaml; did you mean "
        "--config-name mine?")
    assert refused(capsys, "--config-name", "mine") == (
        "--config-name mine: no such config; add --config-dir DIR, the dir that holds mine.yaml")


@pytest.mark.parametrize("where, argv, body, line", [
    ("mine.yaml", ["--config-name", "mine"], "defaults:\n  - config\n  - override algo: grpoo\n  - _self_\n", 3),
    ("mine.yaml", ["--config-name", "mine"], "defaults:\n  - config\n  - _self_\n  - algo: grpoo\n", 4),
    ("experiment/port.yaml", ["experiment=port"], "# @package _global_\ndefaults:\n  - override /algo: grpoo\n", 3),
])
def test_a_bad_preset_in_a_users_defaults_list_names_the_file_and_line(conf, capsys, where, argv, body, line):
    (conf / where).write_text(body)
    err = refused(capsys, "--config-dir", "myconf", *argv)
    assert err.startswith(f"myconf/{where}, line {line}: algo=grpoo is not an option; did you mean algo=grpo? choose one of: dapo, dpo,"), err
    assert refused(capsys, "--config-dir", "myconf", *argv, "algo=ppoo").startswith(
        "algo=ppoo is not an option")  # the command line's own choice is named as itself
