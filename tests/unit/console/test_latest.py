"""The heatmap's memory: bounded by the inventory, and only what changed is sent again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gpuops.console.latest import SIGNALS, Latest
from gpuops.inventory.hosts import Inventory
from gpuops.models import EVENT_ADAPTER, MAX_GPUS, Event
from gpuops.record.nodestate import NodeRecord, NodeState, node_counts
from gpuops.sim.fleet import envelope
from pydantic import ValidationError

NODES = frozenset({"a", "b"})
INVENTORY = Inventory(Path("inv"), NODES, {"rack": frozenset({"b"})}, {})


def _sample(node: str, gpus: dict[int, float], t: float = 1_800_000_000.0) -> Event:
    data = {
        "gpus": [{"index": i, "temp_c": temp, "temp_slowdown_c": 89.0} for i, temp in gpus.items()]
    }
    return EVENT_ADAPTER.validate_python(envelope("telemetry", node, t, data))


def test_keeps_the_newest_sample_of_inventory_gpus_only() -> None:
    latest = Latest(INVENTORY)
    latest.observe(_sample("a", {0: 40.0, 1: 41.0}))
    latest.observe(_sample("a", {1: 88.04}))
    latest.observe(_sample("elsewhere", {0: 99.0}))  # not in the inventory
    latest.observe(_sample("b", {2: 50.0}))
    frame = latest.frame(latest.nodes, now=1_800_000_010.0)
    temp = 3 + SIGNALS.index("temp_c")
    assert [(r[0], r[1], r[2], r[temp]) for r in frame.rows] == [
        (0, 0, 10, 40.0),
        (0, 1, 10, 88.0),
        (1, 2, 10, 50.0),
    ]


def test_an_index_no_node_has_never_reaches_the_heatmap() -> None:
    # Refused where events are read (format v1: index below MAX_GPUS), so no per-GPU state
    # anywhere (heatmap, windows, the power controller) grows with forged indexes.
    with pytest.raises(ValidationError, match="less than 64"):
        _sample("b", {MAX_GPUS: 99.0})


def test_a_frame_since_a_sequence_has_only_what_changed_after_it() -> None:
    latest = Latest(INVENTORY)
    latest.observe(_sample("a", {0: 40.0}))
    first = latest.frame(latest.nodes, now=time.time())
    latest.observe(_sample("b", {0: 60.0}))
    later = latest.frame(latest.nodes, now=time.time(), since=first.seq)
    assert [(r[0], r[1]) for r in later.rows] == [(1, 0)]
    assert latest.frame(latest.nodes, now=time.time(), since=later.seq).rows == []


def test_groups_select_their_nodes_and_positions_follow_the_list() -> None:
    latest = Latest(INVENTORY)
    latest.observe(_sample("b", {0: 60.0}))
    rack = latest.nodes_of("rack")
    assert rack == ("b",) and latest.nodes_of("all") == ("a", "b")
    assert latest.nodes_of("nope") is None
    assert [r[0] for r in latest.frame(rack or (), now=time.time()).rows] == [0]


def test_node_counts_take_unrecorded_inventory_nodes_as_healthy() -> None:
    records = [
        NodeRecord(node="a", state=NodeState.QUARANTINED),
        NodeRecord(node="gone", state=NodeState.NEEDS_HUMAN),  # no longer in the inventory
    ]
    counts = node_counts(records, NODES)
    assert counts["quarantined"] == 1 and counts["healthy"] == 1
    assert counts["needs_human"] == 0 and set(counts) == {s.value for s in NodeState}
