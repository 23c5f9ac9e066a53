"""Null guards: the same answer as the condition without them, and no exception raised
for a null reading where one was raised before."""

from __future__ import annotations

import ast
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from gpuops.match.expr import (
    ERRORS,
    compile_sandboxed,
    condition_from,
    fact_expression,
    inline_bits,
)
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.match.nullguard import guard_nulls, guarded_fields
from gpuops.models import GpuSample, TelemetryEvent
from gpuops.settings import checkout_root
from hypothesis import assume, given, settings
from hypothesis import strategies as st

FIELDS = ("a", "b", "c")
KNOWN = frozenset(FIELDS)


def _unguarded(source: str) -> Callable[[dict[str, Any]], bool]:
    """The condition as it compiled before guards: every null caught as an error."""
    code = (
        "def _cond(f):\n    try:\n        return _bool(_EXPR)\n"
        "    except _ERRS:\n        return False\n"
    )
    ns = compile_sandboxed(code, {"_EXPR": fact_expression(source, KNOWN)}, {}, "<plain>")
    cond: Callable[[dict[str, Any]], bool] = ns["_cond"]
    return cond


@contextmanager
def _raised() -> Iterator[list[str]]:
    """The exceptions raised in Python frames while the block runs (caught or not)."""
    seen: list[str] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "exception":
            seen.append(arg[0].__name__)
        return trace

    sys.settrace(trace)
    try:
        yield seen
    finally:
        sys.settrace(None)


def _source(source: str) -> str:
    return ast.unparse(guard_nulls(fact_expression(source, KNOWN)))


def test_a_comparison_tests_its_fields_first() -> None:
    assert _source("a > 0") == "(_g0 := f['a']) is not None and _g0 > 0"
    assert _source("a >= b - 3") == (
        "(_g0 := f['a']) is not None and (_g1 := f['b']) is not None and (_g0 >= _g1 - 3)"
    )
    assert guarded_fields(fact_expression("bit(a, 0x20) and c > 1", KNOWN)) == ["a", "c"]


def test_only_parts_whose_false_is_the_conditions_are_guarded() -> None:
    # `or`'s first value: a false goes on to `b == 3`, a raise ends the condition false.
    assert _source("not (a > 5) or b == 3") == "not f['a'] > 5 or f['b'] == 3"
    # Its last value, and each of `and`'s, may be.
    assert _source("b == 3 or not (a > 5)") == (
        "f['b'] == 3 or ((_g0 := f['a']) is not None and (not _g0 > 5))"
    )
    # Equality and membership take a null without raising.
    assert guarded_fields(fact_expression("a == 1 and b in [1, 2] and c is None", KNOWN)) == []


def test_an_earlier_or_value_stays_an_error() -> None:
    cond = condition_from(fact_expression("not (a > 5) or b == 3", KNOWN))
    assert cond({"a": None, "b": 3}) is False  # as before: the null raised, the rule is false
    assert cond({"a": 9, "b": 3}) is True


def test_a_null_reading_raises_nothing() -> None:
    cond = condition_from(fact_expression("a >= b - 3 and bit(c, 0x40)", KNOWN))
    with _raised() as seen:
        assert cond({"a": None, "b": 80, "c": 64}) is False
        assert cond({"a": 90, "b": 80, "c": None}) is False
    assert seen == []
    assert cond({"a": 90, "b": 80, "c": 64}) is True
    assert cond({"b": 80, "c": 64}) is False  # absent: KeyError at the guard, false


def test_shipped_rules_on_a_board_without_nvlink_raise_nothing() -> None:
    """A PCIe H200 reports no NVLink counters: the link-down rule reads a null on every
    sample; it is false, as before, and costs no exception."""
    rules = load_rules([checkout_root() / "rules"], None)
    matcher = Matcher(rules)
    gpu = {**GpuSample(index=0, uuid="GPU-0", temp_c=40.0).model_dump(), "nvlink_links_down": None}
    event = TelemetryEvent.model_validate(
        {
            "id": "e1",
            "kind": "telemetry",
            "node": "n1",
            "ts": "2030-01-01T00:00:00Z",
            "source": "test",
            "data": {"gpus": [gpu]},
        }
    )
    link_down = next(r for r in rules.rules if r.name == "nvlink-link-down")
    alone = Matcher(type(rules)(rules=(link_down,)))
    with _raised() as seen:
        assert alone.match(event) == []
    assert seen == []
    assert matcher.match(event) == []


# --- the property: guarded and unguarded agree on every condition and fact ---------

_ATOMS = [*FIELDS, *FIELDS, *FIELDS, "0", "1", "2.5", "-3", "None", "True"]
_OPS = ["+", "-", "*", "/", "%", "&", "|", "<", "<=", ">", ">=", "==", "!=", "in"]
_VALUES: list[Any] = [None, None, 0, 1, 2, -3, 2.5, float("nan"), "", "x", "%s", True, [1, 2]]
_ABSENT = object()


def _condition(rng: random.Random, depth: int = 0) -> str:
    """A random condition, mostly comparisons and arithmetic under and/or (where guards
    go), with every other form the guard reasons about."""
    if depth > 3 or rng.random() < 0.2:
        return rng.choice(_ATOMS)

    def sub() -> str:
        return _condition(rng, depth + 1)

    form = rng.randrange(12)
    if form < 4:
        op = rng.choice(_OPS)
        return f"({sub()} in [1, 2, None])" if op == "in" else f"({sub()} {op} {sub()})"
    if form < 7:
        joined = f" {rng.choice(['and', 'or'])} ".join(sub() for _ in range(rng.randint(2, 3)))
        return f"({joined})"
    return [
        lambda: f"(not {sub()})",
        lambda: f"(-{sub()})",
        lambda: f"({sub()} if {sub()} else {sub()})",
        lambda: f"({sub()} < {sub()} <= {sub()})",
        lambda: f"{rng.choice(['max', 'min', 'bit', 'round'])}({sub()}, {sub()})",
    ][form - 7]()


def _fact(rng: random.Random) -> dict[str, Any]:
    """Every field present, mostly (null and absent behave apart only when present)."""
    drawn = {f: rng.choice([*_VALUES, _ABSENT]) for f in FIELDS}
    return {k: v for k, v in drawn.items() if v is not _ABSENT}


def _agree(source: str, facts: list[dict[str, Any]]) -> None:
    plain = _unguarded(source)
    guarded = condition_from(fact_expression(source, KNOWN))
    for fact in facts:
        try:
            expected = plain(fact)
        except Exception as exc:
            assert not isinstance(exc, ERRORS)
            with pytest.raises(type(exc)):
                guarded(fact)
            continue
        assert guarded(fact) is expected, f"{source} on {fact}"


@pytest.mark.parametrize(
    ("source", "fact"),
    [
        ("a % b", {"a": "%s", "b": None}),  # text % null is text, not an error
        ("round(a, b) > 1", {"a": 2.5, "b": None}),  # round(x, None) is round(x)
        ("a > 1 or b", {"a": None, "b": 1}),
        ("b or a > 1", {"a": None, "b": 0}),
        ("not (a > 1) and b", {"a": None, "b": 1}),
        ("(a > 1 if b else c > 1) and True", {"a": None, "b": 1, "c": 2}),
        ("a < b < c", {"a": 5, "b": 1, "c": None}),  # the chain stops before c
        ("a < b < c", {"a": 0, "b": 1, "c": None}),
        ("max(a, b) > 1", {"a": None, "b": 2}),
    ],
)
def test_edges_agree(source: str, fact: dict[str, Any]) -> None:
    _agree(source, [fact])


def test_guarded_and_unguarded_agree() -> None:
    """Thousands of random conditions, each on random facts: the same answer."""
    rng = random.Random(20261206)
    checked = 0
    while checked < 4000:
        source = _condition(rng)
        try:
            fact_expression(source, KNOWN)
        except ValueError:
            continue  # the loader refuses it (text in arithmetic, say)
        _agree(source, [_fact(rng) for _ in range(12)])
        checked += 1


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_guarded_and_unguarded_agree_on_any_seed(seed: int) -> None:
    rng = random.Random(seed)
    source = _condition(rng)
    try:
        fact_expression(source, KNOWN)
    except ValueError:
        assume(False)
    _agree(source, [_fact(rng) for _ in range(12)])


_MASKS = ["0x20 | 0x40", "4", "0x80", "2.9", "-1", "0x60 & 0x40 - 0x20", "a", "1 // 0", "1e999"]
_BITS_SEEN: list[Any] = [0, 4, 0x41, 0x80, -1, 2**70, 2.5, 7.9, True, False, "12", "x", None]


@pytest.mark.parametrize("mask", _MASKS)
def test_bit_with_a_constant_mask_inlined_answers_as_the_call(mask: str) -> None:
    """The generated code inlines `bit(x, MASK)` (gpuops.match.codegen): for every value,
    the answer the call `_bit` gives (an error, caught, is False alike); a mask that is
    not a constant (a field, a division by zero) stays the call."""
    source = f"bit(c, {mask})"
    code = (
        "def _cond(f):\n    try:\n        return _bool(_EXPR)\n"
        "    except _ERRS:\n        return False\n"
    )
    inlined = inline_bits(guard_nulls(fact_expression(source, KNOWN), "_g"))
    calls = [n for n in ast.walk(inlined) if isinstance(n, ast.Call)]
    constant = mask not in ("a", "1 // 0", "1e999")
    assert (calls == [] or [ast.unparse(n.func) for n in calls] == ["_int"]) is constant
    ns = compile_sandboxed(code, {"_EXPR": inlined}, {"_int": int}, "<inlined>")
    called = condition_from(guard_nulls(fact_expression(source, KNOWN)))
    for value in _BITS_SEEN:
        fact = {"a": 0x40, "c": value}
        assert ns["_cond"](fact) is called(fact), f"bit({value!r}, {mask})"
