"""Built-in tasks (arith, letters) and the prompt sampler: determinism, prompt text, answers, splits."""

import re

import pytest
from omegaconf import OmegaConf

from rlnotes.config import ConfigError, DataConfig
from rlnotes.data import PromptSampler, arith, letters, load_task

ARITH = re.compile(r"^What is (\d+)([+*-])(\d+)\? Answer with just the number\.$")


def data_cfg(**kw):
    return OmegaConf.structured(DataConfig(**kw))


def prompts(rows):
    return [r["prompt"] for r in rows]


# --------------------------------------------------------------------------------------------- arith


def test_arith_is_deterministic_in_the_seed_and_differs_across_seeds():
    cfg = data_cfg(name="arith", digits=2, ops="+-", train_size=50, eval_size=20, seed=7)
    assert arith(cfg) == arith(cfg)
    assert load_task(cfg) == arith(cfg)
    train_a, eval_a = arith(cfg)
    train_b, eval_b = arith(data_cfg(name="arith", digits=2, ops="+-", train_size=50, eval_size=20, seed=8))
    assert prompts(train_a) != prompts(train_b)
    assert prompts(eval_a) != prompts(eval_b)


def test_arith_large_space_sample_is_deterministic_too():
    # 3 digits: 900^2 problems, more than are listed, so a seeded random sample stands for the space.
    cfg = data_cfg(name="arith", digits=3, ops="+", train_size=30, eval_size=10, seed=3)
    train, eval_rows = arith(cfg)
    assert (train, eval_rows) == arith(cfg)
    for row in train + eval_rows:
        a, _, b = ARITH.match(row["prompt"]).groups()
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999


def test_arith_prompt_text_and_answers_for_each_operator():
    # eval_size >= the 300 one-digit problems: the eval split is the whole space.
    _, space = arith(data_cfg(name="arith", digits=1, ops="+-*", train_size=1, eval_size=1000))
    answers = {r["prompt"]: r["answer"] for r in space}
    assert len(answers) == 300
    expected = {
        "What is 3+4? Answer with just the number.": "7",
        "What is 3-4? Answer with just the number.": "-1",
        "What is 3*4? Answer with just the number.": "12",
        "What is 9*9? Answer with just the number.": "81",
        "What is 0-9? Answer with just the number.": "-9",
        "What is 0+0? Answer with just the number.": "0",
        "What is 7*0? Answer with just the number.": "0",
    }
    for prompt, answer in expected.items():
        assert answers[prompt] == answer
    for row in space:
        assert ARITH.match(row["prompt"]), row["prompt"]
        assert set(row) == {"prompt", "answer"}


def test_arith_custom_instruction_is_appended():
    _, eval_rows = arith(data_cfg(name="arith", ops="+", train_size=1, eval_size=1, instruction="Be brief."))
    assert re.fullmatch(r"What is \d\+\d\? Be brief\.", eval_rows[0]["prompt"])


def test_arith_two_digit_operands_span_10_to_99():
    _, space = arith(data_cfg(name="arith", digits=2, ops="*", train_size=1, eval_size=90 * 90))
    operands = set()
    for row in space:
        a, op, b = ARITH.match(row["prompt"]).groups()
        assert op == "*" and row["answer"] == str(int(a) * int(b))
        operands |= {int(a), int(b)}
    assert operands == set(range(10, 100))


def test_arith_eval_prompts_never_appear_in_train_when_the_space_is_large():
    train, eval_rows = arith(data_cfg(name="arith", digits=2, ops="+", train_size=3000, eval_size=200, seed=5))
    assert len(train) == 3000 and len(eval_rows) == 200
    assert not set(prompts(train)) & set(prompts(eval_rows))


@pytest.mark.parametrize("eval_size, expected", [(30, 30), (100, 100), (250, 100)])
def test_arith_one_digit_eval_has_min_of_eval_size_and_space_distinct_prompts(eval_size, expected):
    train, eval_rows = arith(data_cfg(name="arith", digits=1, ops="+", train_size=40, eval_size=eval_size))
    assert len(eval_rows) == expected
    assert len(set(prompts(eval_rows))) == expected
    assert len(train) == 40


def test_arith_small_space_trains_in_distribution_but_holds_out_when_4x_larger():
    # 100 problems: 20 eval rows leave >= 4x, so train avoids them; 50 eval rows do not.
    train, eval_rows = arith(data_cfg(name="arith", digits=1, ops="+", train_size=500, eval_size=20))
    assert not set(prompts(train)) & set(prompts(eval_rows))
    train, eval_rows = arith(data_cfg(name="arith", digits=1, ops="+", train_size=500, eval_size=50))
    assert set(prompts(train)) & set(prompts(eval_rows))


@pytest.mark.parametrize("ops", ["/", "+/", "", "+ "])
def test_arith_bad_ops_raise_config_error(ops):
    with pytest.raises(ConfigError, match="data.ops"):
        arith(data_cfg(name="arith", ops=ops))


# --------------------------------------------------------------------------------------------- letters


def test_letters_rows_carry_the_letter_column():
    cfg = data_cfg(name="letters", letters="ab", train_size=40, eval_size=10, seed=1)
    train, eval_rows = load_task(cfg)
    assert len(train) == 40 and len(eval_rows) == 10
    for row in train + eval_rows:
        assert set(row) == {"prompt", "letter"}
        assert row["letter"] in ("a", "b")
        assert row["prompt"].startswith(f"Write the letter {row['letter']}")
    assert {r["letter"] for r in train} == {"a", "b"}
    assert (train, eval_rows) == letters(cfg)


def test_letters_prompts_for_one_letter():
    train, _ = letters(data_cfg(name="letters", letters="a", train_size=200, eval_size=5))
    assert set(prompts(train)) == {"Write the letter a:", "Write the letter a!", "Write the letter a please:",
                                   "Write the letter a many times:", "Write the letter a."}


# --------------------------------------------------------------------------------------------- sampler


def numbered(n):
    return [{"prompt": f"p{i}"} for i in range(n)]


def draw(sampler, batches):
    return [[r["prompt"] for r in sampler.next_batch()] for _ in range(batches)]


def test_sampler_batches_have_the_batch_size():
    sampler = PromptSampler(numbered(10), batch_size=3, seed=0)
    assert all(len(batch) == 3 for batch in draw(sampler, 12))


def test_sampler_is_deterministic_in_the_seed():
    assert draw(PromptSampler(numbered(12), 4, seed=1), 9) == draw(PromptSampler(numbered(12), 4, seed=1), 9)
    assert draw(PromptSampler(numbered(12), 4, seed=1), 9) != draw(PromptSampler(numbered(12), 4, seed=2), 9)


def test_sampler_covers_every_row_once_per_epoch_before_repeating():
    rows = numbered(12)
    batches = draw(PromptSampler(rows, batch_size=4, seed=3), 9)
    epochs = [sum(batches[i:i + 3], []) for i in (0, 3, 6)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(r["prompt"] for r in rows)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert epochs[0] != list(r["prompt"] for r in rows)  # shuffled at all


def test_sampler_never_repeats_a_row_within_an_epoch_when_the_batch_does_not_divide_it():
    # 10 rows, batches of 4: two batches per epoch (the 2-row tail waits for a later epoch).
    batches = draw(PromptSampler(numbered(10), batch_size=4, seed=0), 6)
    for i in (0, 2, 4):
        epoch = batches[i] + batches[i + 1]
        assert len(set(epoch)) == 8
