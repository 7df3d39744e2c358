"""Demonstrations as conversations (a `messages` column with tool turns): SFT and the SFT warm-up
learn their assistant turns alone, rendered token for token as the multi-turn episode that samples
those turns (rlnotes.agents.rendering), and a wrong row is one line that names it."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from rlnotes.agents.multi_turn import Conversations
from rlnotes.agents.rendering import Renderer, assistant_text, conversation_tokens, hermes_call
from rlnotes.agents.tools import parse_tool_calls
from rlnotes.commands.train import train
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import ModelConfig
from rlnotes.engine.model.loading import load_base
from tests.conftest import compose
from tests.test_multiturn import CALL, multi_turn, play, templated_tokenizer

QUESTION = "What is 123*45?"
ANSWER = "It is 5535."
CONVERSATION = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL % "123*45"},
                {"role": "tool", "name": "calculator", "content": "5535"}, {"role": "assistant", "content": ANSWER}]


def chars(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_demonstration_is_the_episode_that_samples_its_turns_with_loss_on_those_turns_alone():
    tok = templated_tokenizer()
    conv = Conversations(multi_turn(tools=["calculator"], max_turns=3), tok, [{"prompt": QUESTION}], 1)
    episode_prompt = conv.prompt_ids()[0][0]
    episode = play(conv, tok, [CALL % "123*45", ANSWER])   # the tokens an episode trains on
    renderer = Renderer.of(tok, True, conv.episodes[0].schemas)
    prompt, ids, mask = conversation_tokens(renderer, CONVERSATION)
    assert prompt + ids == episode and prompt == episode_prompt
    # by hand: the call and its EOS, the tool's message and the cue of the next turn, the answer and its EOS
    eos = tok.eos_token_id
    call, answer = chars(tok, CALL % "123*45") + [eos], chars(tok, ANSWER) + [eos]
    between = chars(tok, "\n<bos>tool\n5535<eos>\n<bos>assistant\n")
    assert ids == call + between + answer
    assert mask == [1.0] * len(call) + [0.0] * len(between) + [1.0] * len(answer)


def test_tool_calls_are_written_as_the_call_the_model_writes():
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "123*45"}'}}]}
    text = assistant_text(message)
    assert text == hermes_call("calculator", {"expression": "123*45"})
    assert parse_tool_calls(text).calls == [{"name": "calculator", "arguments": {"expression": "123*45"}}]
    tok = templated_tokenizer()
    renderer = Renderer.of(tok, True)
    as_calls = conversation_tokens(renderer, [CONVERSATION[0], message, *CONVERSATION[2:]])
    as_text = conversation_tokens(renderer, [CONVERSATION[0], {"role": "assistant", "content": text},
                                             *CONVERSATION[2:]])
    assert as_calls == as_text
    both = assistant_text({**message, "content": "Let me see."})
    assert both == "Let me see.\n" + text


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_on_conversations_is_the_nll_of_the_assistant_turns_alone(tmp_path):
    """Step 1's loss is the token mean of -log pi over both assistant turns of each conversation
    (their EOS included), from the untrained tiny model; the question and the tool's result get
    none. Without a chat template the conversation is "role: content" lines."""
    rows = [{"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                          {"role": "assistant", "content": CALL % f"{a}+{b}"},
                          {"role": "tool", "name": "calculator", "content": str(a + b)},
                          {"role": "assistant", "content": str(a + b)}]} for a, b in ((12, 30), (7, 5))]
    path = write(tmp_path / "calls.jsonl", rows)
    cfg = compose("algo=sft", "data=file", f"data.path={path}", "data.eval_size=0", "trainer.eval_every=null",
                  "trainer.steps=1", "trainer.batch_size=2", "logging.progress=false")
    loss = train(cfg, tmp_path / "run", Console(quiet=True))["loss"]
    model, tok = load_base(OmegaConf.structured(ModelConfig()))
    eos, total, count = tok.eos_token_id, 0.0, 0
    for row in rows:
        question, call, result, answer = (m["content"] for m in row["messages"])
        pieces = [(chars(tok, f"user: {question}\nassistant:"), False), (chars(tok, call) + [eos], True),
                  (chars(tok, f"\ntool: {result}\nassistant:"), False), (chars(tok, answer) + [eos], True)]
        ids = [t for piece, _ in pieces for t in piece]
        learnt = [t for piece, loss_on in pieces for t in [loss_on] * len(piece)]
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        for t in range(1, len(ids)):
            if learnt[t]:
                total -= float(logp[t - 1, ids[t]])
                count += 1
    assert count == sum(len(CALL % e) + 1 + 3 for e in ("12+30", "7+5"))  # each call, "42"/"12" and each EOS
    assert loss == pytest.approx(total / count, rel=1e-5)


BAD = [
    ([{"role": "user", "content": "Q?"}, {"role": "bot", "content": "A."}],
     "row 2, column 'messages': message 2 must be {role, content} with role one of system, user, assistant, tool"),
    ([{"role": "user", "content": "Q?"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
     "row 2, column 'messages': message 2, tool call 1: a tool call must be"),
    ([{"role": "user", "content": "Q?"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "calculator", "arguments": "{1+2"}}]}],
     "row 2, column 'messages': message 2, tool call 1: the arguments of tool call 'calculator' are a string that "
     "is not JSON"),
]


@pytest.mark.parametrize("conversation, says", BAD, ids=["role", "call-without-name", "arguments-not-json"])
def test_a_wrong_role_or_malformed_conversation_is_one_line_naming_the_row(tmp_path, capsys, conversation, says):
    from rlnotes.commands.cli import main

    good = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    path = write(tmp_path / "chats.jsonl", [{"messages": good}, {"messages": conversation}] + [{"messages": good}] * 4)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "algo=sft", f"data.path={path}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


@pytest.mark.parametrize("value, says", [
    ([{"role": "user", "content": "Q?"}], "a demonstration needs an assistant turn to learn from; its roles are user"),
    ([{"role": "user", "content": "Q?"}, {"role": "assistant", "content": 7}], "message 2 must be {role, content}"),
    (7, "has no text nor conversation; set sft_warmup.column to one of: answer"),
])
def test_a_warmup_conversation_that_cannot_be_learnt_is_one_line_naming_the_row(tmp_path, value, says):
    """The warm-up's column is checked before the model loads: row 1 of the arith task's train rows."""
    from rlnotes.data import tasks

    real = tasks.arith

    def with_demos(cfg):
        train_rows, eval_rows = real(cfg)
        return [{**r, "demo": value} for r in train_rows], eval_rows

    tasks.TASKS["arith"] = with_demos
    try:
        cfg = compose("data=arith", "reward=arith", "sft_warmup.steps=1", "sft_warmup.column=demo", "trainer.steps=2",
                      "logging.progress=false")
        with pytest.raises(ConfigError, match="task arith \\(train\\) row 1, column 'demo'") as e:
            train(cfg, tmp_path, Console(quiet=True))
        assert says in str(e.value) and "\n" not in str(e.value)
    finally:
        tasks.TASKS["arith"] = real


def test_with_several_environments_a_demonstration_describes_the_tools_of_the_one_its_row_chose():
    """rollout.env as a mapping: a warm-up row in the counter environment starts from the prompt an
    episode of that row starts from (its `increment` tool described), a row in the other from its own."""
    from types import SimpleNamespace

    from rlnotes.engine.prompts import PromptFormat
    from rlnotes.training.offline import encode_demonstrations

    tok = templated_tokenizer()
    mt = multi_turn(env={"counter": "tests.trl_environments:IncrementEnv", "letters": "letters"}, max_turns=2)
    said = [{"role": "assistant", "content": '<tool_call>{"name": "increment", "arguments": {"step": 3}}</tool_call>'},
            {"role": "tool", "name": "increment", "content": "3"}, {"role": "assistant", "content": "Done."}]
    rows = [{"prompt": "Count to 3.", "target": 3, "environment": "counter",
             "messages": [{"role": "user", "content": "Count to 3."}, *said]},
            {"prompt": "Write a:", "letter": "a", "environment": "letters",
             "messages": [{"role": "user", "content": "Write a:"}, {"role": "assistant", "content": "a"}]}]
    model = SimpleNamespace(policy=SimpleNamespace(tokenizer=tok), prompt_format=PromptFormat(), device=torch.device("cpu"))
    seqs = encode_demonstrations(model, rows, ("messages",), mt)
    n = seqs.n_completion
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(seqs.input_ids[:, :-n], seqs.attention_mask[:, :-n])]
    assert prompts == Conversations(mt, tok, rows, 1).prompt_ids()[0]
    assert "increment" in tok.decode(prompts[0]) and "increment" not in tok.decode(prompts[1])
    with pytest.raises(ConfigError, match="row 1 of the demonstrations: no environment named"):
        encode_demonstrations(model, [{**rows[0], "environment": None}], ("messages",), mt)
