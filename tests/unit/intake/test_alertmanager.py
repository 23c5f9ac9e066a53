"""The Alertmanager receiver's pure parts: node (the target's, the exporter's claim checked) and
GPU from labels, ids, dedupe verdicts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from gpuops.errors import EventError
from gpuops.intake.alertmanager import (
    AlertSeen,
    Outcome,
    WebhookAlert,
    event_id,
    gpu_of,
    judge,
    node_of,
    target_node,
    to_event,
)
from gpuops.inventory.hosts import Inventory
from gpuops.inventory.targets import Targets
from gpuops.models import AlertEvent
from gpuops.settings import AlertmanagerSettings, load_settings

NAMES = AlertmanagerSettings().node_labels
STARTS = "2026-03-01T10:00:00.123Z"


def webhook_alert(status: str = "firing", **labels: str) -> WebhookAlert:
    raw: dict[str, Any] = {
        "status": status,
        "labels": {"alertname": "GpuXidError", **labels},
        "annotations": {"summary": "XID on GPU"},
        "startsAt": STARTS,
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": "0f3b2c1d",
    }
    return WebhookAlert.model_validate(raw)


def test_the_node_is_the_first_label_present_and_instance_loses_its_port() -> None:
    assert NAMES == ("instance",), "by default only the label Prometheus sets"
    assert node_of({"Hostname": "gpu-a01", "instance": "x:9400"}, NAMES) == "x"
    assert node_of({"instance": "gpu-a02:9400", "node": "other"}, NAMES) == "gpu-a02"
    assert node_of({"instance": "gpu-a03"}, NAMES) == "gpu-a03"
    assert node_of({"instance": "[fd00::1]:9400"}, NAMES) == "fd00::1"
    assert node_of({"instance": " ", "node": "gpu-a04"}, ("instance", "node")) == "gpu-a04"
    assert node_of({"job": "dcgm", "Hostname": "gpu-a01"}, NAMES) is None
    assert node_of({"host": "gpu-a05"}, ("host",)) == "gpu-a05"


INVENTORY = Inventory(
    Path("inv"),
    frozenset({"gpu-a01", "gpu-a02"}),
    {},
    {"gpu-a01": {"ansible_host": "10.0.0.1"}, "gpu-a02": {"ansible_host": "10.0.0.2"}},
)


def test_the_node_is_the_targets_and_the_exporters_own_claim_must_agree() -> None:
    # An exporter writes its own Hostname: a compromised gpu-a02 claiming gpu-a01 would
    # have had gpu-a01 rebooted. The node is the target's, by name or address.
    settings, targets = AlertmanagerSettings(), Targets(INVENTORY, "Hostname")
    labels = {"instance": "10.0.0.1:9400", "Hostname": "gpu-a01.lab"}
    assert target_node(labels, settings, targets) == "gpu-a01", "its address, its short name"
    assert target_node({"instance": "gpu-a02:9400"}, settings, targets) == "gpu-a02"
    with pytest.raises(EventError) as forged:
        target_node({"instance": "10.0.0.2:9400", "Hostname": "gpu-a01"}, settings, targets)
    assert forged.value.reason == "forged"
    assert "'gpu-a01'" in forged.value.message and "gpu-a02" in forged.value.message
    unchecked = settings.model_copy(update={"claim_label": ""})
    assert (
        target_node({"instance": "gpu-a02:9400", "Hostname": "x"}, unchecked, targets) == "gpu-a02"
    )
    assert target_node({"instance": "gpu-zz:9400"}, settings, targets) == "gpu-zz", (
        "a host the inventory lacks, as named: the engine acts on no unknown host"
    )


def test_a_gpu_is_an_index_label_or_nothing() -> None:
    assert [gpu_of(v) for v in ("0", "7", "12")] == [0, 7, 12]
    assert [gpu_of(v) for v in (None, "", "GPU-3b1c", "-1", "1.0", "٣", "9" * 20)] == [None] * 7


def test_an_alert_becomes_an_alert_event_with_its_labels_kept() -> None:
    labels = {"instance": "gpu-a01:9400", "Hostname": "gpu-a01", "gpu": "3", "xid": "79"}
    event = to_event(webhook_alert(**labels), AlertmanagerSettings(), 5.0)
    assert isinstance(event, AlertEvent)
    assert (event.node, event.source, event.epoch) == ("gpu-a01", "alertmanager", 5.0)
    data = event.data
    assert (data.name, data.status, data.gpu, data.fingerprint) == (
        "GpuXidError",
        "firing",
        3,
        "0f3b2c1d",
    )
    assert data.labels == {"alertname": "GpuXidError", **labels}
    assert data.annotations == {"summary": "XID on GPU"}
    assert data.starts_at == datetime(2026, 3, 1, 10, 0, 0, 123000, tzinfo=UTC)
    assert data.ends_at is None, "a firing alert has no end yet"
    assert event.id == event_id("0f3b2c1d", "firing", data.starts_at)


def test_ids_are_the_same_for_a_repeat_and_differ_by_status_and_occurrence() -> None:
    t = datetime(2026, 3, 1, tzinfo=UTC)
    later = datetime(2026, 3, 2, tzinfo=UTC)
    assert event_id("f", "firing", t) == event_id("f", "firing", t)
    assert (
        len(
            {
                event_id("f", "firing", t),
                event_id("f", "resolved", t),
                event_id("f", "firing", later),
                event_id("g", "firing", t),
            }
        )
        == 4
    )


@pytest.mark.parametrize(
    ("labels", "reason", "why"),
    [
        (
            {"job": "dcgm", "Hostname": "gpu-a01"},
            "no_node",
            "no node label: the alert has none of instance",
        ),
        ({"instance": "bad/name:9400"}, "bad_node", "alert.node: String should match pattern"),
        ({"instance": "gpu-a01:9400", "alertname": ""}, "schema", "no alertname label"),
        ({"instance": "gpu-a01:9400", "Hostname": "gpu-a02"}, "forged", "its Hostname label"),
    ],
)
def test_an_alert_that_cannot_be_an_event_says_why(
    labels: dict[str, str], reason: str, why: str
) -> None:
    with pytest.raises(EventError) as dead:
        to_event(webhook_alert(**labels), AlertmanagerSettings(), 5.0)
    assert dead.value.reason == reason and dead.value.message.startswith(why)


def test_a_repeat_is_a_duplicate_and_an_older_notification_stale() -> None:
    seen = AlertSeen(status="firing", starts_at=100.0, event_id="e", at=1.0)
    assert judge(None, "firing", 100.0) is Outcome.PUBLISHED
    assert judge(seen, "firing", 100.0) is Outcome.DUPLICATE
    assert judge(seen, "resolved", 100.0) is Outcome.PUBLISHED
    assert judge(seen, "firing", 200.0) is Outcome.PUBLISHED, "fired again: a new occurrence"
    assert judge(seen, "resolved", 50.0) is Outcome.STALE
    resolved = seen.model_copy(update={"status": "resolved"})
    assert judge(resolved, "resolved", 100.0) is Outcome.DUPLICATE
    assert judge(resolved, "firing", 100.0) is Outcome.STALE, "a retry after its resolution"


def test_the_token_comes_from_the_environment_and_is_kept_secret(tmp_path: Path) -> None:
    token = "am-token-3f-0123456789abcdef"
    environ = {"GPUOPS_SOURCES__ALERTMANAGER__TOKEN": token}
    (tmp_path / "gpuops.yml").write_text("sources: {alertmanager: {gpu_label: gpu}}\n")
    settings = load_settings(tmp_path / "gpuops.yml", {}, environ).sources.alertmanager
    assert settings.token is not None and settings.token.get_secret_value() == token
    assert token not in repr(settings)
    assert settings.node_labels == ("instance",) and settings.claim_label == "Hostname"
    assert settings.gpu_label == "gpu"
