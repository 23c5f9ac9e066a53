"""Rule conditions: a whitelisted Python expression subset compiled once to a callable.

Only comparisons, boolean logic, arithmetic, bit tests, membership in literal lists and
a named list of functions are accepted. There are no attributes, subscripts, lambdas,
comprehensions or names starting with `_`, so a condition has no path to Python's
object graph; after the check the tree is rewritten so every name reads from the fact
dict, and compiled with empty builtins.
"""

from __future__ import annotations

import ast
import difflib
import io
import itertools
import re
import tokenize
from collections.abc import Callable, Mapping
from typing import Any

from gpuops.match.aggregates import FUNCTIONS as AGGREGATES
from gpuops.match.aggregates import MAX_WINDOW_S, Aggregate
from gpuops.match.durations import PATTERN as DURATION_PATTERN
from gpuops.match.durations import format_duration, parse_duration
from gpuops.match.nullguard import guard_nulls
from gpuops.models import MAX_TEXT, cut_text

Fact = Mapping[str, Any]
Condition = Callable[[Fact], bool]

# Limits on a condition, checked before anything recursive walks it: the checker, the
# rewriter, deepcopy and CPython's compiler all recurse per level, so a long `1+1+...+1`
# would otherwise end in a RecursionError that takes a hot-reloading engine down.
MAX_SOURCE = 2000  # characters
MAX_DEPTH = 32  # levels of the syntax tree
MAX_NODES = 400  # syntax tree nodes (operators and names included)


def _bit(value: int, mask: int) -> bool:
    """True when any bit of `mask` is set in `value` (clocks-event reasons)."""
    return bool(int(value) & int(mask))


def inline_bits(expr: ast.expr) -> ast.expr:
    """`bit(x, MASK)` with a constant mask, as `(_int(x) & MASK) != 0`: what `_bit` does,
    without a Python call (three shipped rules test a GPU's clocks-event reasons on every
    sample). Any other mask stays a call. Rewrites `expr` in place; give it a guarded
    copy (the generated code's namespace has `_int`)."""
    return _InlineBits().visit(expr)  # type: ignore[no-any-return]


class _InlineBits(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        fn = node.func
        is_bit = isinstance(fn, ast.Name) and fn.id == "bit"
        if not is_bit or len(node.args) != 2 or node.keywords:
            return node
        mask = _constant_int(node.args[1])
        if mask is None:
            return node
        value = ast.Call(func=ast.Name(id="_int", ctx=ast.Load()), args=[node.args[0]], keywords=[])
        masked = ast.BinOp(left=value, op=ast.BitAnd(), right=ast.Constant(mask))
        test = ast.Compare(left=masked, ops=[ast.NotEq()], comparators=[ast.Constant(0)])
        return ast.copy_location(test, node)


# What a constant mask may be made of: bitwise and additive operators only (no `**` or
# `<<`, whose folding here could build an integer of any size from a short rule).
_FOLDED = (
    *(ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp),
    *(ast.BitOr, ast.BitAnd, ast.Add, ast.Sub, ast.USub, ast.UAdd),
)


def _constant_int(node: ast.expr) -> int | None:
    """The integer `int(node)` is, when the node is constants and operators only."""
    tree = ast.Expression(body=node)
    if not all(isinstance(n, _FOLDED) for n in ast.walk(tree)):
        return None
    try:
        value = eval(compile(tree, "<mask>", "eval"), {"__builtins__": {}})  # constants only
        if isinstance(value, int | float) and not isinstance(value, bool):
            return int(value)  # OverflowError, ValueError: an infinite or NaN mask
    except (ArithmeticError, TypeError, ValueError):
        pass
    return None  # the call, which raises as it did


def _label(labels: Any, name: str) -> str | None:
    """A label's value (an alert's `labels`), or None when it has no such label."""
    value = labels.get(name) if isinstance(labels, Mapping) else None
    return value if isinstance(value, str) else None


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "min": min,
    "max": max,
    "round": round,
    "len": len,
    "bit": _bit,
    "lower": str.lower,
    "startswith": str.startswith,
    "label": _label,
}

_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.BitAnd,
    ast.BitOr,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.In,
    ast.NotIn,
    ast.Is,
    ast.IsNot,
    ast.IfExp,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.Call,
    ast.List,
    ast.Tuple,
)

_EXPLAIN: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.Pow: "'**' is not allowed",
    ast.NamedExpr: "':=' is not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.Starred: "'*' unpacking is not allowed",
    ast.Dict: "dict literals are not allowed",
    ast.JoinedStr: "f-strings are not allowed",
}


def is_aggregate(node: ast.Call) -> bool:
    """A call to a window or group function (`min`/`max` only in their aggregate shapes).

    `max(a, b)` of two fields or numbers stays the plain function; `max(power_w)` (one
    field) is a group aggregate and `max(temp_c, 10m)` (a duration) a window function.
    """
    if not isinstance(node.func, ast.Name) or node.func.id not in AGGREGATES:
        return False
    if node.func.id not in ("min", "max"):
        return True
    args = node.args
    if node.keywords:
        return False
    if len(args) == 1:
        return isinstance(args[0], ast.Name)
    return len(args) == 2 and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)


class _Checker(ast.NodeVisitor):
    def __init__(
        self,
        fields: frozenset[str],
        string_fields: frozenset[str],
        numeric_fields: frozenset[str] | None = None,
    ) -> None:
        self.fields = fields
        self.string_fields = string_fields
        self.numeric_fields = numeric_fields  # None: aggregates are not allowed here
        self.aggregates: dict[str, Aggregate] = {}

    def generic_visit(self, node: ast.AST) -> None:
        if not isinstance(node, _ALLOWED):
            why = _EXPLAIN.get(type(node), f"{type(node).__name__} is not allowed")
            raise ValueError(why)
        super().generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id.startswith("_"):
            raise ValueError(f"name {node.id!r}: names starting with '_' are not allowed")
        if node.id not in self.fields:
            near = difflib.get_close_matches(node.id, self.fields, n=3, cutoff=0.75)
            hint = (
                f"did you mean {' or '.join(near)}?"
                if near
                else "the fields of each kind are in docs/events.md"
            )
            raise ValueError(f"unknown field {node.id!r} ({hint})")

    def visit_Call(self, node: ast.Call) -> None:
        if is_aggregate(node):
            self._aggregate(node)
            return
        if not isinstance(node.func, ast.Name):
            self.visit(node.func)  # names the construct (lambda, attribute, ...) when it is one
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            shown = ast.unparse(node.func)
            raise ValueError(
                f"call to {shown!r}: only {', '.join(sorted(FUNCTIONS))} may be called"
            )
        if node.keywords:
            raise ValueError(f"{node.func.id}(): keyword arguments are not allowed")
        for arg in node.args:
            self.visit(arg)

    def _aggregate(self, node: ast.Call) -> None:
        fn = node.func.id if isinstance(node.func, ast.Name) else "?"
        if self.numeric_fields is None:
            raise ValueError(f"{fn}(): aggregates are only allowed in rule conditions")
        if node.keywords or not 1 <= len(node.args) <= 2:
            raise ValueError(f"{fn}() takes a field and an optional window: {fn}(field, 10m)")
        field = node.args[0]
        if not isinstance(field, ast.Name):
            raise ValueError(
                f"{fn}(): the first argument must be a field name, not {ast.unparse(field)!r}"
            )
        self.visit_Name(field)
        if field.id not in self.numeric_fields:
            raise ValueError(f"{fn}(): field {field.id!r} is not numeric")
        window = None
        if len(node.args) == 2:
            window = _window(fn, node.args[1])
        shown = f"{fn}({field.id}" + (f", {format_duration(window)})" if window else ")")
        self.aggregates[shown] = Aggregate(fn, field.id, window, shown)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, ast.Is | ast.IsNot) and not (
                isinstance(right, ast.Constant) and right.value is None
            ):
                raise ValueError("'is' may only compare with None")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        # Arithmetic on strings or lists could build huge values; keep it numeric.
        for side in (node.left, node.right):
            if isinstance(side, ast.List | ast.Tuple) or (
                isinstance(side, ast.Constant) and isinstance(side.value, str | bytes)
            ):
                raise ValueError("arithmetic is only allowed on numbers")
            if isinstance(side, ast.Name) and side.id in self.string_fields:
                raise ValueError(f"arithmetic on text field {side.id!r} is not allowed")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value.startswith(DURATION_MARK):
            text = node.value.removeprefix(DURATION_MARK)
            raise ValueError(
                f"{text} is a duration: it may only be a window's length, as in p95(field, {text})"
            )
        if not isinstance(node.value, int | float | str | bool | type(None)):
            raise ValueError(f"constant {node.value!r} is not allowed")
        if isinstance(node.value, int) and abs(node.value) > 2**64:
            raise ValueError("integer constant too large")


def _window(fn: str, arg: ast.expr) -> float:
    """The window of a window function: a duration with a unit, up to MAX_WINDOW_S."""
    text = arg.value if isinstance(arg, ast.Constant) else None
    if isinstance(text, str):
        text = text.removeprefix(DURATION_MARK)
    if not isinstance(text, str) or not re.match(DURATION_PATTERN, text.strip()):
        raise ValueError(
            f"{fn}(): the window must be a duration like 10m or 24h, not {ast.unparse(arg)!r}"
        )
    seconds = parse_duration(text)
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(
            f"{fn}(): window {text} is out of range "
            f"(over 0, at most {format_duration(MAX_WINDOW_S)})"
        )
    return seconds


class _ToFactLookup(ast.NodeTransformer):
    """Rewrite field names to `f["name"]`, aggregate calls to `f["p95(util_gpu, 1d)"]`
    (the matcher writes their values into the fact); function names stay as globals."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if is_aggregate(node):
            assert isinstance(node.func, ast.Name) and isinstance(node.args[0], ast.Name)
            window = (
                f", {format_duration(_window(node.func.id, node.args[1]))}"
                if len(node.args) == 2
                else ""
            )
            return self._lookup(f"{node.func.id}({node.args[0].id}{window})", node)
        node.args = [self.visit(a) for a in node.args]
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return self._lookup(node.id, node)

    @staticmethod
    def _lookup(name: str, node: ast.AST) -> ast.AST:
        lookup = ast.Subscript(
            value=ast.Name(id="f", ctx=ast.Load()), slice=ast.Constant(name), ctx=ast.Load()
        )
        return ast.copy_location(lookup, node)


# Marks a duration the loader quoted (`24h` -> "\u23f1 24h"), so one anywhere but as a
# window's length (`temp_c > 10m`) is refused rather than compared as text, never true.
DURATION_MARK = "\u23f1"


def _quote_durations(source: str) -> str:
    """`p95(util_gpu, 24h)` is not Python: quote a number glued to a duration unit.

    Only a NUMBER token directly followed by a NAME token (`24` `h`, `1` `h30m`) that
    together spell a duration is quoted; strings are tokens of their own, so text inside
    them is never touched. Source the tokenizer refuses is left for the parser to explain.
    """
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    spans = []
    for num, unit in itertools.pairwise(tokens):
        if num.type == tokenize.NUMBER and unit.type == tokenize.NAME and num.end == unit.start:
            text = num.string + unit.string
            if re.match(DURATION_PATTERN, text):
                start = starts[num.start[0] - 1] + num.start[1]
                spans.append((start, start + len(text), text))
    for start, end, text in reversed(spans):
        source = f'{source[:start]}"{DURATION_MARK}{text}"{source[end:]}'
    return source


def parse_condition(source: str) -> ast.Expression:
    """The syntax tree of a condition as the loader reads it (durations in aggregates
    quoted), unchecked: for tools that look at which names a rule reads."""
    return _parse(source)


def _parse(source: str) -> ast.Expression:
    if len(source) > MAX_SOURCE:
        raise ValueError(f"condition too long ({len(source)} characters, limit {MAX_SOURCE})")
    try:
        return ast.parse(_quote_durations(source.strip()), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"syntax error in condition: {exc.msg}") from exc
    except (RecursionError, MemoryError) as exc:  # the parser itself gave up on nesting
        raise ValueError(f"condition too deep (limit {MAX_DEPTH} levels)") from exc


def check_size(tree: ast.AST, what: str = "condition") -> None:
    """Raise ValueError when the tree is deeper or larger than the limits (no recursion)."""
    nodes, depth, stack = 0, 0, [(tree, 1)]
    while stack:  # the source is capped, so walking all of it is cheap
        node, level = stack.pop()
        nodes += 1
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in ast.iter_child_nodes(node))
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} too deep ({depth} levels, limit {MAX_DEPTH})")
    if nodes > MAX_NODES:
        raise ValueError(f"{what} too large ({nodes} nodes, limit {MAX_NODES})")


def check(
    source: str, fields: frozenset[str], string_fields: frozenset[str] = frozenset()
) -> ast.expr:
    """Parse and vet a condition; raise ValueError naming the first thing not allowed."""
    tree = _parse(source)
    check_size(tree)
    _Checker(fields, string_fields).visit(tree)
    return tree.body


def rule_expression(
    source: str,
    fields: frozenset[str],
    string_fields: frozenset[str],
    numeric_fields: frozenset[str],
) -> tuple[ast.expr, tuple[Aggregate, ...]]:
    """A rule's condition, which may use aggregates: the fact-reading tree and its aggregates."""
    tree = _parse(source)
    check_size(tree)
    checker = _Checker(fields, string_fields, numeric_fields)
    checker.visit(tree)
    body: ast.expr = _ToFactLookup().visit(tree.body)
    return body, tuple(checker.aggregates.values())


ERRORS = (TypeError, ValueError, ArithmeticError, KeyError)


def fact_expression(
    source: str, fields: frozenset[str], string_fields: frozenset[str] = frozenset()
) -> ast.expr:
    """A vetted condition rewritten to read every field from the fact dict `f`."""
    body: ast.expr = _ToFactLookup().visit(check(source, fields, string_fields))
    return body


class _Splice(ast.NodeTransformer):
    """Replace placeholder names (`_EXPR0`, ...) in generated code with vetted expressions."""

    def __init__(self, parts: dict[str, ast.expr]) -> None:
        self.parts = parts

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return self.parts.get(node.id, node)


def compile_sandboxed(
    code: str, parts: dict[str, ast.expr], names: dict[str, Any], label: str
) -> dict[str, Any]:
    """Compile generated code with vetted expressions spliced in; no builtins, only `names`."""
    tree = _Splice(parts).visit(ast.parse(code))
    ast.fix_missing_locations(tree)
    namespace: dict[str, Any] = {"__builtins__": {}, "_bool": bool, "_ERRS": ERRORS, **FUNCTIONS}
    namespace.update(names)
    exec(compile(tree, label, "exec"), namespace)
    return namespace


def compile_condition(
    source: str,
    fields: frozenset[str],
    string_fields: frozenset[str] = frozenset(),
    label: str = "<condition>",
) -> Condition:
    """Compile a vetted condition to `f -> bool`; a missing or null field makes it False."""
    return condition_from(fact_expression(source, fields, string_fields), label)


_COND = """
def _cond(f):
    try:
        return _bool(_EXPR)
    except _ERRS:
        return False
"""


def condition_from(expr: ast.expr, label: str = "<condition>") -> Condition:
    """`f -> bool` from an expression that `fact_expression` returned."""
    namespace = compile_sandboxed(_COND, {"_EXPR": guard_nulls(expr)}, {}, label)
    cond: Condition = namespace["_cond"]
    return cond


_TEMPLATE = re.compile(r"\{\{\s*([A-Za-z][A-Za-z0-9_]*)\s*\}\}")


def template_names(text: str) -> list[str]:
    """Field names a `{{ name }}` template refers to."""
    return _TEMPLATE.findall(text)


def render(value: Any, fact: Fact) -> Any:
    """Fill `{{ name }}` placeholders from the fact; only plain names, no Jinja.

    Each filled value is cut to MAX_TEXT: a playbook var is copied into the intent and
    its decision, and a fact written as text (a list of floats) can be longer than the
    event held it. Control characters in it become spaces: a value is the node's own word,
    and a newline in a drain's reason split Slurm's one-line reason, which then read as a
    person's (the node held out of service with nobody's reason)."""
    if isinstance(value, str):
        return _TEMPLATE.sub(
            lambda m: _one_line(cut_text(str(fact.get(m.group(1), "")), MAX_TEXT)), value
        )
    if isinstance(value, list):
        return [render(v, fact) for v in value]
    if isinstance(value, dict):
        return {k: render(v, fact) for k, v in value.items()}
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def _one_line(text: str) -> str:
    return _CONTROL.sub(" ", text)


def fact_keys(expr: ast.expr | None) -> set[str]:
    """The fact keys a rewritten condition reads (`f["x"]`)."""
    if expr is None:
        return set()
    return {
        n.slice.value
        for n in ast.walk(expr)
        if isinstance(n, ast.Subscript)
        and isinstance(n.slice, ast.Constant)
        and isinstance(n.slice.value, str)
    }
