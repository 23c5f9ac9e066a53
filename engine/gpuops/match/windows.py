"""Temporal forms, one small state machine per rule, keyed by the rule's group key.

Times are the event's own timestamps (epoch seconds), so live runs and replays of
recorded events give the same answers; only `absent` also needs the clock, to notice
silence. Exact semantics are in docs/rules.md; the property tests hold them to a
brute-force reference.

State is per key and only that key's own events move it: `sweep(now)` compares each
key's own newest time with `now`, so no event of one key (a future-dated one included)
can expire or freeze another key's windows. An event older than the key's newest one
(a redelivery, a late spool flush) is handled explicitly by each form below.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from collections.abc import Hashable
from typing import Protocol

from gpuops.clock import Clock

Key = Hashable


class Window(Protocol):
    """Per-key state of one temporal form."""

    def observe(self, key: Key, t: float, hit: bool, value: float | None = None) -> bool:
        """Feed one event for `key`; True when the rule fires on it."""
        ...

    def sweep(self, now: float) -> int:
        """Forget keys that went quiet; returns how many were dropped."""
        ...

    def __len__(self) -> int: ...


class Instant:
    """No temporal form: fires on every event whose condition holds."""

    def observe(self, key: Key, t: float, hit: bool, value: float | None = None) -> bool:
        return hit

    def sweep(self, now: float) -> int:
        return 0

    def __len__(self) -> int:
        return 0


class HeldFor:
    """`for: D`: the condition held on every sample of the key for at least D.

    A false sample resets the run; so does a gap between samples longer than
    `max_gap` (a silent agent does not prove the condition held). The run's start is
    the first true sample, so a sample at start + D fires.
    """

    __slots__ = ("duration", "max_gap", "state")

    def __init__(self, duration: float, max_gap: float) -> None:
        self.duration = duration
        self.max_gap = max_gap
        self.state: dict[Key, list[float]] = {}  # key -> [start, last]

    def observe(self, key: Key, t: float, hit: bool, value: float | None = None) -> bool:
        state = self.state
        if not hit:
            if state:
                state.pop(key, None)
            return False
        run = state.get(key)
        if run is None or t - run[1] > self.max_gap or t < run[1]:
            state[key] = [t, t]
            return self.duration <= 0
        run[1] = t
        return t - run[0] >= self.duration

    def sweep(self, now: float) -> int:
        stale = [k for k, (_, last) in self.state.items() if now - last > self.max_gap]
        for k in stale:
            del self.state[k]
        return len(stale)

    def __len__(self) -> int:
        return len(self.state)


class CountWithin:
    """`count: N within: W`: at least N matching events in the window (t - W, t]."""

    __slots__ = ("n", "state", "within")

    def __init__(self, n: int, within: float) -> None:
        self.n = n
        self.within = within
        self.state: dict[Key, deque[float]] = {}

    def observe(self, key: Key, t: float, hit: bool, value: float | None = None) -> bool:
        if not hit:
            return False
        times = self.state.get(key)
        if times is None:
            times = self.state[key] = deque()
        if times and t < times[-1]:
            return self._late(times, t)
        times.append(t)
        cutoff = t - self.within
        while times and times[0] <= cutoff:
            times.popleft()
        return len(times) >= self.n

    def _late(self, times: deque[float], t: float) -> bool:
        """An event older than the key's newest: kept in order, counted over (t - W, t] only.

        Appending it would leave the times unsorted, and the expiry above (which stops
        at the first unexpired time) would then keep stale times and count too many.
        """
        insort(times, t)
        cutoff = t - self.within
        while times and times[0] <= cutoff:
            times.popleft()
        return bisect_right(times, t) >= self.n

    def sweep(self, now: float) -> int:
        stale = [k for k, q in self.state.items() if not q or q[-1] <= now - self.within]
        for k in stale:
            del self.state[k]
        return len(stale)

    def __len__(self) -> int:
        return len(self.state)


class Increase:
    """`increase: {field, by, within}`: the counter rose by at least `by` in (t - W, t].

    Only rises are stored, so memory grows with changes, not samples. A value below
    the previous one is a counter reset (driver reload, reboot): the new value itself
    counts as the rise since the reset, as Prometheus's increase() does. A sample older
    than the key's newest one is ignored.
    """

    __slots__ = ("by", "last", "rises", "within")
    # gpuops.match.codegen reads `last` and `rises` for a counter that has not moved
    # (noted inline, without a call): keep what they mean in step with `observe`.

    def __init__(self, by: float, within: float) -> None:
        self.by = by
        self.within = within
        self.last: dict[Key, tuple[float, float]] = {}  # key -> (t, value)
        self.rises: dict[Key, deque[tuple[float, float]]] = {}

    def observe(self, key: Key, t: float, hit: bool, value: float | None = None) -> bool:
        if not hit or value is None:
            return False
        prev = self.last.get(key)
        if prev is not None and t < prev[0]:
            # Older than the newest sample: its value is not "after" the newest one, and
            # taking it as such would read a counter going back as a reset (a false rise).
            return False
        self.last[key] = (t, value)
        if prev is None:
            return False
        rise = value - prev[1] if value >= prev[1] else value
        rises = self.rises.get(key)
        if rise > 0:
            if rises is None:
                rises = self.rises[key] = deque()
            rises.append((t, rise))
        if not rises:
            return False
        cutoff = t - self.within
        while rises and rises[0][0] <= cutoff:
            rises.popleft()
        return sum(r for _, r in rises) >= self.by

    def sweep(self, now: float) -> int:
        stale = [k for k, (t, _) in self.last.items() if now - t > self.within]
        for k in stale:
            del self.last[k]
            self.rises.pop(k, None)
        return len(stale)

    def __len__(self) -> int:
        return len(self.last)


class Absent:
    """`absent: D`: no matching event for the key for longer than D (a deadman).

    Keys are learned from events, or seeded (from the inventory) so a node that
    never reported is noticed too. `due(now)` fires once per silence; the next event
    for the key re-arms it. With a clock, an event dated after the clock's now counts
    as arriving now: a node's own future-dated heartbeat must not push its deadline
    into the future (which would switch its deadman off).
    """

    __slots__ = ("after", "clock", "fired", "last")

    def __init__(self, after: float, clock: Clock | None = None) -> None:
        self.after = after
        self.clock = clock
        self.last: dict[Key, float] = {}
        self.fired: set[Key] = set()

    def observe(self, key: Key, t: float, hit: bool, value: float | None = None) -> bool:
        if not hit:
            return False
        if self.clock is not None:
            t = min(t, self.clock.now())
        if t >= self.last.get(key, float("-inf")):
            self.last[key] = t
            self.fired.discard(key)
        return False

    def seed(self, key: Key, t: float) -> None:
        """Expect `key` from time `t` even if it never reports."""
        self.last.setdefault(key, t)

    def due(self, now: float) -> list[Key]:
        """Keys silent for longer than the limit that have not fired yet."""
        out = [k for k, t in self.last.items() if now - t > self.after and k not in self.fired]
        self.fired.update(out)
        return out

    def sweep(self, now: float) -> int:
        # A key that fired stays quiet until its next event, which re-learns it; keeping
        # it would only grow memory with every name that reported once (unknown hosts).
        for k in self.fired:
            del self.last[k]
        dropped = len(self.fired)
        self.fired.clear()
        return dropped

    def __len__(self) -> int:
        return len(self.last)
