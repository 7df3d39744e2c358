"""Data from files and the hub: each format and shape, column renames, validation errors that name
the file, row and column, prompt length handling, eval splits, and a GRPO run on a user's JSONL."""

import csv
import json
import sys
import time
from io import StringIO
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from rich.console import Console

from rlnotes.algos.registry import REGISTRY
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import DataConfig
from rlnotes.data.datasets import (
    load_checked,
    load_task,
    needed_columns,
    read,
    reward_columns,
)
from rlnotes.data.fitting import PromptLengths, fit_and_split
from rlnotes.data.reading import hub_reachable
from rlnotes.engine.model.loading import tiny_tokenizer
from rlnotes.engine.prompts import encode_prompts, render_plain
from tests.conftest import compose

ROWS = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(10)]
# A chat template for the tiny tokenizer: "<role>content" lines, then "<assistant>" to cue the reply.
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def checked(cfg, *args):
    """load_checked for the algorithm of `cfg`."""
    return load_checked(cfg.data, REGISTRY[cfg.algo.name], *args)


def fit_rows(data, cfg, *args, **kwargs):
    """fit_and_split with the completions of `cfg`'s algorithm (sampled, or the rows' own)."""
    return fit_and_split(data, cfg, *args, samples=REGISTRY[cfg.algo.name].samples, **kwargs)


def write(path, rows):
    """`rows` as a file in the format of `path`'s extension; returns the path as a string."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    return str(path)


def data_cfg(**settings):
    """A data config built in code (composing a whole run config is much slower)."""
    return OmegaConf.structured(DataConfig(**settings))


def file_cfg(path, **settings):
    return data_cfg(**{"source": "file", "name": "file", "path": str(path), "eval_size": 2, **settings})


RENAME = {"columns": {"prompt": "question"}}


def error(fn, *args, **kwargs):
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    return str(e.value)


# --------------------------------------------------------------------------------------------- sources


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".parquet"])
def test_each_file_format_reads_the_same_rows_with_columns_renamed(tmp_path, ext):
    path = write(tmp_path / f"train{ext}", ROWS)
    data = read(file_cfg(path, **RENAME))
    rows = data.train.rows
    assert [r["prompt"] for r in rows] == [r["question"] for r in ROWS]
    assert [str(r["answer"]) for r in rows] == [r["answer"] for r in ROWS]  # csv/parquet may type it
    assert all(set(r) == {"prompt", "answer"} for r in rows)
    assert data.train.numbers == list(range(1, 11))


def test_held_out_eval_rows_are_seeded_disjoint_and_in_file_order(tmp_path):
    path = write(tmp_path / "t.jsonl", ROWS)
    cfg = file_cfg(path, **RENAME, eval_size=3)
    train, eval_rows = load_task(cfg)
    assert len(train) == 7 and len(eval_rows) == 3
    assert sorted(r["answer"] for r in train + eval_rows) == sorted(r["answer"] for r in ROWS)
    assert (train, eval_rows) == load_task(cfg)
    other = load_task(file_cfg(path, **RENAME, eval_size=3, seed=99))[1]
    assert other != eval_rows
    positions = [int(r["answer"]) for r in eval_rows]
    assert positions == sorted(positions)


def test_an_eval_file_gives_the_eval_rows(tmp_path):
    train_path = write(tmp_path / "train.jsonl", ROWS)
    eval_path = write(tmp_path / "eval.csv", [{"question": "What is 100+1?", "answer": "101"}])
    train, eval_rows = load_task(file_cfg(train_path, **RENAME, eval_path=eval_path))
    assert len(train) == 10
    assert eval_rows == [{"prompt": "What is 100+1?", "answer": "101"}]  # a CSV cell is text


def test_a_local_dataset_folder_loads_as_a_hub_dataset_with_its_eval_split(tmp_path):
    folder = tmp_path / "org" / "set"
    folder.mkdir(parents=True)
    write(folder / "train.jsonl", ROWS)
    write(folder / "test.jsonl", ROWS[:2])
    train, eval_rows = load_task(data_cfg(source="hub", name=str(folder), eval_split="test", **RENAME))
    assert [r["prompt"] for r in train] == [r["question"] for r in ROWS]
    assert [r["prompt"] for r in eval_rows] == [r["question"] for r in ROWS[:2]]
    message = error(load_task, data_cfg(source="hub", name=str(folder), split="validation"))
    assert message.startswith("data.split=validation") and "validation" in message


def test_a_dataset_saved_with_save_to_disk_loads_with_data_hub(tmp_path):
    """data.path=DIR of a saved dataset says to use data=hub data.name=DIR, which the library then
    refused for one Dataset ('saved using save_to_disk. Please use load_from_disk'): both kinds load."""
    import datasets

    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
    train, eval_rows = load_task(data_cfg(source="hub", name=str(one), eval_size=3, **RENAME))
    assert len(train) == 7 and sorted(r["prompt"] for r in train + eval_rows) == sorted(r["question"] for r in ROWS)
    assert error(load_task, data_cfg(source="hub", name=str(one), eval_split="test", **RENAME)).startswith(
        f"data.eval_split=test: data.name={one} is one dataset saved without splits")
    split = tmp_path / "split"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
                         ).save_to_disk(str(split))
    train, eval_rows = load_task(data_cfg(source="hub", name=str(split), eval_split="test", **RENAME))
    assert len(train) == 10 and [r["prompt"] for r in eval_rows] == [r["question"] for r in ROWS[:2]]
    assert error(load_task, data_cfg(source="hub", name=str(split), eval_split="dev", **RENAME)) == (
        f"data.eval_split=dev: data.name={split} has the splits train, test; name one of them")


def test_a_hub_name_that_is_a_local_path_is_read_or_named_before_the_hub_is_asked(tmp_path, monkeypatch):
    """A file, or a path to no folder, was looked for on the hub and blamed on the network; ~ was not
    expanded (the hub refused '~/...' as a repo id)."""
    folder = tmp_path / "set"
    folder.mkdir()
    file = write(folder / "train.jsonl", ROWS)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(read(data_cfg(source="hub", name="~/set", **RENAME)).train.rows) == 10
    assert error(load_task, data_cfg(source="hub", name=file)) == (
        f"data.name={file} is a file, and data=hub reads a hub dataset or a dataset folder; read the file with "
        f"data=file data.path={file}")
    for name in (str(tmp_path / "nope"), "./nope", "~/nope", "a/b/c"):
        assert error(load_task, data_cfg(source="hub", name=name)) == \
            f"data.name={name}: no such folder, and not a hub id (name or org/name)"


def test_a_hub_name_without_network_fails_at_once_and_says_how_to_use_a_file(tmp_path, monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: no network
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    assert not hub_reachable()
    start = time.perf_counter()
    message = error(load_task, data_cfg(source="hub", name="rlnotes-tests/no-such-set"))
    assert time.perf_counter() - start < 10  # the library alone retries for most of a minute
    assert message == ("data=hub data.name=rlnotes-tests/no-such-set: the hub cannot be reached from here and the "
                       "dataset is not in the local cache; download it where there is network (datasets.load_dataset("
                       "'rlnotes-tests/no-such-set', split='train').to_json('no-such-set.jsonl')), then use data=file "
                       "data.path=no-such-set.jsonl")
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # offline for that call only


@pytest.mark.parametrize("flag", ["hub", "datasets"])
def test_offline_mode_counts_as_unreachable(monkeypatch, flag):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants if flag == "hub" else datasets.config, "HF_HUB_OFFLINE", True)
    assert not hub_reachable()


# --------------------------------------------------------------------------------------------- formats


def test_conversational_prompts_stay_messages(tmp_path):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi?"}]
    path = write(tmp_path / "c.jsonl", [{"prompt": messages, "answer": "1"}] * 3)
    assert read(file_cfg(path)).train.rows[0] == {"prompt": messages, "answer": "1"}


@pytest.mark.parametrize("rows", [
    [{"prompt": "Q?", "chosen": "good", "rejected": "bad"}],
    [{"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "assistant", "content": "good"}],
      "rejected": [{"role": "assistant", "content": "bad"}]}],
    [{"chosen": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "good"}],
      "rejected": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "bad"}]}],
], ids=["plain", "conversational", "implicit-prompt"])
def test_preference_shapes_become_prompt_chosen_rejected(tmp_path, rows):
    path = write(tmp_path / "p.jsonl", rows * 3)
    row = read(file_cfg(path)).train.rows[0]
    assert row["chosen"] == "good" and row["rejected"] == "bad"
    assert row["prompt"] in ("Q?", [{"role": "user", "content": "Q?"}])


@pytest.mark.parametrize("rows, prompt", [
    ([{"prompt": "Q?", "completion": "A."}], "Q?"),
    ([{"prompt": [{"role": "user", "content": "Q?"}], "completion": [{"role": "assistant", "content": "A."}]}],
     [{"role": "user", "content": "Q?"}]),
    ([{"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]}],
     [{"role": "user", "content": "Q?"}]),
], ids=["prompt-completion", "conversational", "messages"])
def test_sft_shapes_become_prompt_completion(tmp_path, rows, prompt):
    """A messages row keeps its conversation too: SFT learns each of its assistant turns."""
    path = write(tmp_path / "s.jsonl", rows * 3)
    kept = {"messages": rows[0]["messages"]} if "messages" in rows[0] else {}
    assert read(file_cfg(path)).train.rows[0] == {"prompt": prompt, "completion": "A.", **kept}


def test_messages_without_a_reply_are_prompts(tmp_path):
    path = write(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "Q?"}], "answer": 3}] * 3)
    assert read(file_cfg(path)).train.rows[0] == {"prompt": [{"role": "user", "content": "Q?"}], "answer": 3}


def test_prompt_template_fills_in_the_row_columns(tmp_path):
    path = write(tmp_path / "t.jsonl", ROWS)
    rows = read(file_cfg(path, **RENAME, prompt_template="Q: {prompt} ({answer})")).train.rows
    assert rows[0]["prompt"] == "Q: What is 0+1? (1)"
    assert load_task(data_cfg(name="arith", prompt_template="Question: {prompt}\nAnswer:"))[0][0]["prompt"] \
        .startswith("Question: What is ")


def test_prompt_template_errors(tmp_path):
    path = write(tmp_path / "t.jsonl", ROWS)
    message = error(read, file_cfg(path, **RENAME, prompt_template="{missing}"))
    assert f"{path} row 1" in message and "missing" in message and "(answer, prompt)" in message
    chat = write(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}] * 3)
    assert "plain-text prompts" in error(read, file_cfg(chat, prompt_template="Q: {prompt}"))


# --------------------------------------------------------------------------------------------- rendering


def test_without_a_chat_template_conversations_render_as_role_lines():
    messages = [{"role": "user", "content": "Hi?"}]
    assert render_plain(messages) == "user: Hi?\nassistant:"
    assert render_plain(messages, "Be terse.") == "system: Be terse.\nuser: Hi?\nassistant:"
    assert render_plain("Hi?") == "Hi?" and render_plain("Hi?", "Be terse.") == "Be terse.\n\nHi?"
    tok = tiny_tokenizer()
    (ids,) = encode_prompts(tok, [messages], chat_template=True)
    assert tok.decode(ids) == "user: Hi?\nassistant:"


def test_chat_template_renders_text_and_messages_with_the_generation_prompt_and_system_precedence():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    decode = lambda prompts, system=None: [tok.decode(x) for x in encode_prompts(tok, prompts, True, system)]  # noqa
    own = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Q"}]
    assert decode(["Q", [{"role": "user", "content": "Q"}]]) == ["<user>Q\n<assistant>"] * 2
    assert decode(["Q", own], "Sys.") == ["<system>Sys.\n<user>Q\n<assistant>", "<system>Own.\n<user>Q\n<assistant>"]
    assert decode(["Q"]) == ["<user>Q\n<assistant>"]
    # chat_template off: the plain rendering even though the tokenizer has a template.
    assert tok.decode(encode_prompts(tok, [own], False)[0]) == "system: Own.\nuser: Q\nassistant:"


def test_data_system_prompt_wins_over_the_models():
    from rlnotes.data.settings import system_prompt

    assert system_prompt(compose("model=smollm2-135m")) == "You are a helpful assistant."
    assert system_prompt(compose("model=smollm2-135m", "data.system_prompt=Think.")) == "Think."
    assert system_prompt(compose("model=smollm2-135m", "data.system_prompt=")) == ""  # "" removes it
    assert system_prompt(compose()) is None


def test_offline_encode_takes_conversational_prompts_and_completions():
    import torch

    from rlnotes.engine.sequences import encode

    tok = tiny_tokenizer()
    plain = encode(tok, ["user: Q\nassistant:"], ["A"], torch.device("cpu"))
    chat = encode(tok, [[{"role": "user", "content": "Q"}]], [[{"role": "assistant", "content": "A"}]],
                  torch.device("cpu"))
    assert torch.equal(plain.input_ids, chat.input_ids) and torch.equal(plain.completion_mask, chat.completion_mask)
    assert tok.decode(chat.input_ids[0]) == "user: Q\nassistant:A<eos>"


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("rows, where, what", [
    ([{"prompt": "a"}, {"prompt": "b"}, {"prompt": 5}], "row 3, column 'prompt'", "got int 5"),
    ([{"prompt": "a"}, {"prompt": None}], "row 2, column 'prompt'", "got nothing (null)"),
    ([{"prompt": "a"}, {"prompt": "  "}], "row 2, column 'prompt'", "empty"),
    ([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": [{"role": "robot", "content": "b"}]}],
     "row 2, column 'prompt'", "message 1 must be {role, content}"),
    ([{"prompt": "a", "chosen": "x", "rejected": 3}], "row 1, column 'rejected'", "got int 3"),
    ([{"prompt": "a", "completion": [{"role": "user", "content": "x"}]}], "row 1, column 'completion'",
     "one assistant message"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
      {"messages": "hello"}], "row 2, column 'messages'", "list of {role, content} messages"),
    ([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
       "rejected": [{"role": "user", "content": "OTHER"}, {"role": "assistant", "content": "c"}]}],
     "row 1:", "share every turn but the last"),
], ids=["int-prompt", "null-prompt", "empty-prompt", "bad-role", "int-answer", "user-completion", "text-messages",
        "implicit-mismatch"])
def test_a_bad_row_names_file_row_and_column(tmp_path, rows, where, what):
    path = write(tmp_path / "bad.jsonl", rows)
    message = error(read, file_cfg(path, eval_size=0))
    assert message.startswith(f"{path} {where}") and what in message, message
    assert "\n" not in message


def test_a_missing_column_says_who_needs_it_and_how_to_rename(tmp_path):
    path = write(tmp_path / "t.jsonl", ROWS)
    message = error(checked, compose("data=file", f"data.path={path}", "reward=arith"))
    assert message == (f"{path} has no column 'prompt', which algo=grpo needs; its columns: answer, question; "
                       "rename one with data.columns.prompt=COLUMN")
    renamed = write(tmp_path / "r.jsonl", [{"prompt": r["question"], "solution": r["answer"]} for r in ROWS])
    cfg = compose("data=file", f"data.path={renamed}", "reward=arith")
    from rlnotes.rewards.scoring import Rewards

    message = error(checked, cfg, Rewards(cfg.reward).fns)
    assert "no column 'answer', which reward number_match needs" in message and "data.columns.answer=" in message
    assert len(checked(compose("data=file", f"data.path={renamed}", "reward=arith",
                                    "data.columns.answer=solution"), Rewards(cfg.reward).fns).train.rows) == 10
    pairs = error(checked, compose("data=file", f"data.path={renamed}", "algo=dpo"))
    assert "no column 'chosen', which algo=dpo needs" in pairs
    assert "no column 'completion', which algo=sft needs" in error(
        checked, compose("data=file", f"data.path={renamed}", "algo=sft"))


def test_a_column_named_like_a_reward_call_keyword_is_refused_with_the_rename(tmp_path):
    """The call's own completions, log_metric, ... would take the column's place: no reward could read it."""
    from rlnotes.rewards.scoring import Rewards

    path = write(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "answer": str(i), "completions": "mine", "log_metric": i}
                                        for i in range(10)])
    cfg = compose("data=file", f"data.path={path}", "reward=arith")
    assert error(checked, cfg, Rewards(cfg.reward).fns) == (
        f"{path} has a column named like a keyword every reward call passes itself (completions, log_metric), so no "
        "reward function would see its values; rename: data.columns.data_completions=completions "
        "data.columns.data_log_metric=log_metric")
    renamed = compose("data=file", f"data.path={path}", "reward=arith", "data.columns.data_completions=completions",
                      "data.columns.data_log_metric=log_metric")
    rows = checked(renamed, Rewards(renamed.reward).fns).train.rows
    assert rows[0]["data_completions"] == "mine" and "completions" not in rows[0]
    message = error(load_checked, cfg.data, None, generating="evaluation")  # rlnotes eval scores the rows too
    assert "(completions, log_metric)" in message
    pairs = write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b", "completions": 1}] * 10)
    assert checked(compose("algo=dpo", "data=file", f"data.path={pairs}", "trainer.eval_every=null"))  # no reward call


def test_a_renamed_column_that_is_not_there_lists_the_columns(tmp_path):
    path = write(tmp_path / "t.jsonl", ROWS)
    assert error(read, file_cfg(path, columns={"prompt": "query"})) == \
        f"data.columns.prompt=query: {path} has no column 'query'; its columns: answer, question"


def test_empty_missing_and_unknown_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "has no rows" in error(read, file_cfg(str(empty)))
    assert error(read, file_cfg(str(tmp_path / "nope.jsonl"))) == f"data.path={tmp_path / 'nope.jsonl'}: no such file"
    txt = tmp_path / "t.txt"
    txt.write_text("hello")
    assert "unknown format '.txt'; use one of .jsonl, .json, .parquet, .csv" in error(read, file_cfg(str(txt)))
    broken = tmp_path / "broken.parquet"
    broken.write_text('{"prompt": "a"}\n')
    assert error(read, file_cfg(str(broken))).startswith(f"data.path={broken} could not be read as parquet")


@pytest.mark.parametrize("name, text, where", [
    ("broken.jsonl", '{"prompt": "a"}\n\n{"prompt": \n', "line 3, column 12: not valid JSON (Expecting value)"),
    ("list.jsonl", '{"prompt": "a"}\n["a"]\n', "line 2: expected one JSON object per line"),
    ("doc.json", '[{"prompt": "a"},\n {"prompt" "b"}]', "line 2, column 12: not valid JSON (Expecting ':' delimiter)"),
    ("lines.json", '{"prompt": "a"}\n{"prompt": "b",}\n', "line 2, column 16: not valid JSON"),
])
def test_a_bad_json_line_is_named_by_file_and_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    assert error(read, file_cfg(str(path))).startswith(f"{path} {where}")


def test_a_bad_json_line_is_reported_once_by_the_command(tmp_path, capfd):
    """The `datasets` library logs its own parse error (twice: its handler and Hydra's); the one line
    rlnotes prints is the only one."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "letter": "a"}\n{"prompt": "b"\n')
    from rlnotes.commands.cli import main

    with pytest.raises(SystemExit) as stop:  # the train job exits 2 (the input is wrong) after its one error line
        main(["train", f"data.path={path}", "reward=letters", "logging.progress=false",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert stop.value.code == 2
    err = capfd.readouterr().err
    assert f"rlnotes: error: {path} line 2, column 15: not valid JSON" in err
    assert err.count("line 2") == 1 and "Failed to load JSON" not in err, err


# --------------------------------------------------------------------------------------------- as written


def rows_of(path):
    return read(file_cfg(str(path), eval_size=0)).train.rows


def test_csv_cells_are_read_as_the_text_they_hold(tmp_path):
    """A reader that guesses types turns 007 into 7.0 and NA into null, and exact_match then scores the
    exactly right answer 0."""
    from rlnotes.rewards.builtin import exact_match

    path = tmp_path / "qa.csv"
    path.write_text('prompt,answer,flag,when\nq1,007,True,2024-01-02\nq2,NA,,1.10\n"q3, quoted",12345678901234567890,nan,\n')
    rows = rows_of(path)
    assert rows == [{"prompt": "q1", "answer": "007", "flag": "True", "when": "2024-01-02"},
                    {"prompt": "q2", "answer": "NA", "flag": None, "when": "1.10"},  # an empty cell is null
                    {"prompt": "q3, quoted", "answer": "12345678901234567890", "flag": "nan", "when": None}]
    assert exact_match(None, ["007", "NA"], [r["answer"] for r in rows[:2]]) == [1.0, 1.0]


def test_json_values_keep_their_json_types(tmp_path):
    """A string that looks like a date or a number stays a string; numbers stay as written (an int
    beside a float is not made a float, a long int keeps its digits)."""
    rows = [{"prompt": "a", "answer": "007", "when": "2024-01-02", "n": 7, "big": 2 ** 70},
            {"prompt": "b", "answer": "NA", "when": "2024-01-02T10:00:00", "n": 7.5, "big": 1}]
    for ext in (".jsonl", ".json"):
        assert rows_of(write(tmp_path / f"t{ext}", rows)) == rows


def test_json_rows_missing_a_column_get_it_as_null(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    assert rows_of(path) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]


@pytest.mark.parametrize("name, data, where", [
    ("latin.jsonl", '{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"), "line 2, byte 16: not UTF-8 text"),
    ("latin.csv", "prompt,answer\na,1\ncaf\xe9,2\n".encode("latin-1"), "line 3, byte 4: not UTF-8 text"),
    ("cp1252.json", '[{"prompt": "\u201cquoted\u201d"}]'.encode("cp1252"), "line 1, byte 14: not UTF-8 text"),
    ("utf16.jsonl", '{"prompt": "a"}\n'.encode("utf-16"), "is not UTF-8 text (its bytes look like UTF-16"),
    ("utf16-no-bom.csv", "prompt\na\n".encode("utf-16-le"), "is not UTF-8 text (its bytes look like UTF-16"),
])
def test_a_file_in_another_encoding_is_named_with_its_line(tmp_path, name, data, where):
    path = tmp_path / name
    path.write_bytes(data)
    message = error(read, file_cfg(str(path)))
    assert message.startswith(f"{path} {where}") and "UTF-8 encoding" in message, message


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv"])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_column(tmp_path, ext):
    write(tmp_path / f"t{ext}", ROWS)
    path = tmp_path / f"t{ext}"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert [r["question"] for r in rows_of(path)] == [r["question"] for r in ROWS]


@pytest.mark.parametrize("name, text", [("blank.jsonl", "\n\n  \n"), ("blank.json", "\n\n"), ("blank.csv", "\n \n")])
def test_a_file_of_blank_lines_has_no_rows(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert error(read, file_cfg(str(path))) == f"{path} has no rows: it holds only blank lines"


def test_a_directory_is_not_a_data_file(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    assert error(read, file_cfg(str(tmp_path))) == (
        f"data.path={tmp_path} is a directory; give a data file: .jsonl, .json, .parquet or .csv (a folder of data "
        f"files, or a dataset saved for the hub: data=hub data.name={tmp_path})")
    good = write(tmp_path / "t.jsonl", ROWS)
    assert error(read, file_cfg(good, eval_path=str(tmp_path / "dir.jsonl"))) == (
        f"data.eval_path={tmp_path / 'dir.jsonl'} is a directory; give a data file: .jsonl, .json, .parquet or .csv")


def test_a_json_file_of_columns_is_read_as_rows(tmp_path):
    """As pandas reads them: {"col": [...]} (json.dump(df.to_dict("list"))), and pandas' own to_json()
    ({"col": {"0": ..., "1": ...}}) and to_json(orient="index") ({"0": {...}, "1": {...}})."""
    import pandas as pd

    want = [{"question": r["question"], "answer": r["answer"]} for r in ROWS]
    frame = pd.DataFrame(want)
    shapes = {"lists.json": json.dumps(frame.to_dict("list")), "pandas.json": frame.to_json(),
              "index.json": frame.to_json(orient="index"),
              "conversations.json": json.dumps({"prompt": [[{"role": "user", "content": "a"}]], "n": [1]})}
    for name, text in shapes.items():
        (tmp_path / name).write_text(text)
    for name in ("lists.json", "pandas.json", "index.json"):
        assert rows_of(tmp_path / name) == want, name
    assert rows_of(tmp_path / "conversations.json") == [{"prompt": [{"role": "user", "content": "a"}], "n": 1}]


@pytest.mark.parametrize("text, what", [
    ('{"prompt": ["a", "b"], "answer": ["1"]}', "holds columns of different lengths (prompt: 2, answer: 1)"),
    ('{"data": [{"prompt": "a"}, {"prompt": "b"}]}', "is one JSON object whose 'data' holds a list of objects; "
                                                     "if those are the rows, put them at the top level"),
    ('"hello"', 'holds str "hello"; give a list of rows'),
    ('[{"prompt": "a"}, "b"]', ': item 2 of the list is str "b"; give a list of rows'),
])
def test_a_json_document_of_another_shape_says_which_shapes_are_read(tmp_path, text, what):
    path = tmp_path / "t.json"
    path.write_text(text)
    message = error(read, file_cfg(str(path)))
    assert message.startswith(f"{path}{'' if what.startswith(':') else ' '}{what}"), message


def test_a_jsonl_file_holding_one_json_array_is_read(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROWS, indent=2))
    assert rows_of(path) == ROWS


def test_a_jsonl_string_may_hold_unicode_line_separators_and_lines_may_end_in_crlf(tmp_path):
    """json.dumps(..., ensure_ascii=False) writes U+2028 as it is; it ends no JSON Lines line."""
    path = tmp_path / "t.jsonl"
    rows = [{"prompt": "a\u2028b\u0085c"}, {"prompt": "d"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), newline="")
    assert rows_of(path) == rows


@pytest.mark.parametrize("text, where", [
    ("prompt,answer\na,1\nb,2,3\n", "line 3: 3 cells, but the header names 2 columns (prompt, answer)"),
    ('prompt,answer\na,1\n"b,2\n', "line 3: not valid CSV (unexpected end of data)"),
    ('prompt,answer\na,"1"x\n', "line 2: not valid CSV (',' expected after '\"')"),
    ("prompt,prompt\na,1\n", "line 1: the header names column 'prompt' twice; rename one"),
])
def test_a_bad_csv_line_is_named_by_file_and_line(tmp_path, text, where):
    """pandas reads a line with one cell too many by making its first cell the row index, which
    shifts every column by one without a word."""
    path = tmp_path / "t.csv"
    path.write_text(text)
    assert error(read, file_cfg(str(path))).startswith(f"{path} {where}")


def test_a_parquet_file_of_no_rows_or_not_parquet_says_so(tmp_path):
    """The library's own line for both was "An error occurred while generating the dataset"."""
    import pandas as pd

    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(empty)
    assert error(read, file_cfg(str(empty))) == f"{empty} has no rows"
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    assert error(read, file_cfg(str(bad))).startswith(
        f"data.path={bad} could not be read as parquet: Parquet magic bytes not found")


def test_a_csv_quoted_cell_keeps_its_line_breaks_and_pandas_index_gets_its_name(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(',prompt,answer\n0,"two\nlines",1\n\n1,b,2\n')
    assert rows_of(path) == [{"Unnamed: 0": "0", "prompt": "two\nlines", "answer": "1"},
                             {"Unnamed: 0": "1", "prompt": "b", "answer": "2"}]


def test_reward_columns_come_from_the_signature():
    def fn(prompts, completions, answer, numbers, target=0, **kw):
        return []

    assert reward_columns(fn) == ["answer", "numbers"]
    assert reward_columns(fn, bound=("numbers",)) == ["answer"]
    assert reward_columns(print) == []

    rf = SimpleNamespace(name="fn", fn=fn, args={})
    assert needed_columns(REGISTRY["grpo"], [rf]) == {"prompt": "algo=grpo", "answer": "reward fn", "numbers": "reward fn"}
    assert needed_columns(REGISTRY["rm"]) == {"prompt": "algo=rm", "chosen": "algo=rm", "rejected": "algo=rm"}


@pytest.mark.parametrize("overrides, message", [
    (("data.source=disk",), "data.source='disk' is not valid; choose one of: task, file, hub"),
    (("data=file",), "data=file needs the file to read: data.path=FILE"),
    (("data=hub",), "data=hub needs the dataset: data.name=org/set"),
    (("data.overlong=cut",), "data.overlong='cut' is not valid; choose one of: drop, truncate, error"),
    (("data=file", "data.path=x.jsonl", "data.eval_split=test"), "data.eval_split names a split of a hub dataset"),
    (("data.eval_path=e.jsonl",), "data.eval_path is for data=file and data=hub"),
    (("eval.data={digitz: 2}",), "eval.data.digitz is not a data setting; valid keys: source, name,"),
    (("eval.data={digits: x}",), "eval.data.digits: Value 'x' of type 'str' could not be converted to Integer"),
    (("eval.data={eval_split: dev2}",), "data.eval_split=dev2: a built-in task evaluates on its held-out rows"),
    (("sft_warmup.data={operandz: 2}",), "sft_warmup.data.operandz is not a data setting; valid keys: source, name,"),
    (("sft_warmup.data={operands: x}",), "sft_warmup.data.operands: Value 'x' of type 'str' could not be converted"),
    (("data=arith", "sft_warmup.data={tool_demos: add, ops: +-}"), "data.tool_demos=add demonstrates one call of add"),
    (("data=arith", "data.eval_split=valid"), "data.eval_split=valid: a built-in task evaluates on its held-out "
                                              "rows, choose one of test, dev (test: the default; dev: for tuning)"),
    (("data.max_prompt_len=0",), "data.max_prompt_len=0 must be at least 1"),
    (("algo=sft", "data.eval_size=0"), "trainer.eval_every=20 evaluates held-out rows and data.eval_size=0 holds out none"),
    (("data.name=nope",), "data.name='nope' is not valid"),
    (("data=arith", "data.path=x.jsonl"), "data.path=x.jsonl is a file to read, but data=arith reads a built-in "
                                          "task; drop data=arith (a path alone means data=file) or drop data.path"),
    (("data=hub", "data.name=org/set", "data.path=x.jsonl"), "but data=hub reads a hub dataset (data.name)"),
    (("data.path=x.jsonl", "data.eval_size=0", "trainer.eval_every=5"),
     "trainer.eval_every=5 evaluates held-out rows and data.eval_size=0 holds out none"),
])
def test_data_settings_are_checked_before_anything_loads(overrides, message):
    from rlnotes.commands.cli import UsageError

    with pytest.raises(UsageError) as e:
        compose("reward=arith", *overrides)
    assert message in str(e.value), str(e.value)


# --------------------------------------------------------------------------------------------- prompt length


def fit(path, *overrides, limit=None, tokenizer=None):
    cfg = compose("data=file", f"data.path={path}", "reward=arith", "data.columns.prompt=question",
                  "data.eval_size=0", "trainer.batch_size=1", *overrides)
    out = StringIO()
    train, eval_rows = fit_rows(checked(cfg), cfg, tokenizer or tiny_tokenizer(), limit,
                                     Console(file=out, width=300))
    return train, eval_rows, out.getvalue()


LONG = [{"question": "x" * n, "answer": str(n)} for n in (5, 30, 8, 40)]


def test_overlong_prompts_are_dropped_with_a_count(tmp_path):
    path = write(tmp_path / "l.jsonl", LONG)
    train, _, shown = fit(path, "data.max_prompt_len=10")
    assert [r["answer"] for r in train] == ["5", "8"]
    assert "2 of 4 train prompts longer than data.max_prompt_len=10 tokens dropped" in shown


def test_overlong_prompts_are_truncated_keeping_their_end(tmp_path):
    rows = [{"question": "abcdefghijklmnop end?", "answer": "1"}, {"question": "short", "answer": "2"}]
    path = write(tmp_path / "l.jsonl", rows)
    train, _, shown = fit(path, "data.max_prompt_len=8", "data.overlong=truncate")
    assert [r["prompt"] for r in train] == ["nop end?", "short"]  # the tiny tokenizer: one token a character
    assert "1 of 2 train prompts longer than data.max_prompt_len=8 tokens truncated" in shown


def test_truncating_a_conversation_cuts_its_last_message_and_counts_the_template(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "0123456789"}], "answer": "1"}]
    path = write(tmp_path / "c.jsonl", rows)
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    cfg = compose("data=file", f"data.path={path}", "reward=arith", "data.eval_size=0", "trainer.batch_size=1",
                  "data.max_prompt_len=20", "data.overlong=truncate", "model.chat_template=true")
    (row,), _ = fit_rows(checked(cfg), cfg, tok, None)
    # "<user>" + text + "\n<assistant>" is 18 tokens of template around the text: 2 characters stay.
    assert row["prompt"] == [{"role": "user", "content": "89"}]
    assert PromptLengths(tok, True, None)([row["prompt"]]) == [20]


def test_overlong_error_names_the_row(tmp_path):
    path = write(tmp_path / "l.jsonl", LONG)
    message = error(fit, path, "data.max_prompt_len=10", "data.overlong=error")
    assert message.startswith(f"{path} row 2, column 'prompt': 30 tokens, over data.max_prompt_len=10")


def test_a_prompt_the_model_cannot_hold_is_an_error_naming_file_row_and_column(tmp_path):
    path = write(tmp_path / "l.jsonl", LONG)
    message = error(fit, path, "rollout.max_new_tokens=16", limit=50)
    assert message.startswith(f"{path} row 4, column 'prompt': 40 prompt tokens + 16 (rollout.max_new_tokens) "
                              "exceed the model's 50 positions")
    assert "data.max_prompt_len" in message
    train, _, _ = fit(path, "rollout.max_new_tokens=16", "data.max_prompt_len=34", limit=50)
    assert len(train) == 3


def test_offline_rows_count_their_longest_answer_against_the_model(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "Q?", "chosen": "c" * 5, "rejected": "r" * 20}] * 2)
    cfg = compose("data=file", f"data.path={path}", "algo=dpo", "data.eval_size=1", "trainer.batch_size=1")
    message = error(fit_rows, checked(cfg), cfg, tiny_tokenizer(), 20)
    assert message.startswith(f"{path} row 1, column 'prompt': 2 prompt tokens + 21 (its rejected with EOS)")


def test_too_few_rows_for_a_batch_or_for_the_eval_size(tmp_path):
    path = write(tmp_path / "t.jsonl", ROWS)
    message = error(fit, path, "data.eval_size=4", "trainer.batch_size=8")
    assert message.startswith(f"{path} gives 6 training rows, fewer than trainer.batch_size=8")
    assert "would hold out all of them" in error(load_task, file_cfg(path, **RENAME, eval_size=10))


def test_a_path_alone_means_a_file():
    cfg = compose("data.path=mine.jsonl", "reward=letters")
    assert (cfg.data.source, cfg.data.name, cfg.data.path) == ("file", "file", "mine.jsonl")
    assert compose("algo=dpo", "data.path=mine.jsonl").data.source == "file"


@pytest.mark.parametrize("overrides, train, held, note", [
    ((), 64, 0, "by default none are held out when the run does not evaluate"),
    (("trainer.eval_every=10",), 58, 6, "held out by default, 10% of the rows"),
    (("algo=dpo",), 58, 6, "held out by default, 10% of the rows"),
    (("data.eval_size=10",), 54, 10, "held out with data.seed=1234"),
])
def test_a_small_file_trains_by_default_and_says_what_it_held_out(tmp_path, overrides, train, held, note):
    """TRL holds out nothing unless asked: a file without an eval split holds out rows only for a run
    that scores them (10%: 6 of 64), and the start of the run says which it did."""
    rows = [{"prompt": f"Q{i}", "chosen": "a", "rejected": "b", "letter": "a"} for i in range(64)]
    path = write(tmp_path / "small.jsonl", rows)
    cfg = compose(f"data.path={path}", "reward=letters", *overrides)
    out = StringIO()
    train_rows, eval_rows = fit_rows(checked(cfg), cfg, tiny_tokenizer(), None, Console(file=out, width=300))
    assert (len(train_rows), len(eval_rows)) == (train, held)
    assert f"data: {path}: {train} train rows, {held} eval rows ({note}" in out.getvalue()


def test_a_one_row_file_cannot_hold_out_rows_to_evaluate(tmp_path):
    path = write(tmp_path / "one.jsonl", [{"prompt": "Q", "chosen": "a", "rejected": "b"}])
    cfg = compose("algo=dpo", f"data.path={path}", "trainer.batch_size=1")
    assert error(fit_rows, checked(cfg), cfg, tiny_tokenizer(), None) == (
        f"{path} has 1 row, too few to hold one out for evaluation; give data.eval_path (an eval file)")


def test_built_in_tasks_keep_their_200_eval_rows():
    """data.eval_size null is 200 for a built-in task: the same rows as before it could be null."""
    cfg = compose("data=arith", "data.digits=2", "data.train_size=50")
    assert cfg.data.eval_size is None
    train, eval_rows = load_task(cfg.data)
    assert len(eval_rows) == 200 and (train, eval_rows) == load_task(compose(
        "data=arith", "data.digits=2", "data.train_size=50", "data.eval_size=200").data)


def test_text_pairs_with_an_implicit_prompt_split_as_trl_splits_them(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."}])
    assert load_task(file_cfg(path, eval_size=0))[0] == [{"prompt": "The sky is", "chosen": " blue.",
                                                          "rejected": " green."}]
    path = write(tmp_path / "p.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
                                        {"chosen": "ab", "rejected": "cd"}])
    assert error(read, file_cfg(path)) == (f"{path} row 2: chosen and rejected texts share no beginning (the implicit "
                                           "prompt); give a prompt column")


def test_a_text_row_is_trained_on_whole_after_a_start_token(tmp_path):
    """{"text": ...} (language modeling, SFT): every token of the text is a completion token, after the
    tokenizer's BOS; it has no prompt to sample from."""
    from rlnotes.engine.sequences import encode

    path = write(tmp_path / "lm.jsonl", [{"text": "abc"}, {"text": "de"}])
    rows = load_task(file_cfg(path, eval_size=0))[0]
    assert rows == [{"prompt": "", "completion": "abc"}, {"prompt": "", "completion": "de"}]
    tokenizer = tiny_tokenizer()
    seqs = encode(tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows], "cpu")
    text_ids = tokenizer("abc", add_special_tokens=False)["input_ids"]
    assert seqs.input_ids[0].tolist() == [tokenizer.bos_token_id, *text_ids, tokenizer.eos_token_id]
    assert seqs.completion_mask[0].tolist() == [1.0] * (len(text_ids) + 1)
    cfg = compose("algo=grpo", f"data.path={path}", "reward=letters")
    assert error(checked, cfg).startswith(f"{path} row 1: a {{\"text\": ...}} row (language modeling, for "
                                               "algo=sft) has no prompt to sample completions of, which algo=grpo does")


def test_text_rows_are_refused_when_the_runs_evaluations_generate(tmp_path, capsys):
    """algo=sft learns from {"text": ...} rows, but eval.generate samples completions of their prompts,
    which they have none of: `rlnotes train` says so, naming eval.generate, before the model loads."""
    from rlnotes.commands.cli import main

    path = write(tmp_path / "lm.jsonl", [{"text": f"Say a, {i}: aaaa"} for i in range(20)])
    args = ["train", "algo=sft", f"data.path={path}", "trainer.steps=1", "trainer.batch_size=4",
            "trainer.eval_every=1", "logging.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "eval.generate=true"])
    assert stop.value.code == 2
    assert "has no prompt to sample completions of, which eval.generate does" in capsys.readouterr().err


def test_built_in_tasks_pass_through_fitting_unchanged():
    cfg = compose("data=arith", "data.train_size=50", "data.eval_size=10")
    assert fit_rows(checked(cfg), cfg, tiny_tokenizer(), 512) == load_task(cfg.data)


# --------------------------------------------------------------------------------------------- end to end


def test_grpo_trains_on_a_users_jsonl_with_a_custom_reward(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_e2e.py").write_text(
        "import json, pathlib\n"
        "def log_and_score(prompts, completions, answer, **_):\n"
        "    with open(pathlib.Path(__file__).with_name('seen.jsonl'), 'a') as f:\n"
        "        f.write(json.dumps({'prompts': prompts, 'answer': answer}) + '\\n')\n"
        "    return [float(a in c) for c, a in zip(completions, answer)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path / "mine.jsonl", ROWS)
    from rlnotes.commands.cli import main

    code = main(["train", "data=file", f"data.path={path}", "data.columns.prompt=question", "data.eval_size=2",
                 'data.prompt_template="Q: {prompt}"', "reward=custom", "reward.target=user_rewards_e2e.log_and_score",
                 "trainer.steps=2", "trainer.batch_size=4", "algo.group_size=2", "logging.progress=false",
                 f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/log_and_score" in r for r in rows)
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 2 and all(len(s["prompts"]) == 8 for s in seen)  # 4 prompts x 2 samples
    truth = {f"Q: {r['question']}": r["answer"] for r in ROWS}
    assert all(truth[p] == a for s in seen for p, a in zip(s["prompts"], s["answer"]))
    sys.modules.pop("user_rewards_e2e", None)


def test_dpo_and_sft_train_on_conversational_files(tmp_path):
    from rlnotes.commands.train import train

    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    said = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    pairs = write(tmp_path / "pairs.jsonl", [{"chosen": user(f"q{i}") + said("aaaa"),
                                              "rejected": user(f"q{i}") + said("bbbb")} for i in range(6)])
    cfg = compose("algo=dpo", "data=file", f"data.path={pairs}", "data.eval_size=2", "trainer.batch_size=2",
                  "trainer.steps=2", "algo.precompute_ref=true", "logging.progress=false")
    assert train(cfg, tmp_path / "dpo", Console(quiet=True))["loss"] > 0
    chats = write(tmp_path / "sft.jsonl", [{"messages": user(f"q{i}") + said("aaaa")} for i in range(6)])
    cfg = compose("algo=sft", "data=file", f"data.path={chats}", "data.eval_size=2", "trainer.batch_size=2",
                  "trainer.steps=2", "logging.progress=false")
    assert train(cfg, tmp_path / "sft", Console(quiet=True))["loss"] > 0


# ------------------------------------------------------------------------------ every format, every command

USER = lambda text: [{"role": "user", "content": text}]  # noqa: E731
SAID = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
SAMPLERS = ("grpo", "rloo", "reinforce", "ppo", "dapo", "dr_grpo")
# (algo, the TRL format, one row of it (i numbers the row), whether its rows have prompts to generate from)
FORMATS = [(algo, "conversational prompt", lambda i: {"prompt": USER(f"Write the letter a, {i}"), "letter": "a"}, True)
           for algo in SAMPLERS] + [
    ("dpo", "conversational preference", lambda i: {"prompt": USER(f"Say a, {i}"), "chosen": SAID("aaaa"),
                                                    "rejected": SAID("bbbb"), "letter": "a"}, True),
    ("rm", "conversational implicit-prompt preference", lambda i: {"chosen": USER(f"Say a, {i}") + SAID("aaaa"),
                                                                   "rejected": USER(f"Say a, {i}") + SAID("bb"),
                                                                   "letter": "a"}, True),
    ("sft", "conversational language modeling (messages)", lambda i: {"messages": USER(f"Say a, {i}") + SAID("aaaa"),
                                                                      "letter": "a"}, True),
    ("sft", "conversational prompt-completion", lambda i: {"prompt": USER(f"Say a, {i}"), "completion": SAID("aaaa"),
                                                           "letter": "a"}, True),
    ("rloo", "standard prompt", lambda i: {"prompt": f"Write the letter a, {i}:", "letter": "a"}, True),
    ("dpo", "standard implicit-prompt preference", lambda i: {"chosen": f"Say a, {i}: aaaa",
                                                              "rejected": f"Say a, {i}: bbbb", "letter": "a"}, True),
    ("rm", "standard preference", lambda i: {"prompt": f"Say a, {i}:", "chosen": " aaaa", "rejected": " bbbb",
                                             "letter": "a"}, True),
    ("sft", "standard prompt-completion", lambda i: {"prompt": f"Say a, {i}:", "completion": " aaaa",
                                                     "letter": "a"}, True),
    ("sft", "standard language modeling (text)", lambda i: {"text": f"Say a, {i}: aaaa"}, False),
]


@pytest.mark.parametrize("algo, form, row, generates", FORMATS, ids=[f"{a}-{f}" for a, f, _, _ in FORMATS])
def test_every_algorithm_runs_every_command_on_a_users_64_row_file(tmp_path, capsys, algo, form, row, generates):
    """A user's 64-row JSONL, as they write it, through `rlnotes train` (default eval rows, the samples
    table, trainer.eval_every, a checkpoint every step), `rlnotes eval` of the run (its data and
    reward), `rlnotes plot` and `rlnotes export`."""
    from rlnotes.commands.cli import main

    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(row(i)) + "\n" for i in range(64)))
    run = tmp_path / "run"
    evaluation = ["trainer.eval_every=2", "eval.size=4", "eval.generate=true"] if generates else []
    extra = {"ppo": ["algo.minibatch_size=8"], "sft": [], "dpo": [], "rm": []}.get(algo, [])
    code = main(["train", f"algo={algo}", f"data.path={path}", "reward=letters", "trainer.steps=2",
                 "trainer.batch_size=4", "trainer.save_every=1", "logging.samples_every=1", "logging.progress=false",
                 "trainer.eval_every=1" if algo in ("dpo", "rm", "sft") else "algo.group_size=2", *evaluation, *extra,
                 f"hydra.run.dir={run}"])
    err = capsys.readouterr().err
    assert code == 0, err
    offline = algo in ("dpo", "rm", "sft")
    held = 6 if offline or generates else 0  # by default a file holds out 10% only when the run evaluates
    assert f"{64 - held} train rows, {held} eval rows" in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] >= 2 and (run / "final").is_dir()
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
    if algo in SAMPLERS:
        assert "samples at step " in err
        shown = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        assert shown[0]["prompt"] == row(0)["prompt"] or shown[0]["prompt"] in [row(i)["prompt"] for i in range(64)]
        if form.startswith("conversational"):
            assert "user: Write the letter a" in err  # the conversation shown as its turns
    if generates:
        assert (run / "eval" / "step_000002.jsonl").is_file()
        out = tmp_path / "evaluated"
        assert main(["eval", f"eval.policy={run}/final", "eval.size=4", f"eval.out={out}"]) == 0  # its file and reward
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == 4 and all(s["letter"] == "a" for s in samples)
    else:
        assert main(["eval", f"eval.policy={run}/final"]) == 2
        assert "has no prompt to sample completions of, which evaluation does" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "figures")]) == 0
    assert list((tmp_path / "figures").glob("*.png"))
    assert main(["export", f"{run}/final", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "config.json").is_file()
