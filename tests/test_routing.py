"""Several environments in one run (rlnotes/agents/routing.py): rollout.env as a mapping of names to
environments, as TRL's environment_factory takes a dict; each row's `environment` column picks its
own, its episodes see that environment's tools alone, and each environment's reward and counters
are logged apart (env/NAME/...)."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from rlnotes.agents.builtin import LettersEnv
from rlnotes.agents.multi_turn import Conversations, MultiTurn
from rlnotes.agents.routing import EPISODE_COLUMNS, environment_names, per_environment
from rlnotes.commands.train import train
from rlnotes.commands.usage import UsageError
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import RewardConfig, RolloutConfig, TinyModelConfig
from rlnotes.data.datasets import load_checked
from rlnotes.engine.model.loading import tiny_model
from rlnotes.engine.prompts import PromptFormat
from rlnotes.engine.sampling.settings import SamplingSettings
from rlnotes.rewards.builtin import letter_share
from rlnotes.rewards.scoring import RewardFailure, Rewards
from tests.conftest import compose
from tests.test_multiturn import CHATML, play, roomy_tiny_model, templated_tokenizer
from tests.trl_environments import IncrementEnv, MyEchoEnv

ENVS = "{counter: tests.trl_environments:IncrementEnv, echo: tests.trl_environments:MyEchoEnv}"
COUNTER = {"prompt": [{"role": "user", "content": "Increment the counter to 3."}], "target": 3,
           "environment": "counter"}
ECHO = {"prompt": [{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}],
        "environment": "echo"}


def multi_turn(**kw) -> MultiTurn:
    return MultiTurn.of(OmegaConf.merge(OmegaConf.structured(RolloutConfig), kw))


def routed(**kw) -> MultiTurn:
    return multi_turn(env={"counter": "tests.trl_environments:IncrementEnv",
                           "echo": "tests.trl_environments:MyEchoEnv"}, max_turns=3, **kw)


def routed_config(path, *overrides):
    return compose("rollout=multi_turn", f"rollout.env={ENVS}", "reward=env", "data=file", f"data.path={path}",
                   *overrides)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------------------------- the setting


def test_the_command_line_and_yaml_give_rollout_env_as_a_mapping(tmp_path):
    cfg = compose("rollout=multi_turn", "rollout.env={math: my_envs:MathEnv, words: path/to/env.py:WordEnv}")
    assert OmegaConf.to_container(cfg.rollout.env) == {"math": "my_envs:MathEnv", "words": "path/to/env.py:WordEnv"}
    assert environment_names(cfg.rollout.env) == ["math", "words"]
    assert compose("rollout=multi_turn", "rollout.env=letters").rollout.env == "letters"   # one, as before
    assert environment_names("letters") == [] and environment_names(None) == []
    from rlnotes.commands.check import check

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mixed.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /rollout: multi_turn\nrollout:\n  env:\n"
        "    counter: tests.trl_environments:IncrementEnv\n    letters: letters\n")
    cfg, = check(["experiment=mixed"], multirun=False, config_dir=str(tmp_path))
    assert OmegaConf.to_container(cfg.rollout.env) == {"counter": "tests.trl_environments:IncrementEnv",
                                                       "letters": "letters"}


@pytest.mark.parametrize("value, message", [
    ("3", "rollout.env=3 is not valid; give null, an environment (letters, pkg.module:Class, path/to/env.py:Class) "
          "or a mapping of names to environments ({math: my_envs:MathEnv, words: letters})"),
    ("[letters,letters]", "rollout.env=['letters', 'letters'] is not valid; give null, an environment"),
    ("{}", "rollout.env={} names no environment"),
    ("{a: 3}", "rollout.env.a=3 is not an environment; give a built-in name (letters), pkg.module:Class or "
               "path/to/env.py:Class"),
    ("{a: {b: letters}}", "rollout.env.a={'b': 'letters'} is not an environment"),
    ("{a/b: letters}", "rollout.env: 'a/b' cannot name an environment (a row's `environment` value and the "
                       "metrics' env/NAME/...): use letters, digits, _ and -"),
    ("{a.b: letters}", "rollout.env: 'a.b' cannot name an environment"),
    ("{1: letters}", "rollout.env: the name 1 is not a word; name each environment with letters, digits, _ and -"),
])
def test_a_wrong_rollout_env_is_one_line_before_anything_loads(value, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]").replace("{", r"\{").replace("}", r"\}")):
        compose("rollout=multi_turn", f"rollout.env={value}")


def test_a_wrong_rollout_env_on_the_command_line_exits_2_with_one_line(capsys):
    from rlnotes.commands.cli import main

    code = main(["train", "rollout=multi_turn", "rollout.env={a: [letters]}"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [
        "rlnotes: error: rollout.env.a=['letters'] is not an environment; give a built-in name (letters), "
        "pkg.module:Class or path/to/env.py:Class"]


def test_each_environment_of_the_mapping_loads_and_its_errors_name_its_key():
    mt = routed()
    assert mt.names == ["counter", "echo"] and mt.envs["counter"] is IncrementEnv and mt.envs["echo"] is MyEchoEnv
    with pytest.raises(ConfigError, match=r"^rollout.env.words: environment 'no.such:Env' could not be imported"):
        multi_turn(env={"letters": "letters", "words": "no.such:Env"}, max_turns=2)
    one = multi_turn(env="letters", max_turns=2)   # one environment: no names to choose among
    assert one.names == [] and one.envs == {None: LettersEnv} and one.environment_of({"environment": "x"}, "") is None


# --------------------------------------------------------------------------------------------- the rows


@pytest.mark.parametrize("bad, message", [
    ({"environment": None}, "rows.jsonl row 3, column 'environment': no environment named; rollout.env maps names "
                            "to environments and each row picks its own in an `environment` column: one of counter, "
                            "echo"),
    ({"environment": "Echo"}, "rows.jsonl row 3, column 'environment': 'Echo' is not an environment of rollout.env; "
                              "choose one of: counter, echo"),
    ({"environment": 1}, "rows.jsonl row 3, column 'environment': 1 is not an environment of rollout.env; choose one "
                         "of: counter, echo"),
])
def test_a_row_without_a_known_environment_is_one_line_naming_the_row_and_the_names(tmp_path, bad, message):
    rows = [COUNTER, ECHO, {**COUNTER, **bad}, ECHO]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    cfg = routed_config(path)
    with pytest.raises(ConfigError) as e:
        load_checked(cfg.data, None, environments=["counter", "echo"])
    assert str(e.value).endswith(message) and "\n" not in str(e.value)
    load_checked(cfg.data, None)   # with one environment (or none) the column is not read


def test_a_file_without_the_column_says_so_and_how_to_name_another(tmp_path):
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": "a", "task": "echo"}] * 2)
    cfg = routed_config(path)
    with pytest.raises(ConfigError, match=r"rows.jsonl has no column 'environment': rollout.env maps names to "
                                          r"environments, and each row picks its own there \(one of: counter, echo\); "
                                          r"or name another column with data.columns.environment=COLUMN"):
        load_checked(cfg.data, None, environments=["counter", "echo"])
    renamed = routed_config(path, "data.columns.environment=task")
    assert load_checked(renamed.data, None, environments=["counter", "echo"]).train.rows[0]["environment"] == "echo"


def test_every_row_is_checked_when_the_data_loads_before_the_model(tmp_path, monkeypatch):
    """The 40th row names no environment: the run stops before the model loads, not when a batch draws it."""
    from rlnotes.engine.policy.policy import Policy

    monkeypatch.setattr(Policy, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    rows = [COUNTER, ECHO] * 19 + [COUNTER, {**ECHO, "environment": "game"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    cfg = compose("rollout=multi_turn", f"rollout.env={ENVS}", "reward=env", "data=file", f"data.path={path}")
    with pytest.raises(ConfigError, match=r"rows.jsonl row 40, column 'environment': 'game' is not an environment"):
        train(cfg, tmp_path / "run", Console(quiet=True))
    eval_path = write_rows(tmp_path / "held_out.jsonl", [ECHO, {**COUNTER, "environment": None}])
    cfg = compose("rollout=multi_turn", f"rollout.env={ENVS}", "reward=env", "data=file",
                  f"data.path={write_rows(tmp_path / 'good.jsonl', rows[:-1])}", f"data.eval_path={eval_path}")
    with pytest.raises(ConfigError, match=r"held_out.jsonl row 2, column 'environment': no environment named"):
        train(cfg, tmp_path / "run2", Console(quiet=True))


# --------------------------------------------------------------------------------------------- the episodes


class Kwargs:
    """Records what reset was given."""
    seen = []

    def reset(self, **row):
        Kwargs.seen.append(row)

    def step(self, action):
        return None, 1.0, True


def test_each_row_runs_in_its_own_environment_and_reset_gets_no_environment_column():
    tok = templated_tokenizer()
    mt = multi_turn(env={"counter": "tests.trl_environments:IncrementEnv", "kw": "tests.test_routing:Kwargs"},
                    max_turns=2)
    seen = mt.envs["kw"].seen   # the class as the loader imported it
    seen.clear()
    conv = Conversations(mt, tok, [COUNTER, {"prompt": "Go.", "x": 1, "environment": "kw"}], 2)
    assert conv.env_names == ["counter", "counter", "kw", "kw"]
    assert [type(e).__name__ for e in conv.environments()] == ["IncrementEnv", "IncrementEnv", "Kwargs", "Kwargs"]
    assert seen == [{"prompt": "Go.", "x": 1}] * 2
    assert conv.environments()[0].target == 3


def test_only_the_rows_environment_describes_its_tools_and_only_they_run():
    tok = templated_tokenizer()
    conv = Conversations(routed(), tok, [COUNTER, ECHO], 1)
    counter_system, echo_system = conv.messages[0][0]["content"], conv.messages[1][0]["content"]
    assert '"increment"' in counter_system and '"name": "step"' not in counter_system
    assert '"name": "step"' in echo_system and '"increment"' not in echo_system
    call = '<tool_call>\n{"name": "%s", "arguments": {%s}}\n</tool_call>'
    play(conv, tok, [call % ("step", '"message": "hi"'), "Done."])    # the echo's tool, in a counter episode
    assert json.loads(conv.messages[0][3]["content"]) == {"error": "unknown tool 'step'; the tools are: increment"}
    assert conv.episodes[0].tool_failures == 1
    other = Conversations(routed(), tok, [ECHO], 1)
    play(other, tok, [call % ("step", '"message": "hi"'), "Done."])
    assert other.messages[0][3] == {"role": "tool", "name": "step", "content": "hi"}


def test_where_the_template_renders_tools_each_episode_gets_its_own():
    tok = templated_tokenizer()
    tok.chat_template = "{% if tools %}{{ '<bos>system\n' + (tools | tojson) + '<eos>\n' }}{% endif %}" + CHATML
    mt = multi_turn(env={"counter": "tests.trl_environments:IncrementEnv", "letters": "letters"}, max_turns=2)
    conv = Conversations(mt, tok, [{**COUNTER, "prompt": "Count."}, {"prompt": "Write a:", "letter": "a",
                                                                     "environment": "letters"}], 2)
    assert [r.template_tools and [s["function"]["name"] for s in r.schemas] for r in conv.renderers] == \
        [["increment"]] * 2 + [False] * 2
    prompts = conv.prompts()
    assert prompts[0][0]["role"] == "tools" and '"increment"' in prompts[0][0]["content"]
    assert prompts[2] == [{"role": "user", "content": "Write a:"}]
    ids, shared = conv.prompt_ids()   # a group is one row, so one environment: its G episodes share their prompt
    assert shared == 2 and len(ids) == 2 and ids[0] != ids[1]
    assert "increment" in tok.decode(ids[0]) and "increment" not in tok.decode(ids[1])


class Scores:
    """A step-style environment whose one step scores the episode as its row says (NaN)."""

    def reset(self, score: float = 1.0, **row):
        self.score = score

    def step(self, action):
        return None, self.score, True


def test_each_environments_reward_scores_its_own_episodes_and_a_broken_one_is_named():
    tok = templated_tokenizer()
    mt = multi_turn(env={"letters": "letters", "counter": "tests.trl_environments:IncrementEnv"}, max_turns=2)
    rows = [{"prompt": "Write b:", "letter": "b", "environment": "letters"}, {**COUNTER, "target": 0}]
    conv = Conversations(mt, tok, rows, 1)
    for i, replies in ((0, ["x", "bb"]), (1, ["Nothing to do."])):
        turns = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in replies]
        for k, turn in enumerate(turns):
            conv.respond([i], [turn], [k == len(turns) - 1])
    # letters: the second reply's share of b's; the counter's target 0 is reached without a call
    assert conv.env_rewards().tolist() == [letter_share(None, ["bb"], ["b"])[0], 1.0]
    # an environment that gives no finite reward stops the run by its name, whatever the others give
    plain, model = PromptFormat(chat_template=False), tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok))
    mt = multi_turn(env={"letters": "letters", "scores": "tests.test_routing:Scores"}, max_turns=2)
    rows = [{"prompt": "a", "letter": "a", "score": None, "environment": "letters"},   # every column, as read
            {"prompt": "b", "letter": None, "score": float("nan"), "environment": "scores"}]
    conv, rollout = mt.run_episodes(model.eval(), tok, rows, 2, SamplingSettings(4), plain,
                                    torch.Generator().manual_seed(0))
    rewards = Rewards(OmegaConf.structured(RewardConfig(name="env")))
    with pytest.raises(RewardFailure, match=r"^environment scores \(Scores\) gave no finite reward for any sample"):
        conv.score(rewards, rows, rollout)


# --------------------------------------------------------------------------------------------- the metrics


def test_per_environment_means_by_hand():
    # env index, reward, env reward, turns, model tokens, env tokens, tool calls, failed calls
    table = torch.tensor([[0, 1.0, 1.0, 2, 10, 4, 2, 1],
                          [1, 0.5, 0.0, 1, 6, 0, 0, 0],
                          [0, 0.0, 0.0, 1, 4, 2, 1, 0],
                          [1, 1.5, 1.0, 3, 8, 6, 0, 0]], dtype=torch.float64)
    got = per_environment(["a", "b", "c"], table)   # c has no episode here: none of its keys
    assert got == pytest.approx({
        "env/a/episodes": 2, "env/a/reward_mean": 0.5, "env/a/reward_env": 0.5, "env/a/turns": 1.5,
        "env/a/model_tokens": 7, "env/a/env_tokens": 3, "env/a/tool_calls": 1.5, "env/a/tool_failure_frac": 1 / 3,
        "env/b/episodes": 2, "env/b/reward_mean": 1.0, "env/b/reward_env": 0.5, "env/b/turns": 2,
        "env/b/model_tokens": 7, "env/b/env_tokens": 3, "env/b/tool_calls": 0, "env/b/tool_failure_frac": 0})
    assert len(EPISODE_COLUMNS) == table.shape[1] - 1


def test_a_mixed_run_trains_each_row_in_its_environment_with_its_tools_and_logs_each(tmp_path):
    """Two TRL environments (the counter and the echo, each with its own tool) in one GRPO run on the
    tiny model: every sample's prompt describes its environment's tool alone, and env/NAME/reward_mean
    agrees with the rewards of that environment's samples in samples.jsonl."""
    rows = [{**COUNTER, "prompt": [{"role": "user", "content": f"Increment the counter to {i}."}], "target": i}
            for i in range(1, 7)] + [ECHO] * 6
    path = write_rows(tmp_path / "rows.jsonl", rows)
    cfg = compose("rollout=multi_turn", f"rollout.env={ENVS}", "reward=env", "data=file", f"data.path={path}",
                  "rollout.max_turns=2", "rollout.max_new_tokens=6", "trainer.steps=3", "trainer.batch_size=4",
                  f"model.name_or_path={roomy_tiny_model(tmp_path / 'model')}", "logging.samples_every=1",
                  "logging.samples_shown=16", "logging.progress=false", "trainer.eval_every=3", "eval.size=4")
    train(cfg, tmp_path / "run", Console(quiet=True))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    metrics = [row for row in metrics if "loss" in row]   # the steps' rows (an evaluation's come apart)
    assert len(metrics) == 3 and len(samples) == 3 * 16
    seen = set()
    for row in metrics:
        step = [s for s in samples if s["step"] == row["step"]]
        names = {s["environment"] for s in step}
        seen |= names
        assert sum(row[f"env/{n}/episodes"] for n in names) == 16
        for name in names:
            mine = [s["reward"] for s in step if s["environment"] == name]
            assert row[f"env/{name}/episodes"] == len(mine)
            assert row[f"env/{name}/reward_mean"] == pytest.approx(sum(mine) / len(mine), abs=1e-6)
        assert row["reward/mean"] == pytest.approx(sum(s["reward"] for s in step) / 16, abs=1e-6)
    assert seen == {"counter", "echo"}
    for s in samples:
        system, user = s["prompt"][0]["content"], s["prompt"][-1]["content"]
        if s["environment"] == "counter":
            assert user.startswith("Increment") and '"increment"' in system and '"name": "step"' not in system
        else:
            assert user.startswith("Try to echo") and '"name": "step"' in system and '"increment"' not in system
    evaluation = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert {k for k in evaluation if k.startswith("eval/env/")} <= {f"eval/env/{n}/{m}" for n in ("counter", "echo")
                                                                    for m in ("reward", "accuracy")}
    assert any(k.startswith("eval/env/") for k in evaluation)


class Again(LettersEnv):
    """The built-in letters environment with its own second prompt ("Again, the letter a:") and twice
    its reward: a reward that reached another environment's episodes would show in the metrics."""

    def step(self, action: str):
        observation, reward, done = super().step(action)
        return (f"Again, the letter {self.letter}:" if observation else None), 2 * reward, done


@pytest.mark.long
def test_grpo_learns_two_environments_in_one_run(tmp_path):
    """letters and Again (its twin with another second prompt and twice the reward) share the rows
    of one run: each learns to end its first turn and then write the letter, and each one's reward
    is its own (Again's mean passes 1, which letters' never can). Seeds 0-7 all did, in 60 steps:
    letters 0.79-0.87, Again 1.64-1.75 over the last 5 (about 10-20 s on a shared 2-core AMD EPYC)."""
    rows = [{"prompt": f"Write the letter a{end}", "letter": "a", "environment": name}
            for name in ("letters", "again") for end in (":", "!", ".", " please:")]
    path = write_rows(tmp_path / "rows.jsonl", rows * 4)
    cfg = compose("rollout=multi_turn", "rollout.env={letters: letters, again: tests.test_routing:Again}",
                  "reward=env", "data=file", f"data.path={path}", "rollout.max_turns=2", "rollout.max_new_tokens=6",
                  "rollout.max_episode_tokens=64", "algo.group_size=8", "optim.lr=5e-3", "trainer.steps=60", "seed=0",
                  "logging.progress=false", "logging.samples_shown=64")
    train(cfg, tmp_path / "run", Console(quiet=True))
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = metrics[:5], metrics[-5:]

    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values)

    assert mean(first, "env/letters/reward_mean") < 0.05 and mean(first, "env/again/reward_mean") < 0.1, metrics
    assert 0.5 < mean(last, "env/letters/reward_mean") <= 1.0 and mean(last, "env/again/reward_mean") > 1.2, metrics
    assert mean(last, "env/letters/turns") > 1.8 and mean(last, "env/again/turns") > 1.8
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    said = {"letters": "[user] Now write the letter a:", "again": "[user] Again, the letter a:"}
    for s in samples:   # each episode heard its own environment's second prompt, never the other's
        assert said[{"letters": "again", "again": "letters"}[s["environment"]]] not in s["completion"]
    assert all(any(said[name] in s["completion"] for s in samples if s["environment"] == name) for name in said)


def test_a_mixed_run_stopped_by_ctrl_c_resumes_exactly(tmp_path, monkeypatch):
    """The rows' environments, their episodes and env/NAME/... after a resume are those of the run
    that never stopped (tests/test_checkpoint.py's Ctrl-C in the 3rd step)."""
    import signal

    from tests.test_checkpoint import stopped_then_resumed

    rows = [{"prompt": f"Write the letter {c}:", "letter": c, "environment": name}
            for name in ("letters", "again") for c in "ab"]
    path = write_rows(tmp_path / "rows.jsonl", rows * 8)
    overrides = ("rollout=multi_turn", "rollout.env={letters: letters, again: tests.test_routing:Again}",
                 "reward=env", "data=file", f"data.path={path}", "rollout.max_turns=2", "rollout.max_new_tokens=6",
                 "trainer.steps=5", "trainer.eval_every=2", "eval.size=4")
    whole, resumed = stopped_then_resumed(tmp_path, monkeypatch, "grpo", 3, signal.SIGINT, *overrides)
    assert resumed == whole
    assert all("env/letters/reward_mean" in r or "env/again/reward_mean" in r for r in whole if "loss" in r)
