"""Failure domains from the inventory: which rack, PDU, cooling loop, leaf switch and NVLink
domain each host is in.

A host names its domains in variables (`rack: a01`, `cooling_loop: cdu-2`), or by
membership of a group named for one (`rack_a01`, `cooling_loop-cdu-2`); a variable wins
over a group. Faults come in domains (a loop that loses flow heats every node on it), so
the decide stages budget per domain and the fabric test picks peers outside them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuops.inventory.hosts import Inventory
from gpuops.models import DOMAIN_KINDS

KINDS = DOMAIN_KINDS
# Hosts of this group are facility equipment (a CDU's or PDU's controller): the inventory
# knows them, so their readings are acted upon, but they are not capacity of a domain.
FACILITY = "facility"


def _from_group(group: str) -> tuple[str, str] | None:
    """(kind, group) for a group named `<kind>_<name>` or `<kind>-<name>`, else None."""
    for kind in KINDS:
        if group.startswith((f"{kind}_", f"{kind}-")) and len(group) > len(kind) + 1:
            return kind, group
    return None


@dataclass(frozen=True, slots=True)
class Domains:
    """Each host's domains (kind -> name) and each domain's hosts, read once."""

    by_node: Mapping[str, Mapping[str, str]]
    members: Mapping[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    # Inventory groups that hold exactly the hosts of the domain of their name: the
    # domain goes by the group's name (`cooling_loop_a`). One that holds other hosts (a
    # CDU's own controller in group `cdu-2`) must not take the domain's power budget.
    groups: frozenset[tuple[str, str]] = frozenset()  # (kind, name) of such domains

    @classmethod
    def of(cls, inventory: Inventory) -> Domains:
        """The domains `inventory` declares (none: an empty map, and nothing is budgeted)."""
        facility = inventory.groups.get(FACILITY, frozenset())
        found: dict[str, dict[str, str]] = defaultdict(dict)
        for group, hosts in inventory.groups.items():
            named = _from_group(group)
            if named is not None:
                for host in hosts:
                    found[host].setdefault(*named)
        for host, hostvars in inventory.hostvars.items():
            for kind in KINDS:
                value = hostvars.get(kind)
                if value not in (None, "") and host in inventory.hosts:
                    found[host][kind] = str(value)
        for host in facility:  # a CDU's BMC is in its loop, but no node the loop can lose
            found.pop(host, None)
        members: dict[tuple[str, str], set[str]] = defaultdict(set)
        for host, domains in found.items():
            for kind, name in domains.items():
                members[(kind, name)].add(host)
        return cls(
            by_node={h: dict(sorted(d.items())) for h, d in found.items()},
            members={k: frozenset(v) for k, v in members.items()},
            groups=frozenset(
                (kind, name)
                for (kind, name), hosts in members.items()
                if inventory.groups.get(name, frozenset()) - facility == hosts
            ),
        )

    def of_node(self, node: str) -> Mapping[str, str]:
        """The node's domains, kind -> name (empty when it declares none)."""
        return self.by_node.get(node, {})

    def size(self, kind: str, name: str) -> int:
        """How many hosts the domain has."""
        return len(self.members.get((kind, name), ()))

    def group(self, kind: str, name: str) -> str:
        """The group people and the power controller name the domain by: its inventory
        group where that group is the domain, else `kind:name` (`cooling_loop:cdu-2`)."""
        return name if (kind, name) in self.groups else f"{kind}:{name}"

    def as_groups(self) -> dict[str, frozenset[str]]:
        """Every domain as a group of hosts, by `group`'s name."""
        return {self.group(k, n): hosts for (k, n), hosts in self.members.items()}
