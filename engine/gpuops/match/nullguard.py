"""Null readings tested before the comparisons they would break, not caught after.

A condition reads a GPU's fields, and many readings are null on some boards: a PCIe
H200 has no NVLink counters, an older GPU no GPM metrics, a fleet median is null until
enough peers report. `nvlink_links_down > 0` on a null raises TypeError, which the
compiled condition catches as false; a raised and caught exception costs about 0.6 us
in CPython, and such a rule pays it on every sample of every GPU without the reading.

`guard_nulls` rewrites a condition so that a comparison which a null field would make
raise first tests the field: `(_g0 := f["nvlink_links_down"]) is not None and _g0 > 0`.
The field is read once into a local, so a present reading costs no more than before
(a local load is cheaper than the second dict lookup it replaces).

The answer never changes, because a guard is only put where a raise and a false give
the same answer: on a part of the condition reached from its top only through the
values of `and`, the last value of `or` and the branches of `x if c else y`, whose
value is the condition's, or a false that makes the condition false. (An earlier value
of `or` is not: a false there goes on to the next value, a raise ends the condition.)
Any other part (a `not`, a comparison, a call) is guarded as a whole, by the fields
whose null makes the whole part raise: those under an ordering comparison (`<`, `>=`,
...), arithmetic, a sign, or a function that takes no null (`abs`, `bit`, ...), where
the part certainly evaluates them. `==`, `in`, `is` and `or` take a null without
raising, and leave it unguarded. A field that is
absent raises KeyError at the guard as it did at the lookup: false either way.
tests/unit/match/test_nullguard.py holds the rewritten condition to the original on
random conditions and facts.
"""

from __future__ import annotations

import ast
import copy
import itertools
from collections.abc import Callable, Iterator

_ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
# Functions that raise on a null argument, and how many of their first arguments do:
# round(x, None) is round(x), and label() reads a null as "no labels".
_TAKES_NO_NULL: dict[str, int | None] = {
    "abs": 1,
    "round": 1,
    "len": 1,
    "lower": 1,
    "bit": 2,
    "startswith": 2,
    "min": None,  # every argument (comparing a null raises)
    "max": None,
}


def guard_nulls(expr: ast.expr, prefix: str = "_g") -> ast.expr:
    """The condition (as `fact_expression` rewrites it) with its null tests in front;
    `prefix` names the locals the guarded fields are read into (unique per function).
    The tree given is left as it is."""
    names = (f"{prefix}{i}" for i in itertools.count())
    return _guard(copy.deepcopy(expr), names)


def guarded_fields(expr: ast.expr) -> list[str]:
    """The fields `guard_nulls` tests, in order (for docs and tests)."""
    return [field for part in _parts(expr) for field in dict.fromkeys(_raises(part))]


def _guard(node: ast.expr, names: Iterator[str]) -> ast.expr:
    """Guard each part whose value is the condition's (see the module's docstring)."""
    if isinstance(node, ast.BoolOp):
        node.values = [
            _guard(v, names) if _passes(node, i) else v for i, v in enumerate(node.values)
        ]
        return node
    if isinstance(node, ast.IfExp):
        node.body, node.orelse = _guard(node.body, names), _guard(node.orelse, names)
        return node
    fields = list(dict.fromkeys(_raises(node)))
    if not fields:
        return node
    local = {field: next(names) for field in fields}
    tests: list[ast.expr] = [
        ast.Compare(
            left=ast.NamedExpr(target=ast.Name(id=name, ctx=ast.Store()), value=_lookup(field)),
            ops=[ast.IsNot()],
            comparators=[ast.Constant(None)],
        )
        for field, name in local.items()
    ]
    body = _Reads(local).visit(node)
    guarded = ast.BoolOp(op=ast.And(), values=[*tests, body])
    return ast.copy_location(guarded, node)


def _parts(node: ast.expr) -> Iterator[ast.expr]:
    """The parts `_guard` looks at."""
    if isinstance(node, ast.BoolOp):
        for i, v in enumerate(node.values):
            if _passes(node, i):
                yield from _parts(v)
    elif isinstance(node, ast.IfExp):
        yield from _parts(node.body)
        yield from _parts(node.orelse)
    else:
        yield node


def _passes(node: ast.BoolOp, i: int) -> bool:
    """Whether a false value at `i` gives what a raise there gives: any of `and`'s (the
    whole is false either way), only the last of `or`'s (an earlier false would go on to
    the next value, where a raise ends the whole condition false)."""
    return isinstance(node.op, ast.And) or i == len(node.values) - 1


class _Reads(ast.NodeTransformer):
    """Each lookup of a guarded field becomes a load of the local it was read into."""

    def __init__(self, local: dict[str, str]) -> None:
        self.local = local

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        field = _field(node)
        if field is not None and field in self.local:
            return ast.copy_location(ast.Name(id=self.local[field], ctx=ast.Load()), node)
        return self.generic_visit(node)


def _lookup(field: str) -> ast.expr:
    return ast.Subscript(
        value=ast.Name(id="f", ctx=ast.Load()), slice=ast.Constant(field), ctx=ast.Load()
    )


def _field(node: ast.AST) -> str | None:
    """The field a node reads (`f["x"]`), else None."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "f"
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return node.slice.value
    return None


def _null_or_raises(node: ast.expr) -> list[str]:
    """Fields whose null makes `node` null or raise."""
    field = _field(node)
    return [field] if field is not None else _raises(node)


def _raises(node: ast.expr) -> list[str]:
    """Fields whose null makes evaluating `node` raise, whenever it is evaluated: only
    parts that are always evaluated count (the first of `and`/`or`, a chain's first
    comparison, both branches of `x if c else y`)."""
    if isinstance(node, ast.BinOp):
        # "%s" % None is text: a null on the right of % raises only where its own parts do.
        right = _raises if isinstance(node.op, ast.Mod) else _null_or_raises
        return _null_or_raises(node.left) + right(node.right)
    if isinstance(node, ast.UnaryOp):
        sign = isinstance(node.op, ast.USub | ast.UAdd)
        return (_null_or_raises if sign else _raises)(node.operand)
    if isinstance(node, ast.Compare):
        first: Callable[[ast.expr], list[str]] = (
            _null_or_raises if isinstance(node.ops[0], _ORDERING) else _raises
        )
        return first(node.left) + first(node.comparators[0])
    if isinstance(node, ast.Call):
        return _call(node)
    if isinstance(node, ast.BoolOp):
        return _raises(node.values[0])
    if isinstance(node, ast.IfExp):
        orelse = set(_raises(node.orelse))
        return _raises(node.test) + [f for f in _raises(node.body) if f in orelse]
    if isinstance(node, ast.List | ast.Tuple):
        return [f for e in node.elts for f in _raises(e)]
    return []


def _call(node: ast.Call) -> list[str]:
    """A call's arguments are all evaluated; a null raises in the first few of some."""
    name = node.func.id if isinstance(node.func, ast.Name) else ""
    strict = _TAKES_NO_NULL.get(name, 0)
    if strict is None:
        strict = len(node.args)
    out: list[str] = []
    for i, arg in enumerate(node.args):
        out += _null_or_raises(arg) if i < strict else _raises(arg)
    return out
