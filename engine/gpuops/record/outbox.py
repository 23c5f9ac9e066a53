"""Grouped notifications, Alertmanager's way: wait a little, send one message per group.

A storm of one fault on 50 nodes is one message naming them, not 50. Notes are grouped
by topic and rule; the first of a group waits `group_wait_s` for others to join, later
ones go out at most every `group_interval_s`. When one flush would name more than
`storm_nodes` nodes across groups, a single fleet-wide message replaces them. A GPU-level
note on a node that has a node-level episode open is inhibited (the node-level one says
what matters: the node is being rebooted or drained), unless it hands the GPU to a person.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuops.record.notify import Notifier

NAMES_SHOWN = 8
# Room for names in one message (the Notifier caps a message at 3,500 characters): 2,000
# nodes' names were 96,117 characters, past what Slack and Mattermost take.
NAMES_CHARS = 3000
NAMED_IN_STORMS = frozenset({"needs-human"})
# Never inhibited: the node-level episode that inhibits may take no action at all (a
# drift waiting for approval), and a person must act on the GPU whatever else is open.
NEVER_INHIBITED = frozenset({"needs-human"})


@dataclass(frozen=True, slots=True)
class Tell:
    """One thing a person should hear about."""

    topic: str  # needs-human, incident, resolved, run failed
    rule: str
    node: str
    level: str  # gpu or node
    text: str
    episode: str = ""


@dataclass(frozen=True, slots=True)
class Grouping:
    """The outbox's timings (settings.notifications)."""

    group_wait_s: float = 10.0
    group_interval_s: float = 60.0
    storm_nodes: int = 10


@dataclass
class _Group:
    tells: list[Tell] = field(default_factory=list)
    since: float = 0.0  # when the first pending note arrived
    sent: float = float("-inf")


class Outbox:
    """Collects notes and sends them grouped on `flush`."""

    def __init__(
        self,
        notifier: Notifier,
        grouping: Grouping | None = None,
    ) -> None:
        self.notifier = notifier
        self.grouping = grouping or Grouping()
        self.groups: dict[tuple[str, str], _Group] = {}
        self.inhibited = 0

    def add(self, tell: Tell, now: float) -> None:
        """Queue a note for its group."""
        group = self.groups.setdefault((tell.topic, tell.rule), _Group())
        if not group.tells:
            group.since = now
        group.tells.append(tell)

    def flush(
        self, now: float, force: bool = False, inhibited: Callable[[], set[str]] = set
    ) -> int:
        """Send every group that is due (`force`: every group); how many messages went out.

        `inhibited` names the nodes whose GPU-level notes a node-level episode holds back
        (asked only when something is due: the episodes, which tell through this box)."""
        g = self.grouping
        due = [
            (key, grp)
            for key, grp in self.groups.items()
            if grp.tells
            and (
                force
                or (now - grp.since >= g.group_wait_s and now - grp.sent >= g.group_interval_s)
            )
        ]
        if not due:
            return 0
        node_level = inhibited()
        batches: list[tuple[tuple[str, str], list[Tell]]] = []
        for key, grp in due:
            kept = [t for t in grp.tells if not _inhibited(t, node_level)]
            self.inhibited += len(grp.tells) - len(kept)
            grp.tells, grp.sent = [], now
            if kept:
                batches.append((key, kept))
        # Escalations keep their names even in a storm: a person must know which nodes.
        named = [b for b in batches if b[0][0] in NAMED_IN_STORMS]
        rest = [b for b in batches if b[0][0] not in NAMED_IN_STORMS]
        nodes = {t.node for _, tells in rest for t in tells}
        sent = 0
        if len(nodes) > g.storm_nodes:
            self._storm(rest, len(nodes))
            rest, sent = [], 1
        for (topic, rule), tells in named + rest:
            names = topic in NAMED_IN_STORMS
            self.notifier.notify(topic, _group_text(rule, tells, all_names=names))
            sent += 1
        return sent

    def _storm(self, batches: list[tuple[tuple[str, str], list[Tell]]], nodes: int) -> None:
        counts = Counter(f"{topic} {rule}" for (topic, rule), tells in batches for _ in tells)
        parts = ", ".join(f"{what} x{n}" for what, n in counts.most_common())
        self.notifier.notify("storm", f"{sum(counts.values())} notes on {nodes} nodes: {parts}")


def _inhibited(tell: Tell, node_level: set[str]) -> bool:
    return tell.level == "gpu" and tell.node in node_level and tell.topic not in NEVER_INHIBITED


def _group_text(rule: str, tells: list[Tell], all_names: bool = False) -> str:
    if len(tells) == 1:
        t = tells[0]
        text = t.text if t.node in t.text else f"{t.node}: {t.text}"
        return f"{text} [{t.episode}]" if t.episode else text
    names = sorted({t.node for t in tells})
    return f"{rule} on {len(names)} nodes ({_names(names, all_names)}): {tells[0].text}"


def _names(names: list[str], all_names: bool) -> str:
    """The names that fit; those left out counted where every one matters."""
    limit = len(names) if all_names else NAMES_SHOWN
    shown: list[str] = []
    room = NAMES_CHARS
    for name in names[:limit]:
        room -= len(name) + 2
        if room < 0:
            break
        shown.append(name)
    left = len(names) - len(shown)
    if not left:
        return ", ".join(shown)
    if not all_names:
        return ", ".join(shown) + " ..."
    return ", ".join(shown) + f" and {left:,} more: `gpuops status` names them"
