"""The condition compiler: right answers, and no way out of the sandbox."""

from __future__ import annotations

import ast
import sys

import pytest
from gpuops.match.expr import MAX_SOURCE, check_size, compile_condition, render
from gpuops.models import MAX_TEXT

FIELDS = frozenset({"temp_c", "temp_slowdown_c", "clocks_event_reasons", "node", "uuid", "xid"})
TEXT = frozenset({"node", "uuid"})


@pytest.mark.parametrize(
    ("source", "fact", "expected"),
    [
        ("temp_c >= temp_slowdown_c - 3", {"temp_c": 86, "temp_slowdown_c": 89}, True),
        ("temp_c >= temp_slowdown_c - 3", {"temp_c": 85.9, "temp_slowdown_c": 89}, False),
        ("bit(clocks_event_reasons, 0x20 | 0x40)", {"clocks_event_reasons": 0x41}, True),
        ("bit(clocks_event_reasons, 0x20 | 0x40)", {"clocks_event_reasons": 0x4}, False),
        ("xid in [48, 79] and not node == 'n2'", {"xid": 79, "node": "n1"}, True),
        ("startswith(node, 'gpu-')", {"node": "gpu-7"}, True),
        ("max(temp_c, 10) > 50 if temp_c is not None else False", {"temp_c": None}, False),
    ],
)
def test_condition_evaluates(source: str, fact: dict[str, object], expected: bool) -> None:
    assert compile_condition(source, FIELDS, TEXT)(fact) is expected


def test_missing_or_null_field_is_false_not_an_error() -> None:
    cond = compile_condition("temp_c > 80", FIELDS)
    assert cond({"temp_c": None}) is False
    assert cond({}) is False


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("__import__('os')", "call to '__import__'"),
        ("().__class__", "attribute access is not allowed"),
        ("temp_c.__class__.__mro__", "attribute access is not allowed"),
        ("(lambda: 1)()", "lambdas are not allowed"),
        ("_secret > 1", "names starting with '_' are not allowed"),
        ("open('/etc/passwd')", "call to 'open'"),
        ("eval('1')", "call to 'eval'"),
        ("[c for c in node]", "comprehensions are not allowed"),
        ("temp_c ** 999999", "'**' is not allowed"),
        ("uuid * 1000000000", "arithmetic on text field 'uuid'"),
        ("'a' * 10", "arithmetic is only allowed on numbers"),
        ("node[0]", "subscripts are not allowed"),
        ("(x := 1)", "':=' is not allowed"),
        ("f'{node}'", "f-strings are not allowed"),
        ("temp_c is 3", "'is' may only compare with None"),
        ("max(temp_c, key=abs)", "keyword arguments are not allowed"),
        ("temperature > 1", "unknown field 'temperature'"),
        ("temp_c >", "syntax error"),
    ],
)
def test_escape_attempts_are_rejected(source: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        compile_condition(source, FIELDS, TEXT)
    assert message in str(caught.value)


def test_compiled_condition_has_no_builtins() -> None:
    cond = compile_condition("temp_c > 1", FIELDS)
    assert cond.__globals__["__builtins__"] == {}


def test_render_fills_only_plain_names() -> None:
    fact = {"gpu": 3, "temp_c": 88.5}
    assert render({"reason": "GPU {{ gpu }} at {{temp_c}} C"}, fact) == {
        "reason": "GPU 3 at 88.5 C"
    }
    assert render("{{ gpu.__class__ }}", fact) == "{{ gpu.__class__ }}"


def test_render_cuts_each_filled_value_to_the_free_text_bound() -> None:
    # A list of floats written as text is longer than the event held it, and a var is
    # copied into the intent and its decision: each filled value is cut.
    fact = {"actual": [9e15] * 5000, "gpu": 1}
    reason = render({"reason": "GPU {{ gpu }}: {{ actual }} ({{ actual }})"}, fact)["reason"]
    first, second = reason.removeprefix("GPU 1: ").removesuffix(")").split(" (")
    assert first == second and len(first) <= MAX_TEXT and "…[cut " in first
    assert first.startswith("[9000000000000000.0, 9000000000000000.0")


def test_deep_condition_is_refused_naming_its_depth_and_the_limit() -> None:
    # The rule from issue 10: 250 terms made the checker recurse past Python's limit.
    source = "temp_c > " + "+".join(["1"] * 250)
    with pytest.raises(ValueError, match=r"condition too deep \(252 levels, limit 32\)"):
        compile_condition(source, FIELDS)


def test_wide_condition_is_refused_by_node_count() -> None:
    source = "xid in [" + ", ".join(["1"] * 450) + "]"  # shallow, but 450 constants
    with pytest.raises(ValueError, match=r"condition too large \(\d+ nodes, limit 400\)"):
        compile_condition(source, FIELDS)


def test_long_condition_is_refused_by_length() -> None:
    source = "temp_c > 1" + " " * MAX_SOURCE
    with pytest.raises(
        ValueError, match=rf"condition too long \(\d+ characters, limit {MAX_SOURCE}\)"
    ):
        compile_condition(source, FIELDS)


def test_size_check_walks_trees_deeper_than_the_recursion_limit() -> None:
    # The limit check must come first and never recurse itself, however deep the tree.
    tree: ast.expr = ast.Constant(1)
    for _ in range(sys.getrecursionlimit() * 5):
        tree = ast.BinOp(left=tree, op=ast.Add(), right=ast.Constant(1))
    with pytest.raises(ValueError, match="too deep"):
        check_size(ast.Expression(body=tree))


def test_conditions_within_the_limits_compile_and_evaluate() -> None:
    source = "temp_c > " + "+".join(["1"] * 20) + " and xid in [" + ", ".join("1" * 90) + "]"
    assert compile_condition(source, FIELDS)({"temp_c": 21, "xid": 1}) is True
    assert compile_condition(source, FIELDS)({"temp_c": 20, "xid": 1}) is False


def test_a_filled_value_is_one_line() -> None:
    """Review of issue 30: a node's agent sent an sxid whose switch name held a newline;
    rendered into the drain's reason, it split Slurm's one-line reason, and the next
    return to service read the node as held by a person."""
    facts = {"switch": "sw3\nx [root@2026-12-07T00:00:00]", "sxid": 12028}
    filled = render("NVSwitch {{ switch }} fatal SXid {{ sxid }}", facts)
    assert filled == "NVSwitch sw3 x [root@2026-12-07T00:00:00] fatal SXid 12028"
    assert render({"reason": "{{ switch }}"}, {"switch": "a\r\n\t\x00\x7fb"}) == {"reason": "a b"}
