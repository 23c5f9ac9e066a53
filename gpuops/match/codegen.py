"""One generated function per event kind that evaluates every rule of that kind.

Calling a compiled condition per rule costs a Python call each; at 10,000 GPUs and 50
rules that call is most of the time. So the vetted condition trees of all rules of a
kind are spliced into one function, in rule order, with a window's hit or miss handler
called only when something happens (the rare path).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from gpuops.match.expr import compile_sandboxed
from gpuops.match.rules import Rule
from gpuops.match.windows import HeldFor, Instant, Window
from gpuops.models import Match

Fact = Mapping[str, Any]
KeyFn = Callable[[Fact], Hashable]
MakeMatch = Callable[[Rule, Hashable, Fact, float, str], Match]
KindEval = Callable[[Fact, float, str, list[Match]], None]


def _hit(
    rule: Rule, window: Window, key: KeyFn, field: str | None, make: MakeMatch
) -> Callable[..., None]:
    if isinstance(window, Instant):

        def fire(f: Fact, t: float, eid: str, out: list[Match]) -> None:
            out.append(make(rule, key(f), f, t, eid))

        return fire
    observe = window.observe

    def hit(f: Fact, t: float, eid: str, out: list[Match]) -> None:
        k = key(f)
        if observe(k, t, True, f.get(field) if field else None):
            out.append(make(rule, k, f, t, eid))

    return hit


def compile_kind(
    entries: list[tuple[Rule, Window, KeyFn, str | None]], make: MakeMatch, kind: str
) -> KindEval:
    """The evaluation function for every rule of one kind, rules in file order."""
    lines = ["def _eval(f, t, eid, out):"]
    parts: dict[str, Any] = {}
    names: dict[str, Any] = {}
    for i, (rule, window, key, field) in enumerate(entries):
        names[f"_hit{i}"] = _hit(rule, window, key, field, make)
        if rule.expr is None:
            lines.append(f"    _hit{i}(f, t, eid, out)")
            continue
        parts[f"_EXPR{i}"] = copy.deepcopy(rule.expr)
        lines += [
            "    try:",
            f"        _h = _EXPR{i}",
            "    except _ERRS:",
            "        _h = False",
            "    if _h:",
            f"        _hit{i}(f, t, eid, out)",
        ]
        if isinstance(window, HeldFor):
            # A false sample ends a run; only look the key up when some run is open.
            names[f"_state{i}"], names[f"_key{i}"] = window.state, key
            lines += [f"    elif _state{i}:", f"        _state{i}.pop(_key{i}(f), None)"]
    if len(lines) == 1:
        lines.append("    return None")
    namespace = compile_sandboxed("\n".join(lines) + "\n", parts, names, f"<rules on {kind}>")
    evaluate: KindEval = namespace["_eval"]
    return evaluate
