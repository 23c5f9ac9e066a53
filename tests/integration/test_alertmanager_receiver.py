"""The Alertmanager receiver over real HTTP on loopback and a real nats-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gpuops.bus.conn import DLQ, EVENTS, Bus
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.store import NatsKV
from gpuops.clock import SystemClock
from gpuops.http import HttpServer
from gpuops.intake.alertmanager import PATH, AlertmanagerReceiver
from gpuops.inventory.hosts import Inventory
from gpuops.inventory.targets import Targets
from gpuops.record.metrics import Metrics, by_label, total
from gpuops.settings import AlertmanagerSettings

pytestmark = pytest.mark.integration
NODES = frozenset({"node-001", "node-002"})
INVENTORY = Inventory(Path("inv"), NODES, {}, {})
TOKEN = "am-secret-7b1f-0123456789abcdef"
ALERTS = "gpuops.events.*.alert.>"  # stored under their partition


@dataclass
class Receiver:
    url: str
    route: AlertmanagerReceiver
    metrics: Metrics
    bus: Bus


async def _receiver(bus: Bus, **settings: Any) -> AsyncIterator[Receiver]:
    metrics = Metrics()
    route = AlertmanagerReceiver(
        AlertmanagerSettings(**settings),
        JetStreamPublisher(bus.js),
        NatsKV(bus.kv["history"]),
        SystemClock(),
        metrics.registry,
        Targets(INVENTORY, "Hostname"),
        on_dead=lambda reason: metrics.dead_letters.labels(reason).inc(),
    )
    server = HttpServer(metrics.registry, lambda: (True, {}), mounts=[route.mount])
    port = await server.start("127.0.0.1:0")
    try:
        yield Receiver(f"http://127.0.0.1:{port}{PATH}", route, metrics, bus)
    finally:
        await server.stop()


@pytest.fixture
async def receiver(bus: Bus) -> AsyncIterator[Receiver]:
    async for r in _receiver(bus, token=TOKEN, max_body_bytes=64 << 10, max_alerts=50):
        yield r


def alert(
    node: str | None, fingerprint: str, status: str = "firing", **labels: str
) -> dict[str, Any]:
    """One alert as Alertmanager's webhook sends it: Prometheus's target label, and
    dcgm-exporter's own claim that agrees."""
    named = {"instance": f"{node}:9400", "Hostname": node} if node else {}
    return {
        "status": status,
        "labels": {"alertname": "GpuXidError", **named, **labels},
        "annotations": {"summary": "XID"},
        "startsAt": "2026-03-01T10:00:00Z",
        "endsAt": "2026-03-01T10:05:00Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph",
        "fingerprint": fingerprint,
    }


def notification(*alerts: dict[str, Any]) -> dict[str, Any]:
    """Alertmanager's webhook payload, version 4."""
    return {
        "version": "4",
        "groupKey": '{}:{alertname="GpuXidError"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "gpuops",
        "groupLabels": {"alertname": "GpuXidError"},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }


async def post(
    r: Receiver, body: bytes | dict[str, Any], token: str | None = TOKEN
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(r.url, data=data, headers=headers) as reply,
    ):
        return reply.status, await reply.json()


async def stored(bus: Bus, stream: str = EVENTS, subjects: str = ALERTS) -> dict[str, int]:
    """Messages per subject, as published (the partition token the stream adds left out)."""
    info = await bus.js.stream_info(stream, subjects_filter=subjects)
    return {_published(k): n for k, n in (info.state.subjects or {}).items()}


def _published(stored: str) -> str:
    parts = stored.split(".")
    return ".".join(parts[:2] + parts[3:]) if len(parts) == 5 else stored


async def test_missing_or_wrong_token_is_401_and_nothing_is_published(receiver: Receiver) -> None:
    body = notification(alert("node-001", "f1"))
    assert await post(receiver, body, token=None) == (
        401,
        {"error": "missing_token", "why": "Authorization: Bearer <token> is required"},
    )
    status, reply = await post(receiver, body, token="am-secret-7b1X")
    assert (status, reply["error"]) == (401, "bad_token")
    status, _ = await post(receiver, body, token="ünïcödé")
    assert status == 401
    assert await stored(receiver.bus) == {}
    assert by_label(receiver.route.rejections) == {"missing_token": 1.0, "bad_token": 2.0}


async def test_without_a_token_configured_every_post_is_refused(bus: Bus) -> None:
    async for r in _receiver(bus):
        status, reply = await post(r, notification(alert("node-001", "f1")))
        assert (status, reply["error"]) == (503, "not_configured")
        assert "set sources.alertmanager.token" in reply["why"]
        assert await stored(bus) == {}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{not json", "body: Invalid JSON"),
        (b"[]", "body: Input should be an object"),
        (json.dumps({**notification(), "version": "3"}).encode(), "version: Input should be '4'"),
        (
            json.dumps({**notification(), "alerts": "x"}).encode(),
            "alerts: Input should be a valid array",
        ),
        (json.dumps({"version": "4"}).encode(), "status: Field required"),
    ],
)
async def test_a_malformed_post_is_400_with_the_reason(
    receiver: Receiver, body: bytes, why: str
) -> None:
    status, reply = await post(receiver, body)
    assert (status, reply["error"]) == (400, "malformed")
    assert reply["why"].startswith(why), reply["why"]
    assert total(receiver.route.rejections, "malformed") == 1
    # The receiver goes on: a good post after it is taken.
    assert (await post(receiver, notification(alert("node-001", "ok"))))[0] == 200


async def test_an_oversize_body_or_batch_is_refused_and_counted(receiver: Receiver) -> None:
    big = notification(*(alert("node-001", f"f{i}", pad="x" * 1000) for i in range(70)))
    status, reply = await post(receiver, big)
    assert (status, reply) == (413, {"error": "too_large", "why": "body over 65536 bytes"})

    # Sent in chunks with no Content-Length: the reading itself stops at the limit.
    async def chunks() -> AsyncIterator[bytes]:
        data = json.dumps(big).encode()
        for at in range(0, len(data), 8192):
            yield data[at : at + 8192]

    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(receiver.url, data=chunks(), headers=headers) as chunked,
    ):
        assert (chunked.status, (await chunked.json())["error"]) == (413, "too_large")
    many = notification(*(alert("node-001", f"f{i}") for i in range(51)))
    status, reply = await post(receiver, many)
    assert (status, reply["error"]) == (413, "too_many_alerts")
    assert "limit 50: set max_alerts in Alertmanager's webhook_configs" in reply["why"]
    assert by_label(receiver.route.rejections) == {"too_large": 2.0, "too_many_alerts": 1.0}
    assert await stored(receiver.bus) == {}


async def test_an_exporters_claim_of_another_node_is_forged_and_not_published(
    receiver: Receiver,
) -> None:
    # node-002's exporter writes Hostname="node-001" beside an XID 79: Prometheus's alert
    # carries both labels, and the target (instance) is node-002's.
    forged = {**alert("node-002", "f1", xid="79")}
    forged["labels"] = {**forged["labels"], "Hostname": "node-001"}
    status, reply = await post(receiver, notification(forged, alert("node-002", "f2")))
    assert (status, reply) == (200, {"alerts": 2, "dead_letter": 1, "published": 1})
    assert await stored(receiver.bus) == {"gpuops.events.alert.node-002": 1}, "none for node-001"
    assert await stored(receiver.bus, DLQ, "gpuops.dlq.>") == {"gpuops.dlq.forged": 1}


async def test_what_the_intake_would_refuse_is_refused_before_it_is_kept(bus: Bus) -> None:
    # A startsAt a day ahead, once kept in KV, made the alert's true notifications
    # "stale" for that day; an event past the intake's size (multi-byte labels within
    # their character bounds) was published, refused there, and its repeats answered
    # "duplicate".
    ahead = datetime.now(UTC) + timedelta(days=1)
    future = {**alert("node-001", "f1"), "startsAt": ahead.isoformat()}
    huge = alert("node-001", "f2", **{f"k{i}": "\u6e29" * 1000 for i in range(60)})
    huge["annotations"] = {f"a{i}": "\u6e29" * 1000 for i in range(40)}
    async for r in _receiver(bus, token=TOKEN):
        status, reply = await post(r, notification(future, huge))
        assert (status, reply) == (200, {"alerts": 2, "dead_letter": 2})
        assert await stored(bus, DLQ, "gpuops.dlq.>") == {
            "gpuops.dlq.future": 1,
            "gpuops.dlq.too_large": 1,
        }
        again = await post(r, notification(alert("node-001", "f1"), huge))
        assert again == (200, {"alerts": 2, "published": 1, "dead_letter": 1})
        assert await stored(bus) == {"gpuops.events.alert.node-001": 1}


async def test_an_alert_without_a_node_is_a_dead_letter_and_the_batch_goes_on(
    receiver: Receiver,
) -> None:
    batch = notification(
        alert("node-001", "f1", gpu="2", xid="79"),
        alert(None, "f2", job="dcgm"),
        alert("node-002", "f3", annotations="ok"),
        {"status": "firing", "labels": {"instance": "node-002"}},  # no times, no fingerprint
        {**alert("node-002", "f4"), "fingerprint": "a.>"},  # could not be a KV key
    )
    status, reply = await post(receiver, batch)
    assert (status, reply) == (200, {"alerts": 5, "published": 2, "dead_letter": 3})
    assert await stored(receiver.bus) == {
        "gpuops.events.alert.node-001": 1,
        "gpuops.events.alert.node-002": 1,
    }
    event = json.loads(
        (await receiver.bus.js.get_last_msg(EVENTS, "gpuops.events.*.alert.node-001")).data
    )
    assert event["source"] == "alertmanager" and event["data"]["gpu"] == 2
    assert event["data"]["labels"] == {
        "alertname": "GpuXidError",
        "instance": "node-001:9400",
        "Hostname": "node-001",
        "gpu": "2",
        "xid": "79",
    }
    assert await stored(receiver.bus, DLQ, "gpuops.dlq.>") == {
        "gpuops.dlq.no_node": 1,
        "gpuops.dlq.schema": 2,
    }
    letter = json.loads((await receiver.bus.js.get_last_msg(DLQ, "gpuops.dlq.no_node")).data)
    assert letter["reason"] == "no_node" and json.loads(letter["payload"])["fingerprint"] == "f2"
    assert by_label(receiver.metrics.dead_letters) == {"no_node": 1.0, "schema": 2.0}


async def test_a_time_outside_utc_s_years_is_a_dead_letter_not_a_500(receiver: Receiver) -> None:
    """Review of issue 30: a valid RFC 3339 time whose UTC year is 0 (or 10000) raised
    ValueError past the alert's own checks: a 500, the alerts after it lost, and the same
    post failing on every retry of Alertmanager's. It is now the alert's `schema`."""
    early = {**alert("node-001", "f2"), "startsAt": "0001-01-01T00:00:00+01:00"}
    late = {**alert("node-001", "f3"), "endsAt": "9999-12-31T23:59:59-01:00", "status": "resolved"}
    batch = notification(alert("node-001", "f1"), early, late, alert("node-002", "f4"))
    for _ in range(2):  # and again, as Alertmanager retries: the same answer
        status, reply = await post(receiver, batch)
        assert status == 200 and reply["dead_letter"] == 2, reply
    assert await stored(receiver.bus) == {
        "gpuops.events.alert.node-001": 1,
        "gpuops.events.alert.node-002": 1,
    }
    letter = json.loads((await receiver.bus.js.get_last_msg(DLQ, "gpuops.dlq.schema")).data)
    assert "years 1 to 9999 in UTC" in letter["error"], letter["error"]


async def test_a_repeat_after_the_duplicate_window_is_acknowledged_and_not_published(
    receiver: Receiver,
) -> None:
    bus = receiver.bus
    # JetStream's own dedupe is a window (10 minutes here); Alertmanager repeats hours
    # apart. Shrink the window so the repeat below comes after it, as in production.
    config = (await bus.js.stream_info(EVENTS)).config
    config.duplicate_window = 1.0
    await bus.js.update_stream(config)
    firing = notification(alert("node-001", "f1"))
    assert (await post(receiver, firing))[1] == {"alerts": 1, "published": 1}
    await asyncio.sleep(1.5)
    assert (await post(receiver, firing)) == (200, {"alerts": 1, "duplicate": 1})
    assert await stored(bus) == {"gpuops.events.alert.node-001": 1}
    # The window had passed: the same message id published now would be stored again.
    first = await bus.js.get_last_msg(EVENTS, "gpuops.events.*.alert.node-001")
    await bus.js.publish(
        "gpuops.events.alert.node-001",
        first.data,
        headers={"Nats-Msg-Id": json.loads(first.data)["id"]},
    )
    assert await stored(bus) == {"gpuops.events.alert.node-001": 2}
    # Its resolution is news once; a firing retried after it is stale; firing again later is news.
    resolved = notification(alert("node-001", "f1", status="resolved"))
    assert (await post(receiver, resolved))[1] == {"alerts": 1, "published": 1}
    assert (await post(receiver, resolved))[1] == {"alerts": 1, "duplicate": 1}
    assert (await post(receiver, firing))[1] == {"alerts": 1, "stale": 1}
    again = alert("node-001", "f1")
    again["startsAt"] = "2026-03-01T11:00:00Z"
    assert (await post(receiver, notification(again)))[1] == {"alerts": 1, "published": 1}
    assert await stored(bus) == {"gpuops.events.alert.node-001": 4}
    assert by_label(receiver.route.alerts) == {"published": 3.0, "duplicate": 2.0, "stale": 1.0}
