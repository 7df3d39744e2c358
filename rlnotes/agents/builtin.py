"""The built-in tools and environments, chosen by short names: `rollout.tools=[calculator]` and
`rollout.env=letters`.

- `calculator`: arithmetic evaluated from the expression's syntax tree (numbers and operators
  only), so that a model's call can never run code.
- `add`: the sum of two integers, nothing else: a sum of three numbers takes two calls.
- `LettersEnv`: a two-turn toy environment a tiny model learns in seconds (write the row's
  letter, then write it again when asked), the multi-turn twin of the `letter_share` reward.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Callable, Dict, Optional, Tuple, Union

from rlnotes.rewards.builtin import letter_share

# ---------------------------------------------------------------------------------------------
# calculator

MAX_EXPRESSION_CHARS = 500
MAX_MAGNITUDE = 10 ** 100      # any number, given or computed, beyond this is refused
MAX_POWER_BITS = 400            # an integer power may have at most this many bits (about 120 digits)

_BINARY: Dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                                 ast.Pow: operator.pow}
_UNARY: Dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

_NAMES: Dict[type, str] = {ast.Name: "a name", ast.Call: "a function call", ast.Attribute: "an attribute"}

Number = Union[int, float]


def _checked(value: Number) -> Number:
    if isinstance(value, complex) or not isinstance(value, (int, float)):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("a number is too large")
    return value


def _power(base: Number, exponent: Number) -> Number:
    """base ** exponent, refused before it is computed when the result would be huge."""
    if exponent > 0 and abs(base) > 1 and exponent * math.log2(abs(base)) > MAX_POWER_BITS:
        raise ValueError("the power is too large")
    return base ** exponent


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        op = _power if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)]
        try:
            return _checked(op(left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("a number is too large") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    what = repr(node.value) if isinstance(node, ast.Constant) else _NAMES.get(type(node), type(node).__name__)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _format(value: Number) -> str:
    """An int as its digits; a float with 12 significant digits, without '.0' when it is whole."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression to evaluate, with numbers, + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    return _format(_evaluate(tree))


def add(a: int, b: int) -> int:
    """Add two integers and return their sum.

    Args:
        a: The first integer.
        b: The second integer.
    """
    for name, value in (("a", a), ("b", b)):
        if type(value) is not int:  # bool is an int to Python, not to the model
            raise ValueError(f"{name} must be an integer like 347, not {value!r}; add takes two integers a and b")
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError(f"{name} is too large")
    return a + b


# ---------------------------------------------------------------------------------------------
# a toy environment


class LettersEnv:
    """Two model turns: any first reply, ended by the model (its EOS); then, asked "Now write the
    letter x:", a reply scored by the share of its characters that are the row's `letter`
    (`letter_share`). The reward comes only after the environment's second prompt, so a model
    earns it only by ending its first turn and reading what the environment says next: the
    smallest task that needs a whole episode.
    """

    def reset(self, letter: str = "a", **_) -> None:
        self.letter = letter
        self.turn = 0

    def step(self, action: str) -> Tuple[Optional[str], float, bool]:
        self.turn += 1
        if self.turn == 1:
            return f"Now write the letter {self.letter}:", 0.0, False
        return None, letter_share(None, [action], [self.letter])[0], True


TOOLS: Dict[str, Callable] = {"calculator": calculator, "add": add}
ENVIRONMENTS: Dict[str, Callable] = {"letters": LettersEnv}
