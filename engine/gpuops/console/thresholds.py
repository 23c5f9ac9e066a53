"""The temperature a fleet cell is "at threshold" by: the one the overheat rule fires at.

The heatmap paints a GPU hot where the rule would act, not against a number of its own:
the first enabled telemetry rule comparing `temp_c` with a field less a margin (`temp_c >=
temp_slowdown_c - 3`, gpu-overheat) or with a number. A GPU that lacks the field has no
threshold (the rule cannot fire on it), and shows none.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

from gpuops.console.latest import SIGNALS
from gpuops.match.expr import parse_condition
from gpuops.match.rules import RuleSet

# A frame row is [position, gpu, seconds old, *SIGNALS]; `temp_at` goes after them.
_HEAD = 3


@dataclass(frozen=True, slots=True)
class TempThreshold:
    """`temp_c >= field + offset` (or `>= offset` where `field` is None), from `rule`."""

    rule: str
    field: str | None
    offset: float
    op: str = ">="

    def at(self, row: Sequence[float | int | None]) -> float | None:
        """The temperature this GPU's row reaches the rule at; None when it has none."""
        if self.field is None:
            return self.offset
        if self.field not in SIGNALS:
            return None
        value = row[_HEAD + SIGNALS.index(self.field)]
        return None if value is None else round(float(value) + self.offset, 1)

    @property
    def text(self) -> str:
        """The condition as people read it."""
        if self.field is None:
            return f"{self.rule}: temp_c {self.op} {self.offset:g}"
        if not self.offset:
            return f"{self.rule}: temp_c {self.op} {self.field}"
        sign = "-" if self.offset < 0 else "+"
        return f"{self.rule}: temp_c {self.op} {self.field} {sign} {abs(self.offset):g}"


def temp_threshold(rules: RuleSet) -> TempThreshold | None:
    """The first enabled telemetry rule's `temp_c` threshold; None where no rule has one."""
    for rule in rules.rules:
        if rule.enabled and rule.on == "telemetry" and rule.when:
            found = _compare(parse_condition(rule.when), rule.name)
            if found is not None:
                return found
    return None


def _compare(tree: ast.AST, rule: str) -> TempThreshold | None:
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
            continue
        left, right, op = node.left, node.comparators[0], node.ops[0]
        if isinstance(left, ast.Name) and left.id == "temp_c" and isinstance(op, ast.GtE | ast.Gt):
            found = _bound(right, rule)
            shown = ">=" if isinstance(op, ast.GtE) else ">"
            return TempThreshold(found.rule, found.field, found.offset, shown) if found else None
    return None


def _bound(expr: ast.expr, rule: str) -> TempThreshold | None:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, int | float):
        return TempThreshold(rule, None, float(expr.value))
    if isinstance(expr, ast.Name):
        return TempThreshold(rule, expr.id, 0.0)
    if (
        isinstance(expr, ast.BinOp)
        and isinstance(expr.op, ast.Sub | ast.Add)
        and isinstance(expr.left, ast.Name)
        and isinstance(expr.right, ast.Constant)
        and isinstance(expr.right.value, int | float)
    ):
        sign = -1.0 if isinstance(expr.op, ast.Sub) else 1.0
        return TempThreshold(rule, expr.left.id, sign * float(expr.right.value))
    return None


def with_threshold(
    rows: list[list[float | int | None]], threshold: TempThreshold | None
) -> list[list[float | int | None]]:
    """Each row with its `temp_at` appended (None: no threshold for that GPU)."""
    for row in rows:
        row.append(threshold.at(row) if threshold is not None else None)
    return rows
