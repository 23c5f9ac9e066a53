"""Rules on `alert` events: matching, the status they must name, and resolution clearing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpuops.clock import ManualClock, rfc3339
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import EVENT_ADAPTER, Event

from tests.unit.decide.helpers import ROOT, T0, engine_on

RULES = """
rules:
  - name: xid-alert
    on: alert
    group_by: [node, gpu]
    when: name == "GpuXidError" and status == "firing" and label(labels, "xid") in ["79", "48"]
    severity: critical
    actions:
      - playbook: gpu_reset.yml
  - name: hot-alert
    on: alert
    when: name == "GpuTempHigh" and status == "firing"
    severity: warning
"""


def alert(
    name: str,
    status: str,
    fingerprint: str,
    node: str = "node-001",
    gpu: int | None = 0,
    at: float = 0.0,
    **labels: str,
) -> Event:
    """An alert event as the receiver publishes one."""
    data: dict[str, Any] = {
        "name": name,
        "status": status,
        "fingerprint": fingerprint,
        "gpu": gpu,
        "labels": {"alertname": name, "Hostname": node, **labels},
    }
    return EVENT_ADAPTER.validate_python(
        {
            "id": f"{fingerprint}-{status}-{at}",
            "kind": "alert",
            "node": node,
            "ts": rfc3339(T0 + at),
            "source": "alertmanager",
            "data": data,
        }
    )


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "alerts.yml").write_text(RULES)
    return tmp_path


def test_a_firing_alert_matches_on_its_name_status_and_label(rules_dir: Path) -> None:
    matcher = Matcher(load_rules([rules_dir], ROOT / "playbooks"))
    hit = matcher.match(alert("GpuXidError", "firing", "f1", gpu=3, xid="79"))
    assert [(m.rule, m.node, m.gpus) for m in hit] == [("xid-alert", "node-001", (3,))]
    assert matcher.match(alert("GpuXidError", "firing", "f2", xid="13")) == []
    assert matcher.match(alert("GpuXidError", "firing", "f3")) == []  # no xid label
    assert matcher.match(alert("GpuXidError", "resolved", "f1", gpu=3, xid="79")) == []


def test_only_the_resolution_of_the_alert_that_fired_clears_its_key(rules_dir: Path) -> None:
    matcher = Matcher(load_rules([rules_dir], ROOT / "playbooks"))
    matcher.match(alert("GpuTempHigh", "firing", "hot0", gpu=0, at=0))
    matcher.match(alert("GpuTempHigh", "firing", "hot1", gpu=1, at=1))
    # Another alert on the node, and a resolution of an alert that never fired: not it.
    matcher.match(alert("GpuXidError", "firing", "x", at=2, xid="13"))
    matcher.match(alert("GpuTempHigh", "resolved", "other", at=3))
    assert matcher.take_cleared() == []
    # A per-node rule held by two GPUs' alerts clears when the last one resolves.
    matcher.match(alert("GpuTempHigh", "resolved", "hot0", gpu=0, at=4))
    assert matcher.take_cleared() == []
    matcher.match(alert("GpuTempHigh", "resolved", "hot1", gpu=1, at=5))
    assert matcher.take_cleared() == [("hot-alert", "node-001", None, T0 + 5)]


def test_a_per_gpu_alert_rule_clears_the_gpu_whose_alert_resolved(rules_dir: Path) -> None:
    matcher = Matcher(load_rules([rules_dir], ROOT / "playbooks"))
    matcher.match(alert("GpuXidError", "firing", "x3", gpu=3, xid="48"))
    matcher.match(alert("GpuXidError", "resolved", "x3", gpu=3, at=9, xid="48"))
    assert matcher.take_cleared() == [("xid-alert", "node-001", 3, T0 + 9)]


async def test_a_resolved_alert_resolves_the_episode_its_firing_opened(rules_dir: Path) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock, rules=load_rules([rules_dir], ROOT / "playbooks"))
    await engine.pipeline.handle(alert("GpuTempHigh", "firing", "hot0"))
    [ep] = await engine.recorder.episodes.all_open()
    assert (ep.rule, ep.node, ep.on_telemetry) == ("hot-alert", "node-001", True)
    clock.set(T0 + 600)  # longer than resolve_after_s: only the resolution may close it
    await engine.recorder.sweep()
    assert len(await engine.recorder.episodes.all_open()) == 1
    await engine.pipeline.handle(alert("GpuTempHigh", "resolved", "hot0", at=600))
    assert await engine.recorder.episodes.all_open() == []
    [done] = [ep for _, ep in await engine.recorder.episodes.store.all()]
    assert done.why_resolved == "the condition cleared" and done.cleared_at == T0 + 600


def test_an_alert_rule_reading_inventory_variables_clears_only_on_its_own_resolution(
    tmp_path: Path,
) -> None:
    # Reading `tier` from the inventory puts the rule on the evaluated-per-sample path.
    (tmp_path / "a.yml").write_text(
        """
rules:
  - name: hot-prod
    on: alert
    when: name == "GpuTempHigh" and status == "firing" and tier == "prod"
"""
    )
    hosts = frozenset({"node-001"})
    inventory = Inventory(tmp_path, hosts, {"all": hosts}, {"node-001": {"tier": "prod"}})
    matcher = Matcher(load_rules([tmp_path], ROOT / "playbooks", inventory), inventory=inventory)
    assert [m.rule for m in matcher.match(alert("GpuTempHigh", "firing", "hot0"))] == ["hot-prod"]

    matcher.match(alert("GpuXidError", "firing", "x", at=1, xid="13"))  # false for this rule
    assert matcher.take_cleared() == [], "another alert on the node is not the resolution"
    matcher.match(alert("GpuTempHigh", "resolved", "hot0", at=2))
    assert matcher.take_cleared() == [("hot-prod", "node-001", None, T0 + 2)]
