"""Issue 25's findings as attacks: one foothold on the bus must not speak for another node.

Each test plays the attacker with the credential or key one foothold gives (a node's
NATS user, a node's publisher key, an operator's NATS user) against a real engine on a
real nats-server, asserts the refusal, and that the engine kept deciding everyone else
(published = decided + dead-lettered).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import shlex
import time
from pathlib import Path

import nats
import pytest
from gpuops import subjects
from gpuops.bus.auth import ensure_credentials, ensure_node_credentials, server_config
from gpuops.bus.conn import DLQ, EVENTS, Bus, connect
from gpuops.bus.identity import EXECUTOR, KeyRing, Signer, Verifier, mac, prepared
from gpuops.bus.partitions import durable, partition_of
from gpuops.bus.server import EmbeddedNats
from gpuops.errors import EventError
from gpuops.ops.cmdwire import CommandError, Refused
from gpuops.ops.commands import Caller
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet, envelope
from nats.js.api import ConsumerConfig, DeliverPolicy

from tests.conftest import calls, counted, engine_settings, running_engine, wait_for
from tests.support import as_node, node_keys, run_gpuops

pytestmark = pytest.mark.integration


async def _dead_letters(bus: Bus) -> list[dict]:
    info = await bus.js.stream_info(DLQ)
    first = info.state.first_seq
    return [
        json.loads((await bus.js.get_msg(DLQ, seq)).data)
        for seq in range(first, first + info.state.messages)
    ]


async def test_a_nodes_key_cannot_speak_for_another_node_and_the_rest_is_still_decided(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    """The forged XID 79 for node-002, signed with node-001's key (root on node-001), is
    dead-lettered as forged and node-002 is never rebooted; so is an unsigned one and a
    forged probe pass; node-001's own XID is decided."""
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    keys = node_keys(settings.state_dir)
    node1 = keys.node("node-001")
    async with running_engine(settings, bus) as app:
        forged = [
            ("xid", envelope("xid", "node-002", time.time(), {"gpu": 0, "xid": 79}), node1),
            (
                "probe",
                envelope(
                    "probe", "node-002", time.time(), {"gpu": 0, "ok": True, "outcome": "pass"}
                ),
                node1,
            ),
            ("xid", envelope("xid", "node-002", time.time(), {"gpu": 1, "xid": 79}), None),
        ]
        for kind, event, signer in forged:
            data = json.dumps(event).encode()
            subject = subjects.event(kind, "node-002")
            headers = signer.headers(data, {"Nats-Msg-Id": event["id"]}) if signer else None
            await bus.js.publish(subject, data, headers=headers)
        own = envelope("xid", "node-001", time.time(), {"gpu": 2, "xid": 79})
        data = json.dumps(own).encode()
        subject = subjects.event("xid", "node-001")
        await bus.js.publish(subject, data, headers=as_node(keys, subject, data, own["id"]))
        await wait_for(lambda: counted(app.engine.metrics.dead_letters, "forged") == 3, 20)
        await wait_for(lambda: counted(app.engine.metrics.events, "xid") == 1, 20)
        await wait_for(lambda: calls(fleet, "node-001") != [], 60)
    letters = await _dead_letters(bus)
    assert [d["reason"] for d in letters] == ["forged"] * 3
    assert [d.get("publisher") for d in letters] == ["node:node-001", "node:node-001", None]
    assert "node:node-001 may not speak for node node-002" in letters[0]["error"]
    assert calls(fleet, "node-002") == [], "nothing ran on node-002"
    published = len(forged) + 1
    assert published == counted(app.engine.metrics.events, "xid") + len(letters)


async def test_a_forged_alert_or_drift_event_is_refused_even_when_signed_by_a_node(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    """A critical-temperature alert or a drift report is the engine's to make: from a
    node's key (or an operator) it is forged, and no drain is decided."""
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    keys = node_keys(settings.state_dir)
    async with running_engine(settings, bus) as app:
        alert = envelope(
            "alert",
            "node-001",
            time.time(),
            {"status": "firing", "labels": {"alertname": "GpuCriticalTemp"}, "fingerprint": "f1"},
        )
        data = json.dumps(alert).encode()
        subject = subjects.event("alert", "node-001")
        await bus.js.publish(subject, data, headers=as_node(keys, subject, data, alert["id"]))
        await wait_for(lambda: counted(app.engine.metrics.dead_letters, "forged") == 1, 20)
    (letter,) = await _dead_letters(bus)
    assert "may not publish alert events" in letter["error"]
    assert calls(fleet, "node-001") == []


def test_the_verifier_refuses_a_mac_of_other_bytes_and_an_unknown_publisher() -> None:
    keys = KeyRing(b"k" * 64)
    verifier = Verifier(keys)
    payload = b'{"kind":"xid"}'
    headers = keys.node("node-a").headers(payload)
    assert verifier.publisher(headers, payload, "xid", "node-a") == "node:node-a"
    with pytest.raises(EventError, match="the MAC is not 'node:node-a'"):
        verifier.publisher(headers, payload + b" ", "xid", "node-a")
    impostor = {**headers, "Gpuops-Publisher": "source:prometheus"}
    with pytest.raises(EventError, match="the MAC is not 'source:prometheus'"):
        verifier.publisher(impostor, payload, "xid", "node-a")
    with pytest.raises(EventError, match="no publisher identity"):
        verifier.publisher(None, payload, "xid", "node-a")
    other = KeyRing(b"x" * 64).node("node-a").headers(payload)
    with pytest.raises(EventError, match="the MAC is not"):
        verifier.publisher(other, payload, "xid", "node-a")


def test_a_prepared_key_macs_as_rfc_4231_and_checks_message_after_message() -> None:
    # RFC 4231, test case 1: the prepared HMAC is the standard one, and one prepared key
    # is copied for each message, never changed by one (a MAC of the one before).
    key, data = b"\x0b" * 20, b"Hi There"
    assert mac(prepared(key), data) == (
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
    )
    keys = KeyRing(b"k" * 64)
    verifier, signer = Verifier(keys), keys.node("node-a")
    for n in (0, 1, 63, 64, 65, 1100, 5000):  # around SHA-256's 64-byte block
        payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
        headers = signer.headers(payload)
        assert headers["Gpuops-Mac"] == hmac.digest(signer.key, payload, "sha256").hex()
        assert verifier.publisher(headers, payload, "xid", "node-a") == "node:node-a"
        with pytest.raises(EventError, match="the MAC is not 'node:node-a'"):
            verifier.publisher(headers, payload + b"x", "xid", "node-a")
    checker = Verifier(KeyRing(b"k" * 64))  # its own ring: node-a's key not derived yet
    assert checker.publisher(headers, payload, "xid", "node-a") == "node:node-a"
    assert checker.keys.known("node:node-a") is not None, "the checked publisher's key is kept"
    forged = {**headers, "Gpuops-Publisher": "node:node-b"}
    with pytest.raises(EventError, match="the MAC is not 'node:node-b'"):
        checker.publisher(forged, payload, "xid", "node-b")
    assert checker.keys.known("node:node-b") is None, "no key kept for a MAC that failed"


async def _embedded(tmp_path: Path) -> tuple[EmbeddedNats, dict, dict]:
    creds = ensure_credentials(tmp_path)
    nodes = ensure_node_credentials(tmp_path, ["node-a", "node-b"])
    server = EmbeddedNats(tmp_path / "nats", config_text=server_config(creds, (), nodes))
    return server, creds, nodes


async def _refused(url: str, user: str, password: str, subject: str) -> list[str]:
    """Publish as `user` and return the permission errors the server sent back."""
    errors: list[str] = []
    told = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))
        told.set()

    nc = await nats.connect(url, user=user, password=password, error_cb=on_error)
    try:
        await nc.publish(subject, b"{}")
        await nc.flush()
        with contextlib.suppress(TimeoutError):  # none comes for what is permitted
            await asyncio.wait_for(told.wait(), 5)
    finally:
        await nc.close()
    return errors


async def test_node_a_credential_cannot_publish_anything_for_node_b_on_the_embedded_nats(
    tmp_path: Path,
) -> None:
    server, creds, nodes = await _embedded(tmp_path)
    async with server:
        engine = await connect(server.url, NatsSettings(), credentials=creds["engine"])
        try:
            seen: list[str] = []

            async def note(msg: nats.aio.msg.Msg) -> None:
                seen.append(msg.subject)

            sub = await engine.nc.subscribe(subjects.EVERYTHING, cb=note)
            a = nodes["node-a"]
            for subject in (
                subjects.telemetry("node-b"),
                subjects.event("xid", "node-b"),
                subjects.event("probe", "node-b"),
                subjects.event("alert", "node-a"),
                subjects.action("node-b"),
                subjects.audit("node-b"),
            ):
                errors = await _refused(server.url, a.user, a.password, subject)
                assert any("permissions violation" in e.lower() for e in errors), (subject, errors)
            own = await _refused(server.url, a.user, a.password, subjects.event("xid", "node-a"))
            assert own == [], "its own node's events are its to publish"
            await engine.nc.flush()
            await asyncio.sleep(0.2)
            await sub.unsubscribe()
            assert seen == [subjects.event("xid", "node-a")]
        finally:
            await engine.close()


async def test_an_operator_cannot_publish_events_or_audit_nor_touch_the_engines_consumers(
    tmp_path: Path,
) -> None:
    """The `cli` user: no forged alert, no forged run record, no consumer named as a
    partition owner's, no delete of the engine's consumer."""
    server, creds, _nodes = await _embedded(tmp_path)
    async with server:
        engine = await connect(server.url, NatsSettings(), credentials=creds["engine"])
        try:
            await engine.js.add_consumer(
                EVENTS,
                durable_name="gpuops-engine-events-p0-e1",
                filter_subject=subjects.events_partition(0),
            )
            cli = creds["cli"]
            for subject in (
                subjects.event("alert", "node-a"),
                subjects.event("xid", "node-a"),
                subjects.telemetry("node-a"),
                subjects.audit("node-a"),
                f"$JS.API.CONSUMER.DELETE.{EVENTS}.gpuops-engine-events-p0-e1",
                f"$JS.API.CONSUMER.CREATE.{EVENTS}.gpuops-engine-events-p0-e9",
                f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS}.gpuops-engine-events-p0-e9",
                f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS}.gpuops-engine-events-p0-e1",
                f"$JS.API.CONSUMER.PAUSE.{EVENTS}.gpuops-engine-events-p0-e1",
                "$JS.API.CONSUMER.CREATE.GPUOPS_AUDIT.kept-forever",
                "$JS.API.CONSUMER.DURABLE.CREATE.GPUOPS_AUDIT.kept-forever",
                "$JS.API.CONSUMER.DELETE.GPUOPS_AUDIT.anyone",
            ):
                errors = await _refused(server.url, cli.user, cli.password, subject)
                assert any("permissions violation" in e.lower() for e in errors), (subject, errors)
            names = [c.name for c in await engine.js.consumers_info(EVENTS)]
            assert names == ["gpuops-engine-events-p0-e1"], "the engine's consumer is untouched"
        finally:
            await engine.close()


async def test_an_executor_cannot_write_what_steers_the_engine(tmp_path: Path) -> None:
    """Review of issue 30: the executor's user could write the whole control bucket, and
    an approval it put there was decided again as a person's (a drain and a GPU reset on
    an event that never happened). It writes its heartbeat there and nothing else."""
    server, creds, _nodes = await _embedded(tmp_path)
    async with server:
        engine = await connect(server.url, NatsSettings(), credentials=creds["engine"])
        await engine.close()  # the buckets, as an engine makes them
        executor = creds["executor"]
        control = "$KV.gpuops_control"
        for key in (
            "approval.f0f0f0f0",
            "silence.node-a",
            "breaker.fleet",
            "switch.dry_run",
            "domain.rack.a",
            "correlate.rack.a",
            "power.override.rack-a",
            "drift.slot.x",
        ):
            errors = await _refused(
                server.url, executor.user, executor.password, f"{control}.{key}"
            )
            assert any("permissions violation" in e.lower() for e in errors), (key, errors)
        beat = f"{control}.heartbeat.executor-host-1"
        assert await _refused(server.url, executor.user, executor.password, beat) == []


def test_an_issued_key_speaks_for_its_node_only(tmp_path: Path) -> None:
    """`gpuops identity issue NODE` gives the key the engine checks that node by."""
    done = run_gpuops("identity", "issue", "node-7", state_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    signer = Signer("node:node-7", bytes.fromhex(done.stdout.strip()))
    verifier = Verifier(node_keys(tmp_path))
    payload = b'{"kind":"xid","node":"node-7"}'
    assert verifier.publisher(signer.headers(payload), payload, "xid", "node-7") == "node:node-7"
    with pytest.raises(EventError, match="node:node-7 may not speak for node node-8"):
        verifier.publisher(signer.headers(payload), payload, "xid", "node-8")


async def test_a_consumer_named_by_a_later_epoch_without_its_lease_does_not_stop_a_partition(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    """Whoever may create consumers makes one named as a later owner of node-001's
    partition: the engine, whose lease the bucket holds, deletes it, takes the partition
    from where it was (not from the forged consumer's floor), and decides node-001's XID."""
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    p = partition_of("node-001", settings.nats.partitions)
    forged = durable(False, p, 10**9)
    await bus.js.add_consumer(
        EVENTS,
        ConsumerConfig(
            durable_name=forged,
            filter_subject=subjects.events_partition(p),
            deliver_policy=DeliverPolicy.NEW,
        ),
    )
    async with running_engine(settings, bus) as app:  # every partition owned, or it fails
        health, why = app.health()
        assert health, why
        names = [c.name for c in await bus.js.consumers_info(EVENTS)]
        assert forged not in names, "the consumer no lease backs was deleted"
        event = envelope("xid", "node-001", time.time(), {"gpu": 0, "xid": 79})
        data = json.dumps(event).encode()
        subject = subjects.event("xid", "node-001")
        await bus.js.publish(subject, data, headers=as_node(app.keys, subject, data, event["id"]))
        await wait_for(lambda: counted(app.engine.metrics.events, "xid") == 1, 20)
        await wait_for(lambda: calls(fleet, "node-001") != [], 60)


async def test_an_ephemeral_consumer_named_as_an_owner_poisons_no_floor(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    """A reader may make ephemeral consumers, and name one as the partition's owner with
    a floor far past the stream: the takeover believes durables only, deletes it, and
    node-001's XID stored before the engine started is still decided."""
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    p = partition_of("node-001", settings.nats.partitions)
    name = durable(False, p, 0)
    keys = node_keys(settings.state_dir)
    event = envelope("xid", "node-001", time.time(), {"gpu": 0, "xid": 79})
    data = json.dumps(event).encode()
    subject = subjects.event("xid", "node-001")
    await bus.js.publish(subject, data, headers=as_node(keys, subject, data, event["id"]))
    impostor = ConsumerConfig(
        name=name,
        filter_subject=subjects.events_partition(p),
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=10**12,
        inactive_threshold=3600.0,
    )
    await bus.js.add_consumer(EVENTS, impostor)
    async with running_engine(settings, bus) as app:
        names = [c.name for c in await bus.js.consumers_info(EVENTS)]
        assert name not in names, "the ephemeral named as an owner was deleted"
        await wait_for(lambda: counted(app.engine.metrics.events, "xid") == 1, 20)
        await wait_for(lambda: calls(fleet, "node-001") != [], 60)


async def test_health_is_degraded_while_a_partition_has_no_owner(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        assert app.health()[0]
        assert app.partitions is not None
        app.partitions.ownership.owners.pop(3)  # as a round that found partition 3 unheld
        ok, why = app.health()
        assert not ok and why["partitions"] == "no replica holds partition(s) [3]"


def test_a_host_named_like_the_engine_or_a_source_is_only_a_node() -> None:
    """Node `engine` is `node:engine`, whose key is not the engine's; a source may not
    answer a node's validation probe."""
    keys = KeyRing(b"k" * 64)
    verifier = Verifier(keys)
    payload = b'{"kind":"alert"}'
    assert keys.node("engine").key != keys.signer("engine").key
    with pytest.raises(EventError, match="node:engine may not publish alert events"):
        verifier.publisher(keys.node("engine").headers(payload), payload, "alert", "node-a")
    probe = keys.signer("source:prometheus").headers(payload)
    with pytest.raises(EventError, match="may not publish probe results"):
        verifier.publisher(probe, payload, "probe", "node-a")


def test_only_the_executor_tells_a_grade_s_result_and_it_tells_nothing_else() -> None:
    """A failed gate climbs the fault's ladder: a node passing or failing its own gate, or a
    source doing it for one, is refused; the executor may tell results and no other kind."""
    keys = KeyRing(b"k" * 64)
    verifier = Verifier(keys)
    payload = b'{"kind":"diagnostics"}'
    for forger in (keys.node("node-a"), keys.signer("source:prometheus")):
        with pytest.raises(EventError, match="may not publish diagnostics events"):
            verifier.publisher(forger.headers(payload), payload, "diagnostics", "node-a")
    executor = keys.signer(EXECUTOR).headers(payload)
    assert verifier.publisher(executor, payload, "diagnostics", "node-a") == EXECUTOR
    for kind in ("chatops", "xid", "probe"):
        with pytest.raises(EventError, match=f"the executor may not publish {kind} events"):
            verifier.publisher(executor, payload, kind, "node-a")


def test_facility_readings_and_dra_taints_come_from_their_own_source_only() -> None:
    """A node faking a DRA taint on itself would fence and reset its own GPU; the Redfish
    source may not speak of XIDs; each new source publishes its one kind."""
    keys = KeyRing(b"k" * 64)
    verifier = Verifier(keys)
    payload = b'{"kind":"dra_taint"}'
    for forger, kind in (
        (keys.node("node-a"), "dra_taint"),
        (keys.signer("source:prometheus"), "dra_taint"),
        (keys.signer("source:redfish"), "dra_taint"),
        (keys.node("node-a"), "facility"),
    ):
        with pytest.raises(EventError, match=f"may not publish {kind} events"):
            verifier.publisher(forger.headers(payload), payload, kind, "node-a")
    for source, kind in (("source:dra", "dra_taint"), ("source:redfish", "facility")):
        signed = keys.signer(source).headers(payload)
        assert verifier.publisher(signed, payload, kind, "node-a") == source
        with pytest.raises(EventError, match=f"{source} may not publish xid events"):
            verifier.publisher(signed, payload, "xid", "node-a")


async def test_an_operator_may_not_publish_in_the_engines_name_what_only_it_makes(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    """`publish` is closed until granted, and even granted it refuses a command, a drift
    report, an alert or a probe: the engine would sign them as its own word."""
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        commands = app.commands()
        drain = envelope("chatops", "node-001", time.time(), {"command": "drain", "args": []})
        with pytest.raises(Refused, match="not granted"):
            await commands.execute(_line(drain), Caller.of("cli", "mallory"))
    granted = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        chatops={"permissions": {"publish": {"users": ["cli:ops"]}}},
    )
    async with running_engine(granted, bus) as app:
        commands = app.commands()
        for kind in ("chatops", "drift", "alert", "probe"):
            event = envelope(kind, "node-001", time.time(), {})
            with pytest.raises(CommandError, match=f"{kind} events are not published"):
                await commands.execute(_line(event), Caller.of("cli", "ops"))
        xid = envelope("xid", "node-001", time.time(), {"gpu": 0, "xid": 79})
        done = await commands.execute(_line(xid), Caller.of("cli", "ops"))
        assert done == "published 1 events"
        await wait_for(lambda: counted(app.engine.metrics.events, "xid") == 1, 20)


def _line(event: dict) -> str:
    return shlex.join(["publish", json.dumps(event)])
