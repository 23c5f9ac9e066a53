"""A failure domain goes by an inventory group's name only where that group is the domain."""

from __future__ import annotations

from pathlib import Path

from gpuops.inventory.domains import Domains
from gpuops.inventory.hosts import Inventory

NODES = ("n1", "n2", "n3", "n4")


def _inventory(groups: dict[str, frozenset[str]]) -> Inventory:
    hostvars = {n: {"cooling_loop": "cdu-2"} for n in NODES}
    return Inventory(Path("inv"), frozenset({*NODES, "cdu-2-bmc"}), groups, hostvars)


def test_a_group_that_holds_other_hosts_does_not_name_the_domain() -> None:
    """Review of issue 30: group `cdu-2` held the CDU's controller; the loop `cdu-2`'s
    episode put its power budget on that group, so the controller, not the loop's four
    nodes, was budgeted."""
    facility = frozenset({"cdu-2-bmc"})
    domains = Domains.of(_inventory({"facility": facility, "cdu-2": facility}))
    assert domains.group("cooling_loop", "cdu-2") == "cooling_loop:cdu-2"
    assert domains.as_groups() == {"cooling_loop:cdu-2": frozenset(NODES)}


def test_a_group_that_is_the_domain_names_it_its_facility_hosts_aside() -> None:
    facility = frozenset({"cdu-2-bmc"})
    loop = frozenset({*NODES, "cdu-2-bmc"})  # the loop's nodes and the CDU's controller
    domains = Domains.of(_inventory({"facility": facility, "cdu-2": loop}))
    assert domains.group("cooling_loop", "cdu-2") == "cdu-2"
    assert domains.as_groups() == {"cdu-2": frozenset(NODES)}


def test_a_group_that_is_one_kinds_domain_names_no_other_kinds() -> None:
    """Rack `a` is exactly group `a`; cooling loop `a`, on other hosts too, is not."""
    hostvars = {n: {"rack": "a", "cooling_loop": "a"} for n in NODES[:2]}
    hostvars |= {n: {"rack": "b", "cooling_loop": "a"} for n in NODES[2:]}
    inventory = Inventory(Path("inv"), frozenset(NODES), {"a": frozenset(NODES[:2])}, hostvars)
    domains = Domains.of(inventory)
    assert domains.group("rack", "a") == "a"
    assert domains.group("cooling_loop", "a") == "cooling_loop:a"
    assert domains.as_groups()["cooling_loop:a"] == frozenset(NODES)
