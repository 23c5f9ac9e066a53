"""The embedded nats-server: supervised, never orphaned, a stable port, users per role."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from gpuops import subjects
from gpuops.bus.auth import (
    ENGINE_ONLY,
    KV_BUCKETS,
    REPLAY,
    Credentials,
    Role,
    ensure_credentials,
    node_credentials,
    read_credentials,
)
from gpuops.bus.conn import (
    ACTIONS,
    AUDIT,
    BUCKETS,
    DLQ,
    EVENTS,
    TELEMETRY,
    Bus,
    agent_endpoint,
    connect,
    connect_forever,
    open_bus,
)
from gpuops.bus.embedded import enrol, port_file, publishers_dir, url_file
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.server import EmbeddedNats, _alive
from gpuops.errors import BusError
from gpuops.models import AuditRecord
from gpuops.record.audit import Auditor
from gpuops.settings import NatsSettings, Settings
from gpuops.signing import load_key
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.api import DiscardPolicy, StorageType
from nats.js.errors import Error as JsError

from tests.conftest import ROOT, wait_for
from tests.support import as_node, free_port, node_keys

pytestmark = pytest.mark.integration


async def _publish_acked(bus: Bus, subject: str) -> bool:
    try:
        await bus.js.publish(subject, b"{}", timeout=1)
    except (NatsError, JsError, TimeoutError):
        return False
    return True


async def test_killed_server_is_restarted_on_the_same_port_and_clients_reconnect(
    tmp_path: Path,
) -> None:
    async with open_bus(NatsSettings(), tmp_path / "state") as bus:
        assert bus.server is not None
        first_pid, port = bus.server.pid, bus.server.port
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        await wait_for(lambda: bus.server is not None and bus.server.restarts >= 1, 20)
        await wait_for(lambda: bus.server is not None and bus.server.pid not in (None, first_pid))
        assert bus.server.port == port, "restarted on the port clients and agents know"
        await wait_for(lambda: _publish_acked(bus, "gpuops.events.heartbeat.node-001"), 20)


# Another process (a gpuops) that starts an embedded server and prints its pid and port.
_OWNER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from gpuops.bus.server import EmbeddedNats\n"
    "server = EmbeddedNats(Path(sys.argv[1]), supervise=True).start()\n"
    "print(server.pid, server.port, flush=True)\n"
    "time.sleep(600)\n"
)


def _owner(store: Path) -> tuple[subprocess.Popen[str], int, int]:
    """The owning process, its server's pid and port."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(store)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert owner.stdout is not None
    pid, port = map(int, owner.stdout.readline().split())
    return owner, pid, port


def test_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    owner, server_pid, _ = _owner(tmp_path / "nats")
    try:
        assert _alive(server_pid)
        owner.kill()  # SIGKILL: no cleanup code runs in the owner
        owner.wait(10)
        deadline = time.monotonic() + 5
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid), "nats-server outlived the engine that started it"
    finally:
        owner.kill()
        pid_file = tmp_path / "nats" / "nats-server.pid"
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_server_whose_gpuops_lives_is_never_stopped_as_an_orphan(tmp_path: Path) -> None:
    """A second gpuops on the same state dir (or one that found the first slow to answer)
    must not take the running engine's bus away: it refuses, saying why."""
    owner, server_pid, port = _owner(tmp_path / "nats")
    try:
        with pytest.raises(BusError, match="belongs to a running process"):
            EmbeddedNats(tmp_path / "nats", port=port).start()
        assert _alive(server_pid), "the running engine's server was left alone"
    finally:
        owner.kill()
        owner.wait(10)


def test_start_stops_an_orphan_named_by_the_pid_file(tmp_path: Path) -> None:
    orphan = EmbeddedNats(tmp_path / "nats").start()
    orphan_pid = orphan.pid
    assert orphan_pid is not None
    # A second start on the same store and port, as after a crash that left the first.
    second = EmbeddedNats(tmp_path / "nats", port=orphan.port).start()
    try:
        assert not _alive(orphan_pid)
        assert second.port == orphan.port and second.pid != orphan_pid
    finally:
        second.stop()
        orphan.stop()


async def test_port_is_remembered_across_restarts_and_replaced_when_taken(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as bus:
        first = bus.server.port if bus.server else 0
    assert port_file(state).read_text() == str(first)
    async with open_bus(NatsSettings(), state) as bus:
        assert bus.server is not None and bus.server.port == first
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first))
        squatter.listen()
        async with open_bus(NatsSettings(), state) as bus:
            assert bus.server is not None and bus.server.port != first
            assert port_file(state).read_text() == str(bus.server.port)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _enrol(state: Path, *nodes: str) -> None:
    """What a starting engine does for its inventory (spine.app.enrol_inventory): each
    node's NATS user and every publisher's key, before its embedded server starts."""
    enrol(state, nodes, load_key(state / "keys" / "identity.key", "identity key"))


async def test_state_dir_and_credentials_are_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _enrol(state, "node-001")
    async with open_bus(NatsSettings(), state):
        assert _mode(state) == 0o700
        assert _mode(state / "creds") == 0o700
        for role in ("engine", "executor", "source", "cli"):
            assert _mode(state / "creds" / f"{role}.json") == 0o600
        assert not (state / "creds" / "agent.json").exists(), "no shared agent user"
        assert _mode(state / "creds" / "nodes") == 0o700
        assert _mode(state / "creds" / "nodes" / "node-001.json") == 0o600
        assert _mode(publishers_dir(state)) == 0o700
        for key in ("node-node-001.key", "source-prometheus.key"):
            assert _mode(publishers_dir(state) / key) == 0o600
        assert _mode(state / "keys" / "identity.key") == 0o600
        assert _mode(state / "nats" / "nats-server.conf") == 0o600
        assert _mode(url_file(state)) & 0o022 == 0, "nats.url is 0644 at most"
        assert "password" not in url_file(state).read_text()


_ENROL_AT = """
import json, sys, time
from pathlib import Path
from gpuops.bus.auth import ensure_credentials
from gpuops.bus.embedded import enrol
from gpuops.signing import load_key
state, at = Path(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, at - time.time()))  # every process starts writing at once
key = load_key(state / "keys" / "identity.key", "identity key")
enrol(state, [f"node-{i:03d}" for i in range(150)], key)
print(json.dumps({"engine": ensure_credentials(state)["engine"].password, "key": key.decode()}))
"""


def test_replicas_starting_together_on_one_state_dir_all_start_and_agree(
    tmp_path: Path,
) -> None:
    """Replicas of the engine share a state dir and make its keys and users together:
    none fails on another's half-written file, and all keep the first one's."""
    for round_ in range(3):
        state = tmp_path / f"state-{round_}"
        at = time.time() + 2.0
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _ENROL_AT, str(state), str(at)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 4, [err for _, err in outs]
        seen = {out for out, _ in outs}
        assert len(seen) == 1, "every replica reads the same engine password and key"
        kept = read_credentials(state, "engine").password
        assert json.loads(seen.pop())["engine"] == kept
        assert not list(state.rglob(".*.json.*")), "no temporary file left behind"


async def _client(
    state: Path, role: Role | Credentials, url: str, errors: list[str], inbox: str = ""
) -> Client:
    """A plain client as `role` (or a node's credentials), with the role's own inbox prefix
    (a node's: `inbox`), each server error collected in `errors`."""
    cred = role if isinstance(role, Credentials) else read_credentials(state, role)

    async def collect(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        url,
        user=cred.user,
        password=cred.password,
        error_cb=collect,
        allow_reconnect=False,
        inbox_prefix=inbox or subjects.inbox_of(str(role)),
    )


async def _violations(errors: list[str], subject: str) -> bool:
    # nats-py lowercases the server's error line.
    return any(f'permissions violation for publish to "{subject.lower()}' in e for e in errors)


async def _subscribe_violations(errors: list[str], subject: str) -> bool:
    return any(f'permissions violation for subscription to "{subject.lower()}' in e for e in errors)


async def test_a_node_may_publish_its_own_events_but_not_another_nodes_intents_kv_or_js_api(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    _enrol(state, "node-001", "node-002")
    keys = node_keys(state)
    async with open_bus(NatsSettings(), state) as engine:
        errors: list[str] = []
        cred = node_credentials(state, "node-001")
        assert cred.user == "node:node-001"
        agent = await _client(state, cred, engine.url, errors, subjects.node_inbox("node-001"))
        try:
            js = agent.jetstream(timeout=2)
            for subject, stream in (
                ("gpuops.telemetry.node-001", TELEMETRY),
                ("gpuops.events.xid.node-001", EVENTS),
            ):
                ack = await js.publish(subject, b"{}", headers=as_node(keys, subject, b"{}"))
                assert ack.stream == stream, f"the node's own {subject} is stored and acked"
            # Its own probe requests it may hear; another node's it may not.
            await agent.subscribe("gpuops.agent.node-001.probe")
            await agent.subscribe("gpuops.agent.node-002.probe")
            for subject in (
                "gpuops.telemetry.node-002",  # another node's
                "gpuops.events.xid.node-002",
                "gpuops.actions.node-001",
                "$KV.gpuops_control.breaker",
                "$JS.API.STREAM.INFO.GPUOPS_ACTIONS",
                "gpuops.events.alert.node-001",  # the receiver's own
                "gpuops.events.drift.node-001",  # the drift check's own
            ):
                await agent.publish(subject, b"{}")
            await agent.flush()
            for subject in (
                "gpuops.telemetry.node-002",
                "gpuops.events.xid.node-002",
                "gpuops.actions.node-001",
                "$KV.gpuops_control",
                "$JS.API.STREAM",
                "gpuops.events.alert.node-001",
                "gpuops.events.drift.node-001",
            ):
                await wait_for(lambda s=subject: _violations(errors, s), 10)
            await wait_for(lambda: _subscribe_violations(errors, "gpuops.agent.node-002.probe"), 10)
            assert not await _subscribe_violations(errors, "gpuops.agent.node-001.probe")
            for subject in ("gpuops.actions.node-002", "gpuops.events.xid.node-002"):
                with pytest.raises((NatsError, TimeoutError)):
                    await js.publish(subject, b"{}", timeout=1)
            info = await engine.js.stream_info(ACTIONS)
            assert info.state.messages == 0, "no intent from an agent was stored"
            assert await _stream_messages(engine, EVENTS, 1), "only node-001's own xid"
            assert await _stream_messages(engine, TELEMETRY, 1), "only node-001's own sample"
        finally:
            await agent.close()


async def test_executor_consumes_intents_and_the_cli_can_neither_queue_one_nor_write_state(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as engine:
        await engine.js.publish("gpuops.actions.node-001", b'{"intent": 1}')
        async with open_bus(NatsSettings(), state, role="executor") as executor:
            sub = await executor.js.pull_subscribe(
                "gpuops.actions.>", durable="gpuops-executor", stream=ACTIONS
            )
            msgs = await sub.fetch(1, timeout=5)
            assert msgs[0].data == b'{"intent": 1}'
            await msgs[0].ack()
            await executor.js.publish("gpuops.audit.node-001", b"{}")
            await executor.kv["claims"].put("k1", b"claimed")
        await wait_for(lambda: _stream_messages(engine, ACTIONS, 0), 10)
        errors: list[str] = []
        cli = await _client(state, "cli", engine.url, errors)
        try:
            # Nor write state, nor forge a command event: changes go through the engine.
            for subject in (
                "gpuops.actions.node-001",
                "$KV.gpuops_control.silence.y",
                "gpuops.events.chatops.node-001",
                "gpuops.cmd.alice.approve",
            ):
                await cli.publish(subject, b"{}")
                await cli.flush()
                await wait_for(lambda s=subject: _violations(errors, s), 10)
        finally:
            await cli.close()
        await engine.kv["control"].put("silence.x", b"{}")
        async with open_bus(NatsSettings(), state, role="cli") as ops:
            assert ops.user == "operator"
            assert await ops.kv["control"].keys() == ["silence.x"]
            assert (await ops.js.stream_info(AUDIT)).state.messages == 1
        assert await _stream_messages(engine, ACTIONS, 0)


async def _stream_messages(bus: Bus, stream: str, count: int) -> bool:
    return (await bus.js.stream_info(stream)).state.messages == count


async def test_a_client_without_credentials_is_refused(tmp_path: Path) -> None:
    async with open_bus(NatsSettings(), tmp_path / "state") as bus:
        with pytest.raises(NatsError, match=r"(?i)authorization"):
            await nats.connect(bus.url, allow_reconnect=False, connect_timeout=2)


def test_kv_permissions_name_every_bucket() -> None:
    assert {*KV_BUCKETS, *ENGINE_ONLY} == {config.bucket for config in BUCKETS.values()}


async def test_only_the_engine_writes_the_chatops_replay_bucket(tmp_path: Path) -> None:
    # An executor or operator that could delete a seen request id would let a captured
    # ChatOps request be served again; both still open the bucket (their set-up does).
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as engine:
        assert await engine.buckets.replay.cas("slack.x", b"1", 0) is not None
        for role in ("executor", "cli"):
            errors: list[str] = []
            client = await _client(state, role, engine.url, errors)
            try:
                subject = f"$KV.{REPLAY}.slack.x"
                await client.publish(subject, b"")
                await client.flush()
                await wait_for(lambda e=errors, s=subject: _violations(e, s), 10)
            finally:
                await client.close()
        assert await engine.buckets.replay.get("slack.x") is not None, "still seen"


async def test_stream_limits_come_from_settings_and_update_existing_streams(
    nats_server: EmbeddedNats,
) -> None:
    bus = await connect(nats_server.url, NatsSettings())
    try:
        audit = (await bus.js.stream_info(AUDIT)).config
        assert audit.max_bytes == 8 << 30 and audit.max_age == 90 * 86400.0
        assert (await bus.js.stream_info(EVENTS)).config.max_bytes == 4 << 30
    finally:
        await bus.close()
    smaller = NatsSettings(
        audit_max_bytes=64 << 20, audit_max_age_s=3600, events_max_bytes=32 << 20
    )
    bus = await connect(nats_server.url, smaller)
    try:
        audit = (await bus.js.stream_info(AUDIT)).config
        assert audit.max_bytes == 64 << 20 and audit.max_age == 3600.0
        assert (await bus.js.stream_info(EVENTS)).config.max_bytes == 32 << 20
    finally:
        await bus.close()


async def test_the_audit_remembers_message_ids_as_long_as_an_intent_may_wait(
    nats_server: EmbeddedNats,
) -> None:
    default = Settings()
    bus = await connect(nats_server.url, default.nats)
    try:
        window = (await bus.js.stream_info(AUDIT)).config.duplicate_window
        assert window is not None and window >= default.safety.lock_lease_s
    finally:
        await bus.close()
    longer = Settings.model_validate({"safety": {"lock_lease_s": 7200}})
    bus = await connect(nats_server.url, longer.nats)  # the stream exists: it is updated
    try:
        assert (await bus.js.stream_info(AUDIT)).config.duplicate_window == 7200.0
        # The engine's record of a decision, and the executor's copy when it claims the
        # intent (an hour later, inside the window): one is stored.
        auditor = Auditor(JetStreamPublisher(bus.js))
        record = AuditRecord(type="decision", at=1.0, node="node-001", summary="d")
        await auditor.write(record, "decision-accepted-abc")
        await auditor.write(record, "decision-accepted-abc")
        assert (await bus.js.stream_info(AUDIT)).state.messages == 1
    finally:
        await bus.close()
    bus = await connect(nats_server.url, longer.nats)  # set up again: nothing changes
    try:
        info = await bus.js.stream_info(AUDIT)
        assert info.config.duplicate_window == 7200.0 and info.state.messages == 1
    finally:
        await bus.close()


async def test_telemetry_may_live_in_memory_and_a_stored_stream_says_how_to_move_it(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    on_file = await connect(nats_server.url, NatsSettings())
    try:
        config = (await on_file.js.stream_info(TELEMETRY)).config
        assert config.storage == StorageType.FILE and config.max_bytes == 1 << 30
    finally:
        await on_file.close()
    memory = NatsSettings(telemetry_storage="memory", telemetry_max_bytes=64 << 20)
    with pytest.raises(BusError, match="nats stream rm GPUOPS_TELEMETRY"):
        await connect(nats_server.url, memory)
    fresh = EmbeddedNats(tmp_path / "fresh").start()
    try:
        bus = await connect(fresh.url, memory)
        try:
            telemetry = (await bus.js.stream_info(TELEMETRY)).config
            assert telemetry.storage == StorageType.MEMORY and telemetry.max_bytes == 64 << 20
            events = (await bus.js.stream_info(EVENTS)).config
            assert events.storage == StorageType.FILE, "health events stay on file"
            await bus.js.publish("gpuops.telemetry.node-001", b"{}")
            assert (await bus.js.stream_info(TELEMETRY)).state.messages == 1
        finally:
            await bus.close()
    finally:
        fresh.stop()


async def test_the_dead_letter_stream_is_capped_and_drops_its_oldest_letters(
    nats_server: EmbeddedNats,
) -> None:
    bus = await connect(nats_server.url, NatsSettings())
    try:
        dlq = (await bus.js.stream_info(DLQ)).config
        assert dlq.max_bytes == 1 << 30 and dlq.max_age == 14 * 86400.0
        assert dlq.discard == DiscardPolicy.OLD
    finally:
        await bus.close()
    # Whoever can publish can send bad events: a flood past the cap keeps the newest.
    bus = await connect(nats_server.url, NatsSettings(dlq_max_bytes=1 << 20, dlq_max_age_s=3600))
    try:
        assert (await bus.js.stream_info(DLQ)).config.max_age == 3600.0
        letter = b"x" * (64 << 10)
        for n in range(40):
            await bus.js.publish(subjects.dlq("json"), letter + str(n).encode())
        state = (await bus.js.stream_info(DLQ)).state
        assert state.bytes <= 1 << 20 and state.first_seq > 1
        assert (await bus.js.get_msg(DLQ, state.last_seq)).data.endswith(b"39")
    finally:
        await bus.close()


async def test_a_stale_url_file_does_not_stop_an_engine_from_starting_its_own_server(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    url_file(state).write_text("nats://127.0.0.1:1")
    async with asyncio.timeout(30):
        async with open_bus(NatsSettings(), state) as bus:
            assert bus.server is not None and bus.url == bus.server.url


async def test_the_cli_never_starts_a_server_and_says_where_it_looked(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with pytest.raises(BusError, match=r"no engine running on state dir .*start `gpuops run"):
        async with open_bus(NatsSettings(), state, role="cli"):
            pass
    ensure_credentials(state)  # as an engine that died left them
    url_file(state).write_text("nats://127.0.0.1:1")
    with pytest.raises(BusError, match=r"cannot reach NATS at nats://127.0.0.1:1: .*nats.url"):
        async with open_bus(NatsSettings(), state, role="cli"):
            pass
    assert not (state / "nats").exists(), "no embedded server was started"


async def test_an_agent_without_a_url_finds_the_embedded_server_with_its_own_user(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    with pytest.raises(BusError, match="no NATS URL"):
        agent_endpoint(NatsSettings(), state)
    _enrol(state, "node-001")
    async with open_bus(NatsSettings(), state) as engine:
        url, credentials = agent_endpoint(NatsSettings(), state, "node-001")
        assert url == engine.url
        assert credentials is not None and credentials.user == "node:node-001"
        # No node: the source's user (the Prometheus source speaks for many nodes).
        source_url, source = agent_endpoint(NatsSettings(), state)
        assert source_url == engine.url and source is not None and source.user == "source"
        # A node the engine has not enrolled has no user: said, not guessed.
        with pytest.raises(BusError, match="node 'node-009' has no NATS user"):
            agent_endpoint(NatsSettings(), state, "node-009")
        nc = Client()
        inbox = subjects.node_inbox("node-001")
        await connect_forever(nc, url, NatsSettings(), credentials, "gpuops-agent-test", inbox)
        try:
            subject = "gpuops.events.heartbeat.node-001"
            headers = as_node(node_keys(state), subject, b"{}")
            ack = await nc.jetstream(timeout=5).publish(subject, b"{}", headers=headers)
            assert ack.stream == EVENTS
        finally:
            await nc.close()


async def test_a_restarted_engine_keeps_its_url_and_connected_clients_come_back(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as first:
        url = first.url
        # An agent, and a publisher that joined the engine's server (`simulate --run`).
        endpoint, credentials = agent_endpoint(NatsSettings(), state)
        agent = Client()
        inbox = subjects.inbox_of("source")
        await connect_forever(agent, endpoint, NatsSettings(), credentials, "agent-test", inbox)
        async with open_bus(NatsSettings(), state, name="simulate-test") as simulate:
            assert simulate.server is None and simulate.url == url, "joined, not started"
            await wait_for(lambda: agent.is_connected, 10)
            async with asyncio.timeout(120):
                await _restart_engine(state, first, url)
                async with open_bus(NatsSettings(), state) as second:
                    assert second.url == url, "the restarted engine's server has the old URL"
                    await wait_for(lambda: agent.is_connected and simulate.nc.is_connected, 30)
                    ack = await agent.jetstream(timeout=5).publish(
                        "gpuops.events.heartbeat.node-001", b"{}"
                    )
                    assert ack.stream == EVENTS
                    assert await _publish_acked(simulate, "gpuops.events.heartbeat.node-002")
        await agent.close()


async def _restart_engine(state: Path, engine: Bus, url: str) -> None:
    """Stop the first engine's server as its exit would (the clients stay)."""
    assert engine.server is not None
    await engine.close()
    await asyncio.to_thread(engine.server.stop)
    url_file(state).unlink(missing_ok=True)
    assert port_file(state).read_text() == url.rsplit(":", 1)[1]


async def test_a_configured_embedded_port_is_used(tmp_path: Path) -> None:
    port = free_port()
    async with open_bus(NatsSettings(embedded_port=port), tmp_path / "state") as bus:
        assert bus.url == f"nats://127.0.0.1:{port}"


async def test_the_cli_joins_the_embedded_server_by_its_url_without_setting_it_up(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as engine:
        # `--nats URL` naming the engine's own server: the state dir's operator, and only
        # opening what the engine made (the operator may not change streams).
        async with asyncio.timeout(8):
            async with open_bus(NatsSettings(url=engine.url), state, role="cli") as cli:
                assert cli.user == "operator" and set(cli.kv) == set(BUCKETS)


async def test_history_reads_a_stopped_engines_store_privately(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as engine:
        await engine.js.publish("gpuops.audit._fleet", b'{"note": 1}')
    async with open_bus(NatsSettings(), state, role="cli", stopped_store=True) as reader:
        assert (await reader.js.stream_info(AUDIT)).state.messages == 1
        assert not url_file(state).exists(), "nobody can take it for the engine's server"
        port = int(reader.url.rsplit(":", 1)[1])
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))  # the reader's server went with it
    with pytest.raises(BusError, match="no engine running"):
        async with open_bus(NatsSettings(), state, role="cli"):
            pass


async def test_a_role_that_opens_the_buckets_waits_for_the_engine_to_make_them(
    nats_server: EmbeddedNats,
) -> None:
    """Started together on a new NATS, an executor waits (bounded) for the buckets the
    engine makes, instead of exiting; with no engine at all it says so in time."""
    waiting = asyncio.create_task(
        connect(nats_server.url, NatsSettings(), setup="open", patience_s=30)
    )
    await asyncio.sleep(1.5)
    assert not waiting.done(), "it waits while the buckets are missing"
    engine = await connect(nats_server.url, NatsSettings(), setup="create")
    opened = await asyncio.wait_for(waiting, 15)
    try:
        assert set(opened.kv) == set(engine.kv)
    finally:
        await opened.close()
        await engine.close()


async def test_with_no_engine_a_role_that_opens_the_buckets_gives_up_naming_why(
    nats_server: EmbeddedNats,
) -> None:
    with pytest.raises(BusError, match=r"still missing after 2 s.*is an engine"):
        await connect(nats_server.url, NatsSettings(), setup="open", patience_s=2)
