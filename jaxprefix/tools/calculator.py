"""The built-in `calculator`: arithmetic expressions on Python's `ast`, never eval or exec.

    calculator({"expression": "(12 + 3) * -4 ** 2 // 7"})  ->  "-35"

Only numbers (int, float), + - * / // % **, unary minus and plus, and parentheses are read;
any other syntax (names, calls, attributes, strings, comparisons) is refused. Caps keep one call
cheap whatever the model writes: the expression's length, an exponent's size, and the size of
an integer result, so `9**9**9` is refused instead of computed.
"""
from __future__ import annotations

import ast
import math
import operator

from jaxprefix.tools.api import Tool

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000           # |b| in a ** b
MAX_INT_BITS = 4096           # an integer intermediate of more bits is refused (~1233 digits)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute."""


def _check(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result over {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {right} over {MAX_EXPONENT}")
            # int ** int: bound the result's size before computing it
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                    right > 0 and right * left.bit_length() > MAX_INT_BITS + 64:
                raise CalculatorError(f"result over {MAX_INT_BITS} bits")
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) \
                and left.bit_length() + right.bit_length() > MAX_INT_BITS + 64:
            raise CalculatorError(f"result over {MAX_INT_BITS} bits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(value, complex):
            raise CalculatorError("complex result")
        return _check(value)
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression of {len(expression)} characters, over "
                              f"{MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error at column {e.offset}") from None
    return _eval(tree)


def format_value(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return repr(value)


def calculator(arguments: dict) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / // % **, parentheses."""
    if "expression" not in arguments:
        raise CalculatorError(f"expected argument 'expression', got {sorted(arguments)}")
    return format_value(evaluate(arguments["expression"]))


CALCULATOR = Tool("calculator", calculator, calculator.__doc__,
                  {"expression": {"type": "string",
                                  "description": "e.g. (12 + 3) * 4 ** 2 // 7"}})
