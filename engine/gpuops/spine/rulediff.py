"""Two rule sets on one recording: what the engine would do differently, node by node.

Both replays run the live engine under the same settings and inventory; what is compared
is what it would do: every action, and every escalation (once per fold, at its first
time). An item in both at the same time is unchanged; what is left of one rule's items on
one node (and GPUs) is paired in time order as `changed` (another playbook, another
time); the rest is `added` (only the new rules would) or `removed` (only the old ones).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from enum import StrEnum

from gpuops.clock import rfc3339
from gpuops.spine.report import Report, Trip
from gpuops.spine.shadow import WouldRun


class Change(StrEnum):
    """How one item differs."""

    ADDED = "added"
    REMOVED = "removed"
    CHANGED = "changed"


class FailOn(StrEnum):
    """What makes `replay --against` exit non-zero (a site's CI gate)."""

    # The new rules would run something the old would not, or trip the breaker where the
    # old would not have (a trip stops every automated remediation until a person resets it).
    NEW_ACTIONS = "new-actions"
    ANY_CHANGE = "any-change"  # anything differs, the breaker's trips included


@dataclass(frozen=True, slots=True)
class Difference:
    """One item of the diff: what the old rules would do (`base`), and the new (`head`)."""

    change: Change
    base: WouldRun | None
    head: WouldRun | None

    @property
    def node(self) -> str:
        """The node it is about."""
        return (self.head or self.base or _NOWHERE).node

    @property
    def new_action(self) -> bool:
        """Whether the new rules run a playbook (or tell a person) the old would not."""
        if self.change is Change.ADDED:
            return True
        return self.change is Change.CHANGED and _what(self.base) != _what(self.head)

    def as_dict(self) -> dict[str, object]:
        """The `--json` line."""
        return {
            "kind": self.change.value,
            "node": self.node,
            "base": None if self.base is None else self.base.as_dict(),
            "head": None if self.head is None else self.head.as_dict(),
        }


_NOWHERE = WouldRun("", "", None, "", 0.0, False)


@dataclass(frozen=True, slots=True)
class RuleDiff:
    """The differences, in node and time order, and each side's breaker trips."""

    differences: tuple[Difference, ...]
    base_trips: tuple[Trip, ...]
    head_trips: tuple[Trip, ...]

    @property
    def new_trips(self) -> list[Trip]:
        """Trips under the new rules that the old ones did not have (then, for that)."""
        return [t for t in self.head_trips if t not in self.base_trips]

    def fails(self, on: FailOn) -> bool:
        """Whether the condition a CI gate names holds."""
        if on is FailOn.NEW_ACTIONS:
            return any(d.new_action for d in self.differences) or bool(self.new_trips)
        return bool(self.differences) or self.base_trips != self.head_trips

    def counts(self) -> Counter[str]:
        """Differences by kind."""
        return Counter(d.change.value for d in self.differences)


def would_do(report: Report) -> list[WouldRun]:
    """What a replay says the engine would do: its actions and, once each, its escalations."""
    people = [
        WouldRun(f.rule, f.node, f.gpu, "needs-human", f.first, False, f.gpus)
        for f in report.escalations
    ]
    return sorted([*report.actions, *people], key=lambda a: a.ts)


def diff(base: Report, head: Report) -> RuleDiff:
    """What `head`'s rules would do that `base`'s would not, and the other way round."""
    old, new = Counter(would_do(base)), Counter(would_do(head))
    gone, came = _by_key(old - new), _by_key(new - old)
    out: list[Difference] = []
    for key in sorted(set(gone) | set(came)):
        before, after = gone.get(key, []), came.get(key, [])
        pairs = min(len(before), len(after))
        out += [Difference(Change.CHANGED, b, a) for b, a in zip(before, after, strict=False)]
        out += [Difference(Change.REMOVED, b, None) for b in before[pairs:]]
        out += [Difference(Change.ADDED, None, a) for a in after[pairs:]]
    out.sort(key=lambda d: (d.node, _when(d)))
    return RuleDiff(tuple(out), tuple(base.trips), tuple(head.trips))


def _by_key(items: Counter[WouldRun]) -> dict[tuple[str, str, tuple[int, ...]], list[WouldRun]]:
    """Items by node, rule and GPUs, each list in time order."""
    out: dict[tuple[str, str, tuple[int, ...]], list[WouldRun]] = defaultdict(list)
    for item in sorted(items.elements(), key=lambda a: a.ts):
        out[item.node, item.rule, item.gpus].append(item)
    return out


def _what(item: WouldRun | None) -> str:
    return "" if item is None else item.action


def _when(d: Difference) -> float:
    return min(x.ts for x in (d.base, d.head) if x is not None)


def describe(item: WouldRun) -> str:
    """One item as a diff line shows it: time, rule, GPUs, what."""
    gpus = f" gpu {','.join(map(str, item.gpus))}" if item.gpus else ""
    dry = " (dry-run rule)" if item.dry_run else ""
    return f"{rfc3339(item.ts)} {item.rule}{gpus}: {item.action}{dry}"
