"""`calculator`: an arithmetic expression evaluated by walking its syntax tree, nothing else.

Allowed: int and float literals, `+ - * / // % **`, unary `-` and `+`, parentheses. Anything
else (names, calls, attributes, subscripts, comparisons, strings, ...) is refused. Sizes are
bounded before they are computed: an integer result may have at most `max_bits` bits and a
power's exponent at most `max_exponent` in magnitude, so `9**9**9` is refused at once.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar

from trainer.agent.base import Tool, ToolResponse
from trainer.agent.tools.loading import check_config_keys, function_schema

__all__ = ["CalculatorError", "CalculatorTool", "evaluate", "format_number"]

DEFAULTS = {"max_bits": 4096, "max_exponent": 10_000, "max_length": 1000}
"""`max_bits`: largest integer magnitude (4096 bits, about 1233 digits); `max_exponent`: largest
|exponent| of `**`; `max_length`: longest expression (characters)."""

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def _check(value: int | float, max_bits: int) -> int | float:
    if isinstance(value, int) and value.bit_length() > max_bits:
        raise CalculatorError(f"result exceeds {max_bits} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _power_fits(base: int | float, exp: int | float, max_bits: int, max_exponent: int) -> None:
    """Refuse `base ** exp` before computing it when it would be too large."""
    if abs(exp) > max_exponent:
        raise CalculatorError(f"exponent {exp!r} exceeds {max_exponent} in magnitude")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0:
        if (abs(base).bit_length() - 1) * exp > max_bits:
            raise CalculatorError(f"result exceeds {max_bits} bits")


def _eval(node: ast.AST, max_bits: int, max_exponent: int) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value, max_bits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, max_bits, max_exponent))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, max_bits, max_exponent)
        right = _eval(node.right, max_bits, max_exponent)
        if isinstance(node.op, ast.Pow):
            _power_fits(left, right, max_bits, max_exponent)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) \
                and left.bit_length() + right.bit_length() > max_bits + 1:
            raise CalculatorError(f"result exceeds {max_bits} bits")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise CalculatorError("division by zero") from e
        except OverflowError as e:
            raise CalculatorError(f"numeric overflow ({e})") from e
        if isinstance(value, complex):
            raise CalculatorError("result is a complex number")
        return _check(value, max_bits)
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalculatorError(f"`{what}` is not allowed: only numbers, + - * / // % ** and parentheses")


def evaluate(expression: str, max_bits: int = DEFAULTS["max_bits"],
             max_exponent: int = DEFAULTS["max_exponent"],
             max_length: int = DEFAULTS["max_length"]) -> int | float:
    """The value of the arithmetic `expression`; :class:`CalculatorError` when it is refused."""
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression ({type(e).__name__}: {e})") from e
    try:
        return _eval(tree.body, max_bits, max_exponent)
    except RecursionError as e:
        raise CalculatorError("expression nested too deeply") from e


def format_number(value: int | float) -> str:
    """`value` as text: integers (and integral floats) without `.0`, other floats by `repr`."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorTool(Tool):
    """The `calculator` tool: `{"expression": "..."}` -> the value as text, or `error: ...`.
    Config keys: `max_bits`, `max_exponent`, `max_length` (see :data:`DEFAULTS`)."""

    default_schema: ClassVar[dict[str, Any]] = function_schema(
        "calculator",
        "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
        {"expression": "The arithmetic expression, e.g. (12 + 30) * 2 / 7"})

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any] | None = None) -> None:
        check_config_keys("`CalculatorTool`", config, DEFAULTS)
        super().__init__(config, tool_schema or self.default_schema)
        self.limits = {key: int(config.get(key, default)) for key, default in DEFAULTS.items()}

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        expression = parameters.get("expression")
        if expression is None:
            return ToolResponse(text="error: missing the `expression` argument"), None, {"error": 1.0}
        try:
            value = evaluate(str(expression), **self.limits)
        except CalculatorError as e:
            return ToolResponse(text=f"error: {e}"), None, {"error": 1.0}
        return ToolResponse(text=format_number(value)), None, {"error": 0.0}
