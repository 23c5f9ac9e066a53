"""Issue 10, defect 2: one future-dated event switched detection off fleet-wide.

The matcher's windows run per key on each key's own events, swept on the engine's
clock; the intake refuses events dated beyond the allowed skew as `future`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from gpuops.clock import ManualClock
from gpuops.errors import EventError
from gpuops.intake.decode import decode
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import Event, new_event
from gpuops.subjects import event as subject_of

from tests.conftest import ROOT

pytestmark = pytest.mark.faults

START = 1_800_000_000.0
YEAR = 365 * 86400.0


def _payload(kind: str, node: str, t: float, data: dict[str, Any]) -> bytes:
    return json.dumps(new_event(kind, node, t, data, "test")).encode()


def _hot(node: str, t: float) -> bytes:
    gpu = {"index": 0, "temp_c": 95.0, "temp_slowdown_c": 90.0, "temp_shutdown_c": 95.0}
    return _payload("telemetry", node, t, {"gpus": [gpu]})


class Engine:
    """What the intake and the match stage do with one message, on a manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock(START)
        self.matcher = Matcher(load_rules([ROOT / "rules"], ROOT / "playbooks"), self.clock)
        self.matcher.seed(["node-001", "node-002"], START)
        self.dead: list[str] = []

    def receive(self, payload: bytes, kind: str, node: str) -> list[str]:
        try:
            event: Event = decode(payload, subject_of(kind, node), now=self.clock.now())
        except EventError as exc:
            self.dead.append(exc.reason)
            return []
        return [m.rule for m in self.matcher.match(event)]

    def tick(self) -> list[tuple[str, str]]:
        fired = [(m.rule, m.node) for m in self.matcher.tick(self.clock.now())]
        self.matcher.sweep()
        return fired


def test_unknown_hosts_future_heartbeat_does_not_stop_overheat_detection() -> None:
    engine = Engine()
    ghost = _payload("heartbeat", "ghost-17", START + YEAR, {"seq": 1})
    assert engine.receive(ghost, "heartbeat", "ghost-17") == []
    assert engine.dead == ["future"]
    # Even had it got through, it would only move its own key: feed it to the matcher.
    engine.matcher.match(decode(ghost))
    fired: list[str] = []
    for i in range(22):  # 22 samples at 95 C over 110 s
        engine.clock.set(START + 5.0 * i)
        fired += engine.receive(_hot("node-001", START + 5.0 * i), "telemetry", "node-001")
        engine.tick()
    assert fired.count("gpu-overheat") == 22 - 12  # from the sample 60 s after the first


def test_future_xid_is_dead_lettered_as_future_and_never_matched() -> None:
    engine = Engine()
    xid = _payload("xid", "node-001", START + 10 * YEAR, {"gpu": 0, "xid": 74})
    assert engine.receive(xid, "xid", "node-001") == []
    assert engine.dead == ["future"]
    now = _payload("xid", "node-001", START, {"gpu": 0, "xid": 74})
    assert engine.receive(now, "xid", "node-001") != [], "the same XID dated now matches"


def test_nodes_own_future_heartbeat_does_not_disable_its_deadman() -> None:
    engine = Engine()
    # node-001's clock runs 200 s ahead (within the skew, so accepted), then it goes silent;
    # a heartbeat a year ahead reaching the matcher must not hold its deadline off either.
    ahead = _payload("heartbeat", "node-001", START + 200.0, {"seq": 1})
    assert engine.receive(ahead, "heartbeat", "node-001") == []
    engine.matcher.match(decode(_payload("heartbeat", "node-001", START + YEAR, {"seq": 2})))
    engine.clock.advance(60.0)
    beat = _payload("heartbeat", "node-002", START + 60.0, {"seq": 1})
    assert engine.receive(beat, "heartbeat", "node-002") == []
    engine.clock.advance(31.0)  # node-001 silent for 91 s by the clock; node-002 for 31 s
    assert engine.tick() == [("agent-silent", "node-001")]
    assert engine.dead == []
