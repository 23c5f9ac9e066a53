"""Which inventory node a host name or address is, and whether a host name another
party wrote (an exporter's own label) names the same node.

Names compare as DNS does (no case, no trailing dot); a name or address is found
exactly, else by its short name (the first label): a short name matches a full one. A
spelling two nodes share finds neither: that would be a guess. Used by the scrape
sources' binding of series to targets (gpuops.sources.binding) and by the Alertmanager
receiver (gpuops.intake.alertmanager).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

from gpuops.inventory.hosts import Inventory
from gpuops.models import NODE_PATTERN_PY

_NODE = re.compile(NODE_PATTERN_PY)
# Claims remembered as agreeing or not; a hostile page can vary its claim per series.
MAX_CLAIMS = 4096


def _key(name: str) -> str:
    """Host names compare without case or a trailing dot (DNS's rules)."""
    return name.lower().rstrip(".")


def _short(name: str) -> str | None:
    """The first label of a DNS name; None for an IP address (its first octet names nothing)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name.split(".", 1)[0]
    return None


def _index(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """spelling -> node, without a spelling two nodes share: that would be a guess."""
    out: dict[str, str] = {}
    shared: set[str] = set()
    for spelling, node in pairs:
        if out.setdefault(spelling, node) != node:
            shared.add(spelling)
    return {k: v for k, v in out.items() if k not in shared}


class Targets:
    """Host names and addresses to inventory nodes, and whether a claim agrees."""

    def __init__(
        self, inventory: Inventory, node_label: str = "Hostname", target_label: str | None = None
    ) -> None:
        """`node_label`: the label that carries a claim (`agrees`); `target_label`: the
        label that names a target, where not `instance` (gpuops.sources.binding)."""
        self.node_label = node_label
        self.target_label = target_label
        self._spellings: dict[str, frozenset[str]] = {}
        exact: dict[str, set[str]] = {}
        for node in sorted(h for h in inventory.hosts if _NODE.match(h)):
            address = inventory.hostvars.get(node, {}).get("ansible_host")
            names = {_key(n) for n in (node, address) if isinstance(n, str) and n}
            exact[node] = names
            self._spellings[node] = frozenset(names | {_short(n) or n for n in names})
        # Exact names and addresses first: `gpu-1` is found even next to `gpu-1.lab`, whose
        # short spelling it shares (a shared spelling is no one's, so it must not hide it).
        full = _index((n, node) for node, names in exact.items() for n in names)
        loose = _index((n, node) for node, names in self._spellings.items() for n in names)
        self._full = loose | full
        shorts = ((_short(_key(node)) or node, node) for node in self._spellings)
        self._short = _index(shorts)
        self._agrees: dict[tuple[str, str], bool] = {}

    def node_of(self, host: str | None) -> str | None:
        """The inventory node a target's host (name or address) is, if exactly one."""
        if not host:
            return None
        key = _key(host)
        node = self._full.get(key)
        short = None if node else _short(key)
        return self._short.get(short) if short else node

    def agrees(self, node: str, labels: dict[str, str]) -> bool:
        """Whether the exporter's own host name label, if any, names `node` too."""
        claim = labels.get(self.node_label) if self.node_label else None
        if not claim or claim == node:
            return True
        known = self._agrees.get((node, claim))
        if known is None:
            if len(self._agrees) >= MAX_CLAIMS:
                self._agrees.clear()
            key, names = _key(claim), self._spellings.get(node, frozenset())
            known = key in names or (_short(key) or key) in names
            self._agrees[(node, claim)] = known
        return known
