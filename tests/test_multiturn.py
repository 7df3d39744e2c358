"""Multi-turn episodes through the whole tool: the tokens trained on agree with the chat template's
rendering of the conversation, reward functions see whole episodes and their environments as TRL
passes them, every on-policy algorithm trains on episodes, and the toy environment is learned."""

import json
import math
import re

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from rlnotes.agents.environments import EnvironmentFailure
from rlnotes.agents.multi_turn import Conversations, MultiTurn
from rlnotes.commands.cli import main
from rlnotes.commands.train import train
from rlnotes.commands.usage import UsageError
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import ModelConfig, RewardConfig, RolloutConfig, TinyModelConfig
from rlnotes.engine.model.loading import load_base, tiny_model, tiny_tokenizer
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.prompts import PromptFormat
from rlnotes.engine.sampling.settings import SamplingSettings
from rlnotes.notes.grpo import grpo_loss
from rlnotes.rewards.scoring import RewardFailure, Rewards
from tests.conftest import compose
from tests.test_rewards import FakeConsole

# SmolLM2's chat template, with the tiny tokenizer's <bos>/<eos> as its <|im_start|>/<|im_end|>.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<bos>system\nYou are a helpful assistant<eos>\n' }}{% endif %}"
          "{{'<bos>' + message['role'] + '\n' + message['content'] + '<eos>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<bos>assistant\n' }}{% endif %}")
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


def multi_turn(**kw):
    return MultiTurn.of(OmegaConf.merge(OmegaConf.structured(RolloutConfig), kw))


def templated_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHATML
    return tok


def play(conversations, tok, replies):
    """Episode 0 with scripted model turns (each tokenized as the tokenizer would, then EOS): the
    token sequence the engine would train on, [prompt | turn | observation | turn ...]."""
    prompts, _ = conversations.prompt_ids()
    ids = list(prompts[0])
    for k, reply in enumerate(replies):
        turn = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids += turn
        obs = conversations.respond([0], [turn], [k == len(replies) - 1])[0]
        if obs is None:
            break
        ids += obs
    return ids


def test_episode_tokens_equal_the_chat_templates_rendering_of_the_conversation():
    tok = templated_tokenizer()
    conv = Conversations(multi_turn(tools=["calculator"], max_turns=3), tok, [{"prompt": "What is 123*45?"}], 1)
    ids = play(conv, tok, [CALL % "123*45", "It is 5535."])
    messages = conv.messages[0]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3] == {"role": "tool", "name": "calculator", "content": "5535"}
    assert "<tools>" in messages[0]["content"] and '"calculator"' in messages[0]["content"]  # no tools in the template
    rendered = tok.apply_chat_template(messages, tokenize=False)
    whole = tok(rendered[:rendered.rindex("<eos>") + len("<eos>")], add_special_tokens=False)["input_ids"]
    assert ids == whole
    assert conv.completions()[0][-1] == {"role": "assistant", "content": "It is 5535."}


@pytest.mark.slow
def test_smollm2s_template_and_tokenizer_agree_with_the_episode_tokens():
    """The same agreement with SmolLM2-135M-Instruct's own tokenizer and chat template (which does
    not render tools, so their schemas make the system message, in place of its default one)."""
    from transformers import AutoTokenizer

    from rlnotes.engine.model.loading import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    conv = Conversations(multi_turn(tools=["calculator"], max_turns=3), tok, [{"prompt": "What is 123*45?"}], 1)
    ids = play(conv, tok, [CALL % "123*45", "123*45 = 5535"])
    rendered = tok.apply_chat_template(conv.messages[0], tokenize=False)
    end = rendered.rindex(tok.eos_token) + len(tok.eos_token)
    assert ids == tok(rendered[:end], add_special_tokens=False)["input_ids"]
    assert [m["role"] for m in conv.messages[0]] == ["system", "user", "assistant", "tool", "assistant"]


def test_without_a_chat_template_observations_are_role_lines_after_the_models_eos():
    tok = tiny_tokenizer()
    conv = Conversations(multi_turn(env="letters", max_turns=2), tok,
                         [{"prompt": "Write the letter a:", "letter": "a"}], 1, PromptFormat(chat_template=False))
    ids = play(conv, tok, ["xy", "aa"])
    text = tok.decode(ids)
    assert text == "user: Write the letter a:\nassistant:xy<eos>\nuser: Now write the letter a:\nassistant:aa<eos>"
    assert conv.env_rewards().tolist() == [1.0]


SEEN = {}


def judge(prompts, completions, environments, **kwargs):
    """A reward function as a TRL user writes one for a multi-turn run."""
    SEEN.update(completions=completions, environments=environments)
    return [float(len(c)) for c in completions]


def test_reward_functions_get_whole_episodes_and_the_environments():
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    rows = [{"prompt": [{"role": "user", "content": "Write the letter b:"}], "letter": "b"}]
    conv, rollout = multi_turn(env="letters", max_turns=2).run_episodes(
        model, tok, rows, 2, SamplingSettings(4), PromptFormat(chat_template=False), torch.Generator().manual_seed(0))
    rewards = Rewards(OmegaConf.structured(RewardConfig(name="custom", target="tests.test_multiturn:judge")))
    totals, metrics = conv.score(rewards, rows, rollout)
    SEEN = rewards.fns[0].fn.__globals__["SEEN"]  # the module as the reward loader imported it
    assert SEEN["environments"] == conv.environments() and all(e is not None for e in SEEN["environments"])
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in SEEN["completions"])
    env = conv.env_rewards()
    assert totals.tolist() == pytest.approx([len(c) + e for c, e in zip(SEEN["completions"], env.tolist())])
    assert metrics["reward/env"] == pytest.approx(float(env.mean()))
    assert metrics["episode/turns"] == pytest.approx(sum(len(c) > 0 and sum(m["role"] == "assistant" for m in c)
                                                         for c in SEEN["completions"]) / 2)


class Scores:
    """A step-style environment whose one step scores the episode as its row says (NaN, inf)."""

    def reset(self, score: float = 1.0, **row):
        self.score = score

    def step(self, action):
        return None, self.score, True


def test_a_nan_or_inf_environment_reward_gets_the_fallback_or_stops_the_run_in_one_line(monkeypatch):
    """It used to reach the loss, and the run stopped blaming the learning rate."""
    from rlnotes.agents import builtin

    monkeypatch.setitem(builtin.ENVIRONMENTS, "scores", Scores)
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    rows = [{"prompt": "a", "score": 2.0}, {"prompt": "b", "score": float("nan")}, {"prompt": "c", "score": -math.inf}]
    plain = PromptFormat(chat_template=False)
    conv, rollout = multi_turn(env="scores").run_episodes(model, tok, rows, 2, SamplingSettings(4), plain,
                                                          torch.Generator().manual_seed(0))
    console = FakeConsole()
    rewards = Rewards(OmegaConf.structured(RewardConfig(name="env", fallback=-1.0)), console)
    totals, metrics = conv.score(rewards, rows, rollout)
    assert totals.tolist() == [2.0, 2.0, -1.0, -1.0, -1.0, -1.0]
    assert metrics["reward/failures"] == 4 and metrics["reward/env"] == pytest.approx(0.0)
    assert console.printed == ["[yellow]environment Scores gave the reward nan for 4 of 6 samples; they get -1.0[/]"]
    conv, rollout = multi_turn(env="scores").run_episodes(model, tok, rows[1:2], 2, SamplingSettings(4), plain)
    with pytest.raises(RewardFailure) as err:
        conv.score(rewards, rows[1:2], rollout)
    assert str(err.value) == ("environment Scores gave no finite reward for any sample of the batch (nan); fix its "
                              "reward")


class LongStart:
    """reset adds a text longer than the model's context to the prompt."""

    def reset(self, **row):
        return " and" * 600

    def step(self, action):
        return None, 0.0, True


def test_a_reset_text_past_the_models_context_is_one_line_before_any_pass(monkeypatch):
    """It went to the prefill (a real model's attention over a long enough text asked for 4 TB)."""
    from rlnotes.agents import builtin

    monkeypatch.setitem(builtin.ENVIRONMENTS, "long_start", LongStart)
    tok = tiny_tokenizer()
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    monkeypatch.setattr(model, "forward", None)   # no pass may run
    with pytest.raises(EnvironmentFailure) as err:
        multi_turn(env="long_start").run_episodes(model, tok, [{"prompt": "Hi"}], 2, SamplingSettings(16),
                                                  PromptFormat(chat_template=False))
    assert re.fullmatch(r"environment LongStart.reset made episode 0's prompt \d+ tokens; with "
                        r"rollout.max_new_tokens=16 it exceeds the model's 2048 positions; make what reset returns "
                        r"shorter", str(err.value))


def test_env_timeout_reaches_every_episode():
    episode = multi_turn(env="letters", env_timeout=2.5).episode()
    assert episode.env_timeout == 2.5
    with pytest.raises(UsageError, match=r"rollout.env_timeout=0 must be greater than 0 \(seconds a call of the "
                                         r"environment"):
        compose("rollout=multi_turn", "rollout.env=letters", "rollout.env_timeout=0")


def test_the_loss_has_no_gradient_through_the_environments_tokens():
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok))
    with torch.no_grad():  # turns that end (EOS's logit scaled up): every seed 0-9 gives episodes with an observation
        model.lm_head.weight[tok.eos_token_id] = 20 * model.lm_head.weight[75]
    rows = [{"prompt": "Write the letter a:", "letter": "a"}] * 2
    _, r = multi_turn(env="letters", max_turns=2).run_episodes(
        model, tok, rows, 4, SamplingSettings(6), PromptFormat(chat_template=False), torch.Generator().manual_seed(1))
    observed = r.completion_attn.bool() & ~r.completion_mask.bool()
    assert observed.any()
    embedded = []  # the pass's input embeddings, as a leaf whose gradient the backward pass fills

    def leaf(module, args, out):
        embedded.append(out.detach().requires_grad_(True))
        return embedded[-1]
    hook = model.get_input_embeddings().register_forward_hook(leaf)
    try:
        logp = sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1], share_prompts=False)
    finally:
        hook.remove()
    loss = grpo_loss(logp, r.logprobs, None, torch.linspace(-1, 1, len(r)), r.completion_mask, beta=0.0).loss
    grad_logp, = torch.autograd.grad(loss, logp, retain_graph=True)
    assert (grad_logp[observed] == 0).all() and (grad_logp[r.completion_mask.bool()] != 0).any()
    # an observation token's own log-prob (predicting it) gets no gradient, but later turns read it
    loss.backward()
    grad = embedded[0].grad
    if grad.dim() == 2 and len(grad) == r.input_ids.numel():  # rlnotes' own pass, every position (llama.Slots)
        grad = grad.view(*r.input_ids.shape, -1)
    elif grad.dim() == 2:  # rlnotes' own pass, the real positions gathered row by row
        grad = grad.new_zeros(*r.input_ids.shape, grad.shape[-1]).index_put_((r.attention_mask.bool(),), grad)
    width = r.prompt_ids.shape[1]
    assert grad[:, width:][observed].abs().sum() > 0


def run(tmp_path, *overrides):
    cfg = compose("logging.progress=false", *overrides)
    train(cfg, tmp_path, Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


TOY = ("rollout=multi_turn", "rollout.env=letters", "rollout.max_turns=2", "rollout.max_new_tokens=6",
       "rollout.max_episode_tokens=64", "reward=env", "optim.lr=3e-3")


@pytest.mark.long
def test_grpo_learns_the_toy_environment_over_whole_episodes(tmp_path):
    rows = run(tmp_path, "experiment=letters_env", "trainer.eval_every=60", "eval.size=16")
    train_rows = [r for r in rows if "reward/mean" in r]
    first, last = train_rows[:5], train_rows[-5:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(first, "reward/mean") < 0.05 and mean(last, "reward/mean") > 0.4, rows
    # it learned to end its first turn: the environment's prompt and a second turn follow
    assert mean(first, "episode/turns") < 1.3 and mean(last, "episode/turns") > 1.8
    assert mean(last, "episode/env_tokens") > 5
    assert train_rows[-1]["completion/len_mean"] == pytest.approx(train_rows[-1]["episode/model_tokens"])
    evaluation = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert evaluation[-1]["eval/reward"] > evaluation[0]["eval/reward"] + 0.3
    samples = (tmp_path / "eval" / "step_000060.jsonl").read_text()
    assert "[user] Now write the letter a:" in samples


@pytest.mark.parametrize("algo", ["rloo", "reinforce", "ppo", "dr_grpo"])
def test_every_on_policy_algorithm_trains_on_episodes(tmp_path, algo):
    rows = run(tmp_path, f"algo={algo}", *TOY, "trainer.steps=4", "trainer.micro_batch_size=4")
    assert rows and all(r["episode/turns"] >= 1 and "episode/env_tokens" in r for r in rows)   # PPO: 4 updates a batch
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN


def trl_rows(env: str) -> list:
    """Rows as TRL's examples give them: the echo example's one prompt, the counter's prompt and target."""
    if env == "MyEchoEnv":
        return [{"prompt": [{"role": "user", "content": "Try to echo 'Hello World!' in the environment."}]}] * 16
    return [{"prompt": [{"role": "user", "content": f"Increment the counter to {i}."}], "target": i}
            for i in list(range(1, 7)) * 3]


@pytest.mark.parametrize("env", ["MyEchoEnv", "IncrementEnv"])
def test_trls_environment_examples_train_on_the_tiny_model(tmp_path, env):
    """TRL's echo example stopped after the model loaded: 'environment MyEchoEnv.step returned str,
    not (observation, reward, done)' (its tool is named step). On the built-in tiny model as it is:
    the tools' descriptions (~900 of its one-character tokens) fit its positions."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in trl_rows(env)))
    rows = run(tmp_path / "run", "rollout=multi_turn", f"rollout.env=tests.trl_environments:{env}", "reward=env",
               "data=file", f"data.path={data}", "rollout.max_turns=2", "rollout.max_new_tokens=6", "trainer.steps=2")
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)


def roomy_tiny_model(path):
    """The tiny model saved as a model dir with room for 2048 positions (the built-in one's default)."""
    model, tokenizer = load_base(OmegaConf.structured(ModelConfig()))
    model.config.max_position_embeddings = 2048
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("env", ["tests.test_multiturn:ResetOnly", "tests.trl_environments:CounterResetEnv"])
def test_reward_env_with_an_environment_that_gives_no_reward_is_refused_before_the_model_loads(tmp_path, monkeypatch,
                                                                                             capsys, env):
    """reward=env scores episodes by the environment alone; one with neither get_reward() nor a
    step-style step (a TRL-style class whose reward would be an attribute) trained at reward 0 on
    every step without a word. The same class is fine with reward functions that read it."""
    from rlnotes.engine.policy.policy import Policy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Policy, "from_config", classmethod(lambda *a: pytest.fail("the model loaded")))
    with pytest.raises(SystemExit) as stopped:
        main(["train", "rollout=multi_turn", f"rollout.env={env}", "reward=env", "trainer.steps=1",
              "logging.progress=false"])
    assert stopped.value.code == 2 and not list(tmp_path.glob("outputs/*/*"))  # an input error; no run dir left
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"rlnotes: error: reward=env: rollout.env '{env}' (") and "define get_reward(self)" in err


def test_a_step_that_cannot_take_the_models_turn_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """step(self) with no parameter for the action stopped the run at the first step, after the model loaded."""
    from rlnotes.engine.policy.policy import Policy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Policy, "from_config", classmethod(lambda *a: pytest.fail("the model loaded")))
    with pytest.raises(SystemExit) as stopped:
        main(["train", "rollout=multi_turn", "rollout.env=tests.test_multiturn:NoActionStep", "reward=env",
              "trainer.steps=1", "logging.progress=false"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rlnotes: error: rollout.env: environment 'tests.test_multiturn:NoActionStep' (NoActionStep) has step(), and "
        "a step-style environment's step takes the model's turn: define step(self, action) returning (observation, "
        "reward, done)")


class NoActionStep:
    def reset(self, **row):
        return None

    def step(self):
        return "", 1.0, True


class ResetOnly:
    """An environment of reset alone: no tools, no step, no get_reward."""

    def reset(self, **row):
        return None


def test_the_samples_of_a_multi_turn_run_show_what_reset_added_and_the_tools_block(tmp_path):
    """The samples table, samples.jsonl and the eval files showed the row's prompt alone: neither the
    text the environment's reset appended to it nor the tools the model was told of."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Increment the counter by {i}. "}]})
                            + "\n" for i in range(1, 9)) * 2)
    run(tmp_path / "run", "rollout=multi_turn", "rollout.env=tests.trl_environments:CounterResetEnv", "reward=custom",
        "reward.target=tests.trl_environments:counter_reward", "data=file", f"data.path={data}", "rollout.max_turns=2", "rollout.max_new_tokens=6", "trainer.steps=1",
        f"model.name_or_path={roomy_tiny_model(tmp_path / 'model')}", "logging.samples_every=1",
        "trainer.eval_every=1", "eval.size=2", "model.system_prompt=null")
    shown = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    evaluated = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step_000001.jsonl").read_text().splitlines()]
    for sample in shown + evaluated:
        system, user = sample["prompt"]
        assert system["role"] == "system" and "<tools>" in system["content"] and '"increment"' in system["content"]
        assert user["role"] == "user" and re.fullmatch(r"Increment the counter by \d\. Counter reset to 0.\n",
                                                       user["content"])


def test_where_the_template_renders_the_tools_the_samples_prompt_names_them_first():
    tok = templated_tokenizer()
    tok.chat_template = "{% if tools %}{{ '<bos>system\n' + (tools | tojson) + '<eos>\n' }}{% endif %}" + CHATML
    conv = Conversations(multi_turn(env="tests.trl_environments:CounterResetEnv", max_turns=3), tok,
                         [{"prompt": "Count."}], 2)
    assert conv.renderers == [conv.renderers[0]] * 2 and conv.renderers[0].template_tools
    tools, user = conv.prompts()[0]
    assert tools["role"] == "tools" and json.loads(tools["content"])["function"]["name"] == "increment"
    assert user == {"role": "user", "content": "Count.Counter reset to 0.\n"}


@pytest.mark.parametrize("env, call, result, reward", [
    ("MyEchoEnv", '{"name": "step", "arguments": {"message": "Hello World!"}}', "Hello World!", 1.2),
    ("IncrementEnv", '{"name": "increment", "arguments": {"step": 3}}', "3", 1.0),
])
def test_trls_environment_examples_run_their_tools_in_an_episode(env, call, result, reward):
    tok = templated_tokenizer()
    row = {**trl_rows(env)[2], "prompt": [{"role": "user", "content": "Go."}]}
    conv = Conversations(multi_turn(env=f"tests.trl_environments:{env}", max_turns=3), tok, [row], 1)
    play(conv, tok, [f"<tool_call>\n{call}\n</tool_call>", "Done."])
    assert conv.messages[0][3] == {"role": "tool", "name": call.split('"')[3], "content": result}
    assert conv.env_rewards().tolist() == pytest.approx([reward])


@pytest.mark.parametrize("overrides, message", [
    (("rollout.max_turns=3",), "rollout.max_turns=3 needs something to answer the model"),
    (("rollout.tools=[calculator]",), "rollout.tools need rollout.max_turns >= 2"),
    (("rollout.env=letters",), "rollout.env=letters needs rollout.max_turns >= 2 .with one turn the environment "
                               "never answers the model.: add rollout=multi_turn or set rollout.max_turns=4"),
    (("reward=env",), "reward=env takes the environment's reward alone"),
    (("algo=dpo", "rollout.env=letters"), "algo=dpo learns from fixed rows"),
    (("rollout=multi_turn", "rollout.env=letters", "rollout.max_episode_tokens=8"), "not even one whole turn fits"),
    (("rollout=multi_turn", "rollout.tools=[nope_tool]"), "rollout.tools"),
    (("rollout=multi_turn", "rollout.env=no.such:Env"), "rollout.env"),
    (("rollout=multi_turn", "rollout.env=letters", "rollout.env_style=trl"),
     "rollout.env_style='trl' is not valid; choose one of: auto, gym, tools"),
])
def test_multi_turn_mistakes_get_one_clear_line(tmp_path, overrides, message):
    with pytest.raises((ConfigError, UsageError), match=message.replace("[", r"\[").replace("(", r"\(")):
        cfg = compose(*overrides)
        train(cfg, tmp_path, Console(quiet=True))


def test_an_environment_that_raises_stops_the_run_in_one_line_and_keeps_its_checkpoint(tmp_path, monkeypatch, capsys):
    from rlnotes.agents import builtin
    from rlnotes.commands.cli import main

    class Broken(builtin.LettersEnv):
        calls = 0

        def step(self, action):  # a bug that shows in the second step's episodes
            Broken.calls += 1
            if Broken.calls > 32:
                raise KeyError("no such state")
            return super().step(action)

    monkeypatch.setitem(builtin.ENVIRONMENTS, "broken", Broken)
    with pytest.raises(SystemExit) as stop:
        main(["train", *TOY[:-1], "rollout.env=broken", "trainer.steps=3", "trainer.save_every=1",
              f"hydra.run.dir={tmp_path}", "logging.progress=false"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "rlnotes: error: environment Broken.step raised KeyError: 'no such state'" in err
    assert "Traceback" not in err and "trainer.resume=auto" in err
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()
