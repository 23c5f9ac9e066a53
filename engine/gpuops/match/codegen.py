"""One generated function per event kind that evaluates every rule of that kind.

Calling a compiled condition per rule costs a Python call each; at 10,000 GPUs and 50
rules that call is most of the time. So the vetted condition trees of all rules of a
kind are spliced into one function, in rule order, with a window's hit or miss handler
called only when something happens (the rare path).

Rules with aggregates or inventory variables take a slower path, one call per sample:
their aggregates must see every sample (not only those whose condition holds), and
their facts are copied to receive the aggregate values and the node's variables.

Rules that read only fields which change on events are skipped for a GPU whose values
of them have not changed since they were all false on it (`Quiet`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuops.match.aggregates import HELD, Aggregates, is_number
from gpuops.match.expr import compile_sandboxed, fact_keys, inline_bits
from gpuops.match.nullguard import guard_nulls
from gpuops.match.rules import Rule
from gpuops.match.windows import HeldFor, Increase, Instant, Window
from gpuops.models import Match

Fact = Mapping[str, Any]
KeyFn = Callable[[Fact], Hashable]
MakeMatch = Callable[[Rule, Hashable, Fact, float, str], Match]
KindEval = Callable[[Fact, float, str, list[Match]], None]
# (rule, node, gpu, time): a key that had fired saw its condition go false.
Cleared = tuple[str, str, int | None, float]


@dataclass(slots=True)
class Entry:
    """One rule as the generated code sees it."""

    rule: Rule
    window: Window
    key: KeyFn
    field: str | None
    fired: set[Hashable] | None = None  # keys fired and not yet false (telemetry, alert rules)
    agg: Aggregates | None = None  # aggregate state, for rules whose condition has some
    extra: Mapping[str, Mapping[str, Any]] | None = None  # node -> its inventory variables
    # Alert rules: `fired` holds (key, fingerprint), so only the resolution of an alert
    # that fired clears it; another alert on the same node, false for this rule, does not.
    alert: bool = False

    @property
    def agg_only(self) -> bool:
        """The condition reads aggregates and nothing else of the fact."""
        names = {a.name for a in self.rule.aggregates}
        return bool(names) and fact_keys(self.rule.expr) <= names and self.extra is None

    @property
    def slow(self) -> bool:
        """Evaluated by its own handler on every sample (aggregates, inventory facts)."""
        return self.agg is not None or self.extra is not None


# A value over a window this long moves slowly: a rule that reads nothing else is looked
# at once per LONG_WINDOW_SHARE of its shortest window per key (a minute for a day), not
# on every sample; every sample still goes into the series. docs/rules.md, Aggregates.
LONG_WINDOW_S = 3600.0
LONG_WINDOW_SHARE = 1 / 1440


def slow_cadence(rule: Rule) -> float:
    """How often (event seconds) a rule whose condition reads only long-window aggregates
    is evaluated per key; 0 for every sample."""
    windows = [a.window_s for a in rule.aggregates]
    if not windows or any(w is None or w < LONG_WINDOW_S for w in windows):
        return 0.0
    every = min(w for w in windows if w is not None) * LONG_WINDOW_SHARE
    if rule.for_s is not None:
        every = min(every, rule.max_gap_s / 2)  # the run must not look broken by a gap
    return every


def node_gpu_key(f: Fact) -> Hashable:
    """The group key of a rule grouped by node and GPU (most rules): `(node, gpu)`."""
    return (f["node"], f.get("gpu"))


def node_key(f: Fact) -> Hashable:
    """The group key of a rule grouped by node (a rule that names no group)."""
    node: Hashable = f["node"]
    return node


# The keys whose bodies the generated code writes inline (no call; most rules' keys).
_INLINE_KEYS: dict[KeyFn, str] = {node_gpu_key: '(f["node"], f.get("gpu"))', node_key: 'f["node"]'}


# The name the generated code gives a sample's (node, gpu) key where it makes it once at
# the top (`_shares_gpu_key`).
_GPU_KEY = "_gk"


def _key_src(i: int, key: KeyFn, names: dict[str, Any], shared: bool = False) -> str:
    """The generated code's expression for entry i's group key: the (node, gpu) key made
    once at the top where it is (`shared`), a common key's own body inline, else a call
    of the rule's key function."""
    if shared and key is node_gpu_key:
        return _GPU_KEY
    inline = _INLINE_KEYS.get(key)
    if inline is not None:
        return inline
    names[f"_key{i}"] = key
    return f"_key{i}(f)"


def _fired_src(i: int, e: Entry, key_src: str) -> str:
    """The generated test of whether a false sample's key had fired: the membership
    inline (a rule that fired anywhere would otherwise cost a call on every false
    sample of every GPU); an alert rule's set holds (key, fingerprint), its handler's."""
    return f"_fired{i}" if e.alert else f"_fired{i} and {key_src} in _fired{i}"


def _member(f: Fact) -> Hashable:
    """What a group's member is: one GPU of a node (telemetry), else the node."""
    gpu = f.get("gpu")
    return f.get("node") if gpu is None else (f.get("node"), gpu)


def _slow(e: Entry, make: MakeMatch, cleared: list[Cleared] | None) -> Callable[..., None]:
    """The whole evaluation of one rule that needs aggregates or inventory facts.

    A key of None is a node outside every group of the key (no `rack` variable): the
    rule does not see it. A late sample moves the aggregates and nothing else.
    """
    rule, window, key, field, fired = e.rule, e.window, e.key, e.field, e.fired
    agg, extra, cond = e.agg, e.extra or {}, e.rule.condition
    observe = window.observe
    every = slow_cadence(rule) if agg is not None and e.agg_only else 0.0
    # An alert rule holds (key, fingerprint): only its own alert's resolution clears it.
    clear_alert = (
        _clear_alert(e, cleared) if e.alert and fired is not None and cleared is not None else None
    )

    def run(f: Fact, t: float, eid: str, out: list[Match]) -> None:
        k = key(f)
        if k is None:
            return
        if every and agg is not None and agg.between(k, t, every, f):
            return
        g = dict(f)
        more = extra.get(g.get("node", ""))
        if more:
            g.update(more)
        at = t
        if agg is not None:
            seen = agg.observe(k, _member(f), t, g)
            if seen is None:
                return
            at = seen
        if cond is None or cond(g):
            if observe(k, at, True, g.get(field) if field else None):
                out.append(make(rule, k, g, t, eid))
                if fired is not None:
                    fired.add((k, f.get("fingerprint")) if e.alert else k)
            return
        observe(k, at, False)
        if clear_alert is not None:
            clear_alert(f, t)
            return
        if fired and k in fired and cleared is not None:
            fired.discard(k)
            gpu = f.get("gpu")
            cleared.append(
                (rule.name, str(f.get("node", "")), gpu if isinstance(gpu, int) else None, t)
            )

    return run


def _hit(e: Entry, make: MakeMatch) -> Callable[..., None]:
    rule, window, key, field, fired, alert = e.rule, e.window, e.key, e.field, e.fired, e.alert
    if isinstance(window, Instant) and fired is None:

        def fire(f: Fact, t: float, eid: str, out: list[Match]) -> None:
            out.append(make(rule, key(f), f, t, eid))

        return fire
    observe = window.observe

    def hit(f: Fact, t: float, eid: str, out: list[Match]) -> None:
        k = key(f)
        if observe(k, t, True, f.get(field) if field else None):
            out.append(make(rule, k, f, t, eid))
            if fired is not None:
                fired.add((k, f.get("fingerprint")) if alert else k)

    return hit


def _clear(e: Entry, cleared: list[Cleared]) -> Callable[[Fact, float], None]:
    """The miss handler of a rule whose firing keys are watched for their first false sample."""
    name, key, fired = e.rule.name, e.key, e.fired
    assert fired is not None
    if e.alert:
        return _clear_alert(e, cleared)

    def clear(f: Fact, t: float) -> None:
        k = key(f)
        if k in fired:
            fired.discard(k)
            gpu = f.get("gpu")
            cleared.append((name, str(f.get("node", "")), gpu if isinstance(gpu, int) else None, t))

    return clear


def _clear_alert(e: Entry, cleared: list[Cleared]) -> Callable[[Fact, float], None]:
    """An alert that fired went false (resolved): the key clears with its last such alert.

    A key held by several alerts (two GPUs' alerts under a per-node rule) clears when the
    last of them resolves; a per-GPU key names its GPU, a per-node key none (all of them).
    """
    name, key, fired = e.rule.name, e.key, e.fired
    assert fired is not None
    per_gpu = "gpu" in e.rule.group_by

    def clear(f: Fact, t: float) -> None:
        k = key(f)
        one = (k, f.get("fingerprint"))
        if one not in fired:
            return
        fired.discard(one)
        if any(held[0] == k for held in fired):  # type: ignore[index]
            return
        gpu = f.get("gpu") if per_gpu else None
        cleared.append((name, str(f.get("node", "")), gpu if isinstance(gpu, int) else None, t))

    return clear


def _between(
    i: int, agg: Aggregates, every: float, key: KeyFn, names: dict[str, Any], shared: bool
) -> list[str]:
    """Lines for a rule read at a cadence (`slow_cadence`): between two looks at a key,
    its sample goes into the key's series inline, as `Aggregates.between` puts it, without
    the rule's and the aggregates' calls (a day-long p95 takes every sample of every GPU);
    a key due for a look, or not seen yet, goes to the rule's whole evaluation."""
    names[f"_aggk{i}"], names[f"_every{i}"] = agg.keys, every
    lines = [
        f"    _k = {_key_src(i, key, names, shared)}",
        f"    _st = _aggk{i}.get(_k)",
        f"    if _st is not None and _st.evaluated <= t < _st.evaluated + _every{i}:",
        "        _ser = _st.series",
    ]
    for j, field in enumerate(agg.series_fields):
        names[f"_sf{i}_{j}"] = field
        lines += [
            f"        _v = f.get(_sf{i}_{j})",
            "        if (_v.__class__ is _float and _isfinite(_v)) or _v.__class__ is _int"
            " or _number(_v):",
            # Series.add's first step inline: a sample well inside the head bucket, with
            # room in the held list, is appended to it (the call costs more than that).
            f"            _s = _ser[{j}]",
            "            if _s.inside <= t < _s.until and _len(_s.held) < _HELD_ROOM:",
            "                _s.held.append(_v)",
            "            else:",
            "                _s.add(t, _v)",
        ]
    names["_HELD_ROOM"] = HELD - 1  # one appended stays under HELD: no settling due
    return [*lines, "    else:", f"        _slow{i}(f, t, eid, out)"]


def is_quiet(e: Entry, fields: frozenset[str]) -> bool:
    """Whether the entry's condition reads only `fields` (`Quiet`): its value is known
    to be false where they are the same as when it was."""
    return (
        bool(fields)
        and not e.slow
        and not e.alert
        and e.rule.expr is not None
        and fact_keys(e.rule.expr) <= fields  # its only reads of the fact (`f["x"]`)
    )


def _shares_gpu_key(entries: list[Entry], calm: set[int]) -> bool:
    """Whether the generated code makes the (node, gpu) key once, at the top: where some
    entry keyed by it reads it on every sample (a quiet memo, a long-window aggregate,
    a counter), rather than each of them making the tuple again."""
    return bool(calm) or any(
        e.key is node_gpu_key
        and (
            (e.slow and e.agg is not None and e.agg_only and slow_cadence(e.rule) > 0)
            or (e.rule.expr is None and isinstance(e.window, Increase) and bool(e.field))
        )
        for e in entries
    )


def skips_whole(e: Entry) -> bool:
    """Whether a quiet entry is skipped whole, its false sample's handling with it: keyed
    by GPU (no other GPU's sample moves its state), and its false sample only ends what
    a true one began (`for`, or no form). Any other only skips its condition."""
    return e.key is node_gpu_key and isinstance(e.window, HeldFor | Instant)


# What a fact without one of the quiet fields reads as: never remembered, never equal.
_UNREAD = object()
# GPUs remembered before a sweep starts again from none (those that stopped reporting
# go then): more than one engine decides for, so a fleet's are kept from sweep to sweep.
MAX_QUIET_GPUS = 250_000


@dataclass(slots=True)
class Quiet:
    """What lets the generated code skip, for one GPU, the rules that read only fields
    that change on events, not every second (a reset, a link down, a power limit): most
    samples carry the same values as the last, on which every such rule was false.

    A condition is a function of the fields it reads, so with the same values it is
    false again. So `seen` keeps, per (node, gpu), the values of the quiet fields at the
    last sample on which all these rules were false; on a sample with the same values
    their conditions are not evaluated, and what a false sample does is done (a run
    ends, a fired key clears). A rule keyed by GPU, with `for` or no form, is skipped
    whole (`skips_whole`): a false sample does nothing to a GPU whose last one was false
    as well (its run had ended, its key was cleared then), and only that GPU's samples
    move its state, so the entry stands for "nothing held" until one is true; the entry
    is dropped before the rules are looked at, and kept again when all are false.
    """

    fields: frozenset[str]  # the fields that change on events (models.QUIET_FIELDS)
    seen: dict[Hashable, Any]  # (node, gpu) -> the quiet values of its last all-false sample
    most: int = MAX_QUIET_GPUS

    def forget(self) -> None:
        """Look at every GPU again on its next sample."""
        self.seen.clear()

    def trim(self) -> None:
        """Bound what is kept (a sweep): past `most` GPUs, start again from none."""
        if len(self.seen) > self.most:
            self.seen.clear()


def compile_kind(
    entries: list[Entry],
    make: MakeMatch,
    kind: str,
    cleared: list[Cleared] | None = None,
    quiet: Quiet | None = None,
) -> KindEval:
    """The evaluation function for every rule of one kind, rules in file order.

    Entries with a `fired` set also report, into `cleared`, the first false sample of
    each key that had fired (what ends an episode). With `quiet`, the entries that read
    only its fields are skipped for a GPU whose values did not change since a sample on
    which all of them were false.
    """
    lines = ["def _eval(f, t, eid, out):"]
    parts: dict[str, Any] = {}
    names: dict[str, Any] = {}
    calm = {i for i, e in enumerate(entries) if quiet is not None and is_quiet(e, quiet.fields)}
    whole = {i for i in calm if skips_whole(entries[i])}
    if not whole:
        # Remembering the values costs a lookup a GPU sample, which skipping conditions
        # alone does not pay for: six threshold rules grouped by node read 1.2% more
        # instructions a sample with it (gpuops bench instructions, 20 rules).
        calm = set()
    shared = _shares_gpu_key(entries, calm)
    if shared:
        lines.append(f'    {_GPU_KEY} = (f["node"], f.get("gpu"))')
    if calm and quiet is not None:
        read = sorted(set().union(*(fact_keys(entries[i].rule.expr) for i in calm)))
        # One C call reads them all; a fact without one of them (a test's, a bench's)
        # is evaluated and not remembered.
        names["_quiet_of"], names["_seen"] = operator.itemgetter(*read), quiet.seen
        names["_unread"], names["_KeyError"] = _UNREAD, KeyError
        lines += [
            "    try:",
            "        _qv = _quiet_of(f)",
            "    except _KeyError:",
            "        _qv = _unread",
            "    _skip = _seen.get(_gk, _unread) == _qv and _qv is not _unread",
            "    if not _skip:",
            "        _seen.pop(_gk, None)",  # until all are false again (a handler may raise)
            "    _qtrue = False",
        ]
    for i, e in enumerate(entries):
        rule, window, key = e.rule, e.window, e.key
        start = len(lines)
        if e.slow:
            names[f"_slow{i}"] = _slow(e, make, cleared)
            every = slow_cadence(rule) if e.agg is not None and e.agg_only else 0.0
            if every and e.agg is not None:
                lines += _between(i, e.agg, every, key, names, shared)
                continue
            lines.append(f"    _slow{i}(f, t, eid, out)")
            continue
        names[f"_hit{i}"] = _hit(e, make)
        watch = e.fired is not None and cleared is not None
        if watch:
            assert cleared is not None
            names[f"_fired{i}"], names[f"_clr{i}"] = e.fired, _clear(e, cleared)
        if rule.expr is None and isinstance(window, Increase) and e.field:
            # A counter that has not moved, with no rise in its window, stays quiet: only
            # its time is noted (what Increase.observe would do), without two calls.
            names[f"_fld{i}"], names[f"_last{i}"] = e.field, window.last
            names[f"_rises{i}"] = window.rises
            lines += [
                f"    _v = f.get(_fld{i})",
                "    if _v is not None:",
                f"        _k = {_key_src(i, key, names, shared)}",
                f"        _p = _last{i}.get(_k)",
                f"        if _p is not None and _v == _p[1] and t >= _p[0]"
                f" and not _rises{i}.get(_k):",
                f"            _last{i}[_k] = (t, _v)",
                "        else:",
                f"            _hit{i}(f, t, eid, out)",
            ]
            continue
        if rule.expr is None:
            lines.append(f"    _hit{i}(f, t, eid, out)")
            continue
        parts[f"_EXPR{i}"] = inline_bits(guard_nulls(rule.expr, f"_g{i}_"))
        lines += [
            "    try:",
            f"        _h = not _skip and _EXPR{i}"
            if i in calm - whole
            else f"        _h = _EXPR{i}",
            "    except _ERRS:",
            "        _h = False",
            "    if _h:",
            *(["        _qtrue = True"] if i in calm else []),
            f"        _hit{i}(f, t, eid, out)",
        ]
        if isinstance(window, HeldFor):
            # A false sample ends a run; only look the key up when some run is open.
            names[f"_state{i}"] = window.state
            lines += [
                f"    elif _state{i}:",
                f"        _k = {_key_src(i, key, names, shared)}",
                f"        _state{i}.pop(_k, None)",
            ]
            if watch:
                lines += [f"        if {_fired_src(i, e, '_k')}:", f"            _clr{i}(f, t)"]
        elif watch:
            lines += [
                f"    elif {_fired_src(i, e, _key_src(i, key, names, shared))}:",
                f"        _clr{i}(f, t)",
            ]
        if i in whole:
            # Under one `if not _skip:` with the rule just before, if it is skipped whole.
            joined = i - 1 in whole
            lines[start:] = [
                *([] if joined else ["    if not _skip:"]),
                *("    " + line for line in lines[start:]),
            ]
    if calm:
        lines += [
            "    if not _skip and not _qtrue and _qv is not _unread:",
            "        _seen[_gk] = _qv",
        ]
    if len(lines) == 1:
        lines.append("    return None")
    # The sandbox has no builtins: what the inline series code needs is given.
    names.update(_isfinite=math.isfinite, _number=is_number, _float=float, _int=int, _len=len)
    namespace = compile_sandboxed("\n".join(lines) + "\n", parts, names, f"<rules on {kind}>")
    evaluate: KindEval = namespace["_eval"]
    return evaluate
