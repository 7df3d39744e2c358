"""Built-in tasks (arith, letters, countdown) and the prompt sampler: determinism, prompt text,
answers, splits, solvability."""

import ast
import random
import re
from collections import Counter

import pytest
from omegaconf import OmegaConf

from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import DataConfig
from rlnotes.data.datasets import load_task
from rlnotes.data.sampler import PromptSampler
from rlnotes.data.tasks import (
    TASK_REWARDS,
    TASKS,
    arith,
    countdown,
    hidden_expression,
    letters,
)

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


def test_arith_dev_split_is_disjoint_from_test_and_train_and_leaves_the_test_rows_as_they_were():
    cfg = data_cfg(name="arith", digits=2, ops="+", train_size=3000, eval_size=200, seed=5)
    train, test = arith(cfg)
    dev_train, dev = arith(data_cfg(**{**OmegaConf.to_container(cfg), "eval_split": "dev"}))
    assert arith(data_cfg(**{**OmegaConf.to_container(cfg), "eval_split": "test"})) == (train, test)
    assert len(dev) == 200 == len(set(prompts(dev)))
    assert not set(prompts(dev)) & set(prompts(test))
    assert not (set(prompts(train)) | set(prompts(dev_train))) & (set(prompts(dev)) | set(prompts(test)))
    assert dev_train == train  # the split asked for changes the eval rows only
    # The test rows are those of the first draw of the seeded generator, as before dev rows existed.
    space = [r for r in arith(data_cfg(name="arith", digits=2, ops="+", train_size=1, eval_size=8100, seed=5))[1]]
    rng = random.Random(5)
    order = sorted(space, key=lambda r: tuple(map(int, ARITH.match(r["prompt"]).group(1, 3))))
    assert prompts(test) == prompts(rng.sample(order, 200))


@pytest.mark.parametrize("tool, ops, digits, max_digits", [("calculator", "+", 3, None), ("calculator", "+-*", 1, 2),
                                                       ("add", "+", 3, None), ("add", "+", 1, 2)])
def test_tool_demos_are_given_to_train_rows_alone_and_call_the_tool_on_the_question(tool, ops, digits, max_digits):
    """data.tool_demos: each train row's `messages` is the question, the call, the tool's message
    as the tool gives it for that call (run as an episode runs it), and the number; neither
    the test nor the dev rows have one, and the rows are otherwise those of the task without it."""
    from rlnotes.agents.builtin import TOOLS
    from rlnotes.agents.tools import parse_tool_calls, run_tool_calls

    cfg = dict(name="arith", digits=digits, max_digits=max_digits, ops=ops, train_size=300, seed=3)
    train, test = arith(data_cfg(**cfg, tool_demos=tool))
    _, dev = arith(data_cfg(**cfg, tool_demos=tool, eval_split="dev"))
    plain_train, plain_test = arith(data_cfg(**cfg))
    assert [{k: v for k, v in r.items() if k != "messages"} for r in train] == plain_train and test == plain_test
    assert not any("messages" in r for r in test + dev)
    for row in train:
        user, call, tool_message, answer = row["messages"]
        assert (user, answer) == ({"role": "user", "content": row["prompt"]},
                                  {"role": "assistant", "content": row["answer"]})
        parsed = parse_tool_calls(call["content"])
        assert call["role"] == "assistant" and not parsed.errors
        a, op, b = ARITH.match(row["prompt"]).groups()
        arguments = {"expression": f"{a}{op}{b}"} if tool == "calculator" else {"a": int(a), "b": int(b)}
        assert parsed.calls == [{"name": tool, "arguments": arguments}]
        assert run_tool_calls(parsed.calls, {tool: TOOLS[tool]}, None) == ([tool_message], 0)
        assert tool_message["content"] == row["answer"]


@pytest.mark.parametrize("overrides, message", [
    (("data=letters", "data.tool_demos=calculator"), "data.tool_demos=calculator writes demonstrations of the arith "),
    (("data=arith", "data.tool_demos=add", "data.operands=3"), "data.tool_demos=add demonstrates one call of add"),
    (("data=arith", "data.tool_demos=add", "data.ops=+-"), "set data.operands=2 and data.ops=+ "),
    (("data=arith", "data.tool_demos=abacus"), "data.tool_demos"),
    (("data=arith", "data.operands=1"), "data.operands"),
])
def test_tool_demos_that_cannot_be_written_are_one_line(overrides, message):
    from rlnotes.commands.usage import UsageError
    from tests.conftest import compose

    with pytest.raises(UsageError, match=re.escape(message)):
        compose(*overrides)


@pytest.mark.parametrize("question, worked", [
    ("47+38", "7+8=15. 4+3+1=8. 85"), ("42+13", "2+3=5. 4+1+0=5. 55"), ("97+97", "7+7=14. 9+9+1=19. 194"),
    ("10+90", "0+0=0. 1+9+0=10. 100"), ("3+4", "3+4=7. 7"), ("5+5", "5+5=10. 10"),
    ("347+589+123", "7+9+3=19. 4+8+2+1=15. 3+5+1+1=10. 1059")])
def test_a_worked_sum_writes_each_column_and_its_carry_then_the_number(question, worked):
    from rlnotes.data.tasks import worked_sum

    assert worked_sum({"prompt": f"What is {question}? Answer with just the number.", "answer": str(eval(question))}) \
        == worked


@pytest.mark.parametrize("digits, max_digits, operands", [(2, None, 2), (1, 2, 2), (3, None, 3)])
def test_worked_sums_are_given_to_train_rows_alone_and_add_up(digits, max_digits, operands):
    """data.worked: each train row's `worked` column adds its operands column by column, ones first:
    each step's terms are the operands' digits of that column and the carry out of the column before
    (none into the ones), its result their sum, the last step the row's answer; the held-out rows
    have none, and the rows are otherwise the task's."""
    cfg = dict(name="arith", digits=digits, max_digits=max_digits, operands=operands, train_size=300, seed=3)
    train, test = arith(data_cfg(**cfg, worked=True))
    assert [{k: v for k, v in r.items() if k != "worked"} for r in train] == arith(data_cfg(**cfg))[0]
    assert test == arith(data_cfg(**cfg))[1] and not any("worked" in r for r in test)
    for row in train:
        operands_ = row["prompt"].removeprefix("What is ").split("?")[0].split("+")
        width = max(map(len, operands_))
        *columns, number = row["worked"].split(". ")
        assert number == row["answer"] and len(columns) == width
        carry = 0
        for i, step in enumerate(columns):
            terms, total = step.split("=")
            digits_ = [o.rjust(width, "0")[width - 1 - i] for o in operands_] + ([str(carry)] if i else [])
            assert terms.split("+") == digits_ and int(total) == sum(map(int, digits_))
            carry = int(total) // 10
        assert int(total) * 10 ** (width - 1) + int(row["answer"]) % 10 ** (width - 1) == int(row["answer"])


@pytest.mark.parametrize("overrides", [("data=letters", "data.worked=true"), ("data=arith", "data.ops=+-", "data.worked=true")])
def test_worked_sums_that_cannot_be_written_are_one_line(overrides):
    from rlnotes.commands.usage import UsageError
    from tests.conftest import compose

    with pytest.raises(UsageError, match=re.escape("data.worked=true writes the arith task's sums worked column")):
        compose(*overrides)


def test_a_task_with_fewer_train_rows_than_a_batch_is_refused_before_anything_loads():
    from rlnotes.commands.usage import UsageError
    from tests.conftest import compose

    with pytest.raises(UsageError, match="data.train_size=2 is smaller than trainer.batch_size=4"):
        compose("data=arith", "data.train_size=2", "trainer.batch_size=4")


@pytest.mark.parametrize("ops, digits", [("+", 3), ("+-*", 1), ("+-*", 2)])
def test_three_operand_rows_are_answered_and_held_out_apart(ops, digits):
    """data.operands=3: 'What is 347+589+123?' with the value of the expression (* before + and -,
    checked by Python's own arithmetic), operands of `digits` digits, and test, dev and train
    problems that share no question."""
    cfg = dict(name="arith", digits=digits, ops=ops, operands=3, train_size=2000, eval_size=100, seed=3)
    train, test = arith(data_cfg(**cfg))
    dev = arith(data_cfg(**cfg, eval_split="dev"))[1]
    three = re.compile(r"^What is (\d+)([+*-])(\d+)([+*-])(\d+)\? Answer with just the number\.$")
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    for row in train + test + dev:
        a, op1, b, op2, c = three.match(row["prompt"]).groups()
        assert all(lo <= int(x) < 10 ** digits for x in (a, b, c)) and {op1, op2} <= set(ops)
        assert row["answer"] == str(eval(f"{a}{op1}{b}{op2}{c}"))  # noqa: S307 - digits and operators only
    test_q, dev_q, train_q = ({r["prompt"] for r in rows} for rows in (test, dev, train))
    assert len(test_q) == len(dev_q) == 100 and not test_q & dev_q and not (test_q | dev_q) & train_q


def test_three_operand_answers_by_hand():
    """All 10^3 x 3^2 one-digit problems held out (a space this small is its own eval split)."""
    rows = arith(data_cfg(name="arith", digits=1, ops="+-*", operands=3, train_size=1, eval_size=9000))[1]
    answers = {r["prompt"].split("?")[0]: r["answer"] for r in rows}
    assert len(answers) == 9000
    hand = {"What is 2+3*4": "14", "What is 9-2-3": "4", "What is 7*8-9": "47", "What is 0-9*9": "-81",
            "What is 5*0+1": "1", "What is 3-4+5": "4", "What is 2*3*4": "24"}
    assert {q: answers[q] for q in hand} == hand


def test_a_small_space_evaluates_dev_on_its_test_rows():
    cfg = dict(name="arith", digits=1, ops="+", train_size=50, eval_size=30)
    assert arith(data_cfg(**cfg, eval_split="dev"))[1] == arith(data_cfg(**cfg))[1]


def test_countdown_dev_problems_are_neither_test_nor_train_problems():
    train, test = countdown(countdown_cfg())
    dev_train, dev = countdown(countdown_cfg(eval_split="dev"))
    assert dev_train == train and len(dev) == len(test)
    assert len(set(prompts(train + test + dev))) == len(train) + 2 * len(test)


@pytest.mark.parametrize("ops", ["/", "+/", "", "+ "])
def test_arith_bad_ops_raise_config_error(ops):
    with pytest.raises(ConfigError, match="data.ops"):
        arith(data_cfg(name="arith", ops=ops))


def test_arith_negative_answers_are_scored_by_the_task_reward():
    from rlnotes.rewards.builtin import REWARDS

    _, space = arith(data_cfg(name="arith", digits=1, ops="-", train_size=1, eval_size=1000))
    negative = [r for r in space if r["answer"].startswith("-")]
    assert len(negative) == 45  # a - b < 0 for 45 of the 100 pairs of digits
    reward = REWARDS[TASK_REWARDS["arith"]]
    prompts = [r["prompt"] for r in negative]
    answers = [r["answer"] for r in negative]
    assert reward(prompts, answers, answer=answers) == [1.0] * 45
    assert reward(prompts, [f"The answer is {a}." for a in answers], answer=answers) == [1.0] * 45
    assert reward(prompts, [a.lstrip("-") for a in answers], answer=answers) == [0.0] * 45


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


# --------------------------------------------------------------------------------------------- countdown

COUNTDOWN = re.compile(r"^Using the numbers \[([\d, ]+)\], write an expression that equals (\d+)\. "
                       r"Use \+ - \* and parentheses, each number at most once\. Answer with just the expression\.$")


def value_and_numbers(expr):
    """(value, integers used) of an expression of integers, + - * and parentheses (a test's own reader)."""
    used = []

    def walk(node):
        if isinstance(node, ast.Constant):
            used.append(node.value)
            return node.value
        ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
        assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
        return ops[type(node.op)](walk(node.left), walk(node.right))

    return walk(ast.parse(expr, mode="eval").body), used


def countdown_cfg(**kw):
    return data_cfg(**{"name": "countdown", "ops": "+-*", "train_size": 300, "eval_size": 50,
                       "instruction": "Answer with just the expression.", **kw})


def test_every_countdown_problem_is_solved_by_its_hidden_expression():
    train, eval_rows = countdown(countdown_cfg())
    assert len(train) == 300 and len(eval_rows) == 50
    for row in train + eval_rows:
        numbers, target = COUNTDOWN.match(row["prompt"]).groups()
        assert [int(n) for n in numbers.split(", ")] == row["numbers"] and int(target) == row["target"]
        assert len(row["numbers"]) in (3, 4) and all(1 <= n <= 9 for n in row["numbers"])
        assert 1 <= row["target"] <= 999
        value, used = value_and_numbers(row["solution"])
        assert value == row["target"]
        assert Counter(used) == Counter(row["numbers"])  # each number exactly once
    assert {len(r["numbers"]) for r in train} == {3, 4}


def test_countdown_reward_accepts_the_hidden_expression():
    from rlnotes.rewards.builtin import REWARDS

    train, _ = countdown(countdown_cfg(train_size=40, eval_size=1))
    reward = REWARDS[TASK_REWARDS["countdown"]]
    columns = {"numbers": [r["numbers"] for r in train], "target": [r["target"] for r in train]}
    assert reward([r["prompt"] for r in train], [r["solution"] for r in train], **columns) == [1.0] * 40


def test_countdown_is_deterministic_distinct_and_holds_out_its_eval_problems():
    cfg = countdown_cfg()
    train, eval_rows = countdown(cfg)
    assert (train, eval_rows) == countdown(cfg) == load_task(cfg)
    assert len(set(prompts(train + eval_rows))) == 350
    assert countdown(countdown_cfg(seed=9))[1] != eval_rows


def test_countdown_ops_and_digits_shape_the_problems():
    train, _ = countdown(countdown_cfg(ops="+", digits=2, train_size=50, eval_size=1,
                                       instruction="Answer with just the number."))
    for row in train:
        assert "Use + and parentheses" in row["prompt"]
        assert row["target"] == sum(row["numbers"]) and max(row["numbers"]) <= 99
    with pytest.raises(ConfigError, match="data.ops"):
        countdown(countdown_cfg(ops="/"))


def test_hidden_expression_uses_every_number_once_in_any_tree_shape():
    rng = random.Random(0)
    shapes = set()
    for _ in range(200):
        text, value = hidden_expression([2, 3, 5, 7], "+-*", rng)
        got, used = value_and_numbers(text)
        assert got == value and sorted(used) == [2, 3, 5, 7]
        shapes.add(re.sub(r"\d|[-+*]", "", text))
    assert len(shapes) == 5  # the five ways to bracket four terms, outer brackets dropped


def test_too_many_countdown_problems_for_the_space_is_a_config_error():
    with pytest.raises(ConfigError, match="distinct countdown problems"):
        countdown(countdown_cfg(ops="+", digits=1, train_size=100_000, eval_size=1))


def test_every_task_has_a_reward_and_a_config():
    from pathlib import Path

    import rlnotes

    conf = Path(rlnotes.__file__).parent.parent / "conf" / "data"
    assert set(TASK_REWARDS) == set(TASKS)
    assert all((conf / f"{name}.yaml").exists() for name in TASKS)


def test_arith_mixes_operand_sizes_and_holds_out_each_sizes_eval_rows():
    train, eval_rows = arith(data_cfg(name="arith", digits=1, max_digits=2, train_size=400, eval_size=50))
    two_digit = lambda row: re.search(r"\d\d[+]\d\d", row["prompt"]) is not None  # noqa: E731
    assert sum(map(two_digit, train)) == 200  # equal shares
    _, held = arith(data_cfg(name="arith", digits=2, train_size=10, eval_size=50))
    assert [r for r in eval_rows if two_digit(r)] == held  # the rows a two-digit run holds out
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert len(eval_rows) == 100 and sum(map(two_digit, eval_rows)) == 50
    with pytest.raises(ConfigError, match="data.max_digits=1 is below data.digits=2"):
        arith(data_cfg(name="arith", digits=2, max_digits=1))
