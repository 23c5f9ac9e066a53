"""Aggregates in conditions: window functions over a key's samples, and group aggregates.

`p95(util_gpu, 24h)` reads the key's samples of a field over a window; `sum(power_w)`
(no window) reads the latest value of each member of a group (a rack's GPUs). Exact
semantics and error bounds are in docs/rules.md (Aggregates); the property tests hold
this module to a brute-force reference over the raw samples.

Long windows keep bounded state: a window is `BUCKETS` aligned time buckets, each with
count, sum, min and max, and, for quantiles, a `BINS`-bin histogram on a grid shared by
the key's buckets (bin width a power of two, widened when a value does not fit), so a
day over 10,000 GPUs costs a few kilobytes per GPU whatever the sample rate.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from itertools import accumulate, compress
from typing import Any, TypeGuard

BUCKETS = 32  # time buckets per window: the window is W - W/32 to W long
BINS = 32  # histogram bins per quantile series: error <= value spread / (BINS - 2)
MIN_EXP = -20  # the finest bin width, 2**-20: values closer than this are one value
MAX_WINDOW_S = 7 * 86400.0  # longer windows would make a bucket coarser than an hour
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
FUNCTIONS = ("sum", "avg", "min", "max", "count", *QUANTILES)
_U16 = 0xFFFF
# Samples of the head bucket a series holds as a list before putting them into its
# arrays (`Series.add`): a bound on the list, where nothing reads the series sooner.
HELD = 64
# The share of a bucket's width at each end whose samples take the exact way (t / width
# rounds): a sample further inside is in the head bucket without computing it.
_EDGE = 1e-4
_FEW = 8  # held values binned one by one, not counted first (`_put`)
_SUMS = BUCKETS * BINS  # where a quantile series' row of bin sums starts
_COUNTS = array("I", bytes(4 * BUCKETS))
_FLOATS = array("d", bytes(8 * BUCKETS))
# Quantiles only: BUCKETS rows of BINS counts, then one row of their sums.
_HIST = array("H", bytes(2 * BINS * (BUCKETS + 1)))


@dataclass(frozen=True, slots=True)
class Aggregate:
    """One aggregate call of a condition: `fn(field, window)` or `fn(field)` over a group."""

    fn: str
    field: str
    window_s: float | None  # None: over the group's members' latest values
    name: str  # the call as written, normalised: the fact key its value is read from


class Series:
    """One key's samples of one field over a window, in `BUCKETS` aligned buckets.

    A sample at time s lies in bucket floor(s / width), width = window / BUCKETS; the
    window is the `BUCKETS` buckets that end with the newest one (`head`).

    A sample `add` finds well inside the head bucket (the usual one: a long window's
    bucket spans many samples) is appended to `held`, and the held go into the arrays together
    (`_settle`) before anything reads them or another bucket takes a sample: a list
    append where putting one sample into five arrays took a tenth of a rule's time per
    GPU sample (callgrind: 10,000 instructions an add), and past `_FEW` held, equal
    values (the usual run of an integer percentage) are binned once.
    """

    __slots__ = (
        "base",
        "count",
        "exp",
        "head",
        "held",
        "hi",
        "hist",
        "inside",
        "lo",
        "n",
        "total",
        "until",
        "width",
        "window",
    )

    def __init__(self, window: float, quantiles: bool) -> None:
        self.window = window
        self.width = window / BUCKETS
        self.head: int | None = None
        self.n = 0  # samples in the window
        # Copies of zeroed arrays (a slice is one copy; from bytes, two allocations): a
        # replay of a short recording makes a series for every GPU it meets.
        self.count = _COUNTS[:]
        self.total = _FLOATS[:]
        self.lo = _FLOATS[:]
        self.hi = _FLOATS[:]
        self.hist: array[int] | None = _HIST[:] if quantiles else None
        self.exp: int | None = None  # bin width 2**exp; None until a value arrives
        self.base = 0  # absolute bin index of the first bin
        self.held: list[float] = []  # samples of the head bucket not in the arrays yet
        # The times surely in the head bucket: from `inside` to before `until` (none
        # until a sample makes a head).
        self.inside, self.until = math.inf, -math.inf

    def add(self, t: float, value: float) -> None:
        """Take one sample, held when it lies well inside the head bucket (`take` for a
        key read right after). The generated code of a rule read at a cadence does the
        first step inline (codegen._between): keep them alike."""
        if self.inside <= t < self.until:
            held = self.held
            held.append(value)
            if len(held) >= HELD:
                self._settle()
            return
        self.take(t, value)

    def take(self, t: float, value: float) -> None:
        """Take one sample into the arrays now, after those held (a key whose value is
        read on every sample has nothing to hold); one older than the window that ends
        at `head` is dropped."""
        if self.held:
            self._settle()
        b = math.floor(t / self.width)
        head = self.head
        if head is None or b > head:
            self._advance(b)
        elif b <= head - BUCKETS:
            return
        self._put_one(b % BUCKETS, value)

    def _advance(self, b: int) -> None:
        """Make `b` the head bucket, emptying the buckets that fall out of the window."""
        head = self.head
        gone = (
            range(b - BUCKETS + 1, b + 1)
            if head is None or b - head >= BUCKETS
            else range(head + 1, b + 1)
        )
        if self.n:  # none held (a new series): every bucket is empty already
            for old in gone:
                self._clear(old % BUCKETS)
        self.head = b
        self.inside, self.until = self._surely_in(b)
        if self.hist is not None and not self.n:
            self.exp = None  # nothing held: the next values choose a fine grid again

    def _surely_in(self, b: int) -> tuple[float, float]:
        """Times from the first to before the second surely in bucket `b`: floor(t /
        width) never decreases as t grows, so both ends in `b` put all between in it
        (a bucket too narrow for the margin has none: every sample takes the exact way)."""
        inside, until = (b + _EDGE) * self.width, (b + 1 - _EDGE) * self.width
        last = math.nextafter(until, -math.inf)
        if math.floor(inside / self.width) != b or math.floor(last / self.width) != b:
            return math.inf, -math.inf
        return inside, until

    def _settle(self) -> None:
        """Put the held samples into the head bucket's arrays."""
        held = self.held
        if not held:
            return
        assert self.head is not None
        if len(held) == 1:
            self._put_one(self.head % BUCKETS, held[0])
        else:
            self._put(self.head % BUCKETS, held)
        held.clear()

    def _put_one(self, slot: int, value: float) -> None:
        """One sample into its bucket's arrays (`_put` of one, without its lists)."""
        n = self.count[slot]
        if n == 0:
            self.lo[slot] = self.hi[slot] = value
        elif value < self.lo[slot]:
            self.lo[slot] = value
        elif value > self.hi[slot]:
            self.hi[slot] = value
        self.count[slot] = n + 1
        self.n += 1
        self.total[slot] += value
        hist = self.hist
        if hist is None:
            return
        # The usual sample (a grid chosen, the value on it, counters with room) is two
        # increments here; anything else is `_bin`'s.
        if self.exp is not None:
            j = math.floor(math.ldexp(value, -self.exp)) - self.base
            if 0 <= j < BINS:
                at, total = slot * BINS + j, _SUMS + j
                if hist.typecode == "I" or (hist[at] < _U16 and hist[total] < _U16):
                    hist[at] += 1
                    hist[total] += 1
                    return
        self._bin(slot, value)

    def _put(self, slot: int, values: list[float]) -> None:
        """Samples of one bucket into its count, sum, least and greatest, and histogram
        (past `_FEW` of them, each distinct value binned once)."""
        k = len(values)
        low, high = min(values), max(values)
        if self.count[slot] == 0:
            self.lo[slot], self.hi[slot] = low, high
        else:
            self.lo[slot] = min(self.lo[slot], low)
            self.hi[slot] = max(self.hi[slot], high)
        self.count[slot] += k
        self.n += k
        self.total[slot] = sum(values, self.total[slot])
        if self.hist is not None:
            # A few held values (a key sampled slowly, read once a minute) are binned one
            # by one: the Counter costs more than it saves below about eight.
            counted = Counter(values).items() if k > _FEW else ((v, 1) for v in values)
            for value, times in counted:
                self._bin(slot, value, times)

    def _clear(self, slot: int) -> None:
        if not self.count[slot]:
            return
        self.n -= self.count[slot]
        self.count[slot] = 0
        self.total[slot] = 0.0
        hist = self.hist
        if hist is not None:
            row, sums = slot * BINS, BUCKETS * BINS
            for i in range(BINS):
                if hist[row + i]:
                    hist[sums + i] -= hist[row + i]
                    hist[row + i] = 0

    def _bin(self, slot: int, value: float, times: int = 1) -> None:
        if self.exp is None:
            self.exp = MIN_EXP
            self.base = math.floor(math.ldexp(value, -MIN_EXP)) - BINS // 2
        j = math.floor(math.ldexp(value, -self.exp))
        if not self.base <= j < self.base + BINS:
            j = self._regrid(j)
        hist = self.hist
        assert hist is not None
        for at in (slot * BINS + j - self.base, BUCKETS * BINS + j - self.base):
            if hist[at] + times > _U16 and hist.typecode == "H":
                self.hist = hist = array("I", hist)  # a crowded key: wider counters
            hist[at] += times

    def _regrid(self, j: int) -> int:
        """Shift and, if needed, widen the grid so bin `j` fits; returns j on the new grid."""
        hist = self.hist
        assert hist is not None and self.exp is not None
        sums = BUCKETS * BINS
        used = [i for i in range(BINS) if hist[sums + i]]
        lo = min(j, self.base + used[0]) if used else j
        hi = max(j, self.base + used[-1]) if used else j
        d = 0
        while (hi >> d) - (lo >> d) >= BINS:
            d += 1
        base = (lo >> d) if d or j < self.base else (hi >> d) - BINS + 1
        old, old_base = hist, self.base
        code = "I" if sum(old[sums:]) > _U16 else old.typecode  # merged bins add up
        new = array(code, bytes(array(code).itemsize * len(old)))
        for r in [r for r in range(BUCKETS) if self.count[r]] + [BUCKETS]:
            row = r * BINS
            for i in range(BINS):
                if old[row + i]:
                    new[row + ((old_base + i) >> d) - base] += old[row + i]
        self.hist, self.exp, self.base = new, self.exp + d, base
        return j >> d

    def value(self, fn: str) -> float | None:
        """`fn` over the window; None when the window holds no sample."""
        if self.held:
            self._settle()
        n = self.n
        if not n:
            return None
        if fn == "count":
            return float(n)
        if fn == "sum" or fn == "avg":
            total = math.fsum(self.total)  # empty buckets hold 0.0
            return total if fn == "sum" else total / n
        low = min(compress(self.lo, self.count))
        high = max(compress(self.hi, self.count))
        if fn == "min":
            return low
        if fn == "max":
            return high
        return min(high, max(low, self._quantile(QUANTILES[fn])))

    def _quantile(self, q: float) -> float:
        """The nearest-rank q-quantile of the bins: the midpoint of the bin holding it."""
        hist = self.hist
        assert hist is not None and self.exp is not None
        rank = max(1, math.ceil(q * self.n))
        cumulative = list(accumulate(hist[BUCKETS * BINS :]))
        i = min(bisect_left(cumulative, rank), BINS - 1)
        return math.ldexp(self.base + i + 0.5, self.exp)

    @property
    def bin_width(self) -> float:
        """The histogram's bin width now (a quantile is within half of it)."""
        self._settle()
        return 0.0 if self.exp is None else math.ldexp(1.0, self.exp)

    def nbytes(self) -> int:
        """Bytes held by the arrays and the held samples (the per-key cost the bench
        reports; the list at its bound, as it is between two looks of a cadence rule,
        each sample a pointer and the float it keeps alive: an upper bound for a key
        read on every sample, which holds none)."""
        held = self.count.itemsize * len(self.count) + 3 * 8 * BUCKETS + (8 + 24) * HELD
        return held + (0 if self.hist is None else self.hist.itemsize * len(self.hist))


def group_value(fn: str, values: list[float]) -> float | None:
    """`fn` over the members' latest values (exact); None when no member counts."""
    if not values:
        return None
    if fn == "count":
        return float(len(values))
    if fn == "sum":
        return math.fsum(values)
    if fn == "avg":
        return math.fsum(values) / len(values)
    if fn == "min":
        return min(values)
    if fn == "max":
        return max(values)
    ordered = sorted(values)
    return ordered[max(1, math.ceil(QUANTILES[fn] * len(ordered))) - 1]


class KeyState:
    """What one group key holds: its newest time, its members' latest values, its series."""

    __slots__ = ("evaluated", "members", "newest", "series")

    def __init__(self, series: list[Series]) -> None:
        self.newest = -math.inf
        self.evaluated = -math.inf  # event time the rule last looked at this key
        self.members: dict[Hashable, tuple[float, tuple[Any, ...]]] = {}
        self.series = series


class Aggregates:
    """The aggregate state of one rule, per group key.

    `per_member`: the key is one member (a GPU, or a node for kinds without GPUs), so a
    sample older than the key's newest is late; otherwise members are tracked in the key
    (a rack's GPUs) and lateness is per member.
    """

    __slots__ = (
        "aggs",
        "group_fields",
        "keys",
        "max_gap",
        "per_member",
        "series_fields",
        "series_of",
        "series_specs",
    )

    def __init__(self, aggs: tuple[Aggregate, ...], per_member: bool, max_gap: float) -> None:
        self.aggs = aggs
        self.per_member = per_member
        self.max_gap = max_gap
        self.keys: dict[Hashable, KeyState] = {}
        specs: dict[tuple[str, float], bool] = {}
        for a in aggs:
            if a.window_s is not None:
                spec = (a.field, a.window_s)
                specs[spec] = specs.get(spec, False) or a.fn in QUANTILES
        self.series_specs = tuple(specs.items())
        self.series_fields = tuple(field for (field, _), _ in self.series_specs)
        order = [spec for spec, _ in self.series_specs]
        self.group_fields = tuple(dict.fromkeys(a.field for a in aggs if a.window_s is None))
        # Per aggregate: its series' index, or -1 - its index in the members' values.
        self.series_of = tuple(
            order.index((a.field, a.window_s))
            if a.window_s is not None
            else -1 - self.group_fields.index(a.field)
            for a in aggs
        )

    def between(self, key: Hashable, t: float, every: float, fact: Mapping[str, Any]) -> bool:
        """For a rule evaluated at most once per `every` seconds of a key's event time: if
        the key was evaluated less than `every` ago, take the sample into the series only
        and say so (True); else the caller evaluates it now (False). The generated code
        of such a rule does the first part inline (codegen._between): keep them alike."""
        state = self.keys.get(key)
        if state is None or not state.evaluated <= t < state.evaluated + every:
            if state is not None and t >= state.evaluated:
                state.evaluated = t
            return False
        for field, one in zip(self.series_fields, state.series, strict=False):  # built alike
            v = fact.get(field)
            if (v.__class__ is float and math.isfinite(v)) or v.__class__ is int or is_number(v):
                one.add(t, v)
        return True

    def observe(
        self, key: Hashable, member: Hashable, t: float, fact: dict[str, Any]
    ) -> float | None:
        """Take the sample; write each aggregate's value into `fact` under its name.

        Returns the time the key's temporal form sees (the group's newest, so members
        a few milliseconds apart do not look out of order), or None for a late sample
        (kept in its bucket, never evaluated).
        """
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = KeyState([Series(w, q) for (_, w), q in self.series_specs])
            state.evaluated = t
        late = t < state.newest if self.per_member else self._late(state, member, t, fact)
        for field, one in zip(self.series_fields, state.series, strict=True):
            v = fact.get(field)
            if is_number(v):
                one.take(t, v)  # read just below: nothing to hold it for
        if late:
            return None
        state.newest = max(state.newest, t)
        self._write(state, t, fact)
        return state.newest

    def _late(self, state: KeyState, member: Hashable, t: float, fact: Mapping[str, Any]) -> bool:
        prev = state.members.get(member)
        if prev is not None and t < prev[0]:
            return True
        state.members[member] = (t, tuple(fact.get(f) for f in self.group_fields))
        return False

    def _write(self, state: KeyState, t: float, fact: dict[str, Any]) -> None:
        fresh: list[tuple[Any, ...]] | None = None
        for a, at in zip(self.aggs, self.series_of, strict=True):
            if at >= 0:
                fact[a.name] = state.series[at].value(a.fn)
                continue
            if fresh is None:
                fresh = [v for tm, v in state.members.values() if t - tm <= self.max_gap]
            i = -1 - at
            values = [float(v[i]) for v in fresh if is_number(v[i])]
            fact[a.name] = group_value(a.fn, values)

    def longest(self) -> float:
        """The longest time a key's state matters: its longest window, or max_gap."""
        return max([w for (_, w), _ in self.series_specs] + [self.max_gap])

    def sweep(self, at: float) -> int:
        """Forget keys whose newest sample is older than `at` minus the longest window."""
        span = self.longest()
        stale = [k for k, s in self.keys.items() if s.newest < at - span]
        for k in stale:
            del self.keys[k]
        for s in self.keys.values():
            gone = [m for m, (tm, _) in s.members.items() if tm < at - self.max_gap]
            for m in gone:
                del s.members[m]
        return len(stale)

    def nbytes(self) -> int:
        """Bytes of the series arrays of every key."""
        return sum(s.nbytes() for k in self.keys.values() for s in k.series)

    def __len__(self) -> int:
        return len(self.keys)


def is_number(v: Any) -> TypeGuard[float]:
    """A finite number, not a bool: what a series takes (anything else is left out)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
