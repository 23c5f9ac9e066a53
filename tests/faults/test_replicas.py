"""Issue 16, part 2: engine replicas on a three-server NATS cluster (R3 streams and KV),
each an engine process (`gpuops run --role engine`, no executor: every intent stays queued
to be counted) under its own replica id, with leases of LEASE_S seconds.

A replica killed under load, a replica cut off from NATS for longer than its lease, and a
replica killed while a `for:` window is open. Each is counted from the streams after:
every event published was decided (acked) once, none dead-lettered, every accepted
decision has its intents and no intent was stored twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from gpuops.bus.cluster import LocalCluster
from gpuops.bus.conn import Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.partitions import epoch_of, partition_of
from gpuops.bus.store import NatsKV
from gpuops.models import new_event, subject_for
from gpuops.record.audit import read_audit
from gpuops.scale.lag import acked, lags
from gpuops.scale.leases import read_leases
from gpuops.sim.fleet import SimFleet
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_for
from tests.faults.conftest import LEASE_S
from tests.faults.test_crash import PARTITIONS, Engine, assert_all_decided_once
from tests.support import as_node, free_port, node_keys

pytestmark = pytest.mark.faults

ROUND_S = LEASE_S / 3  # how often a replica renews and balances
# What a loaded two-core machine adds to a move: the survivors' KV round trips on an R3
# bucket and the takeover of each partition (warm the windows, re-make two durables).
MOVE_SLACK_S = 3.0


def replica(tmp: Path, url: str, fleet: SimFleet, rid: str, **env: str) -> Engine:
    """One engine replica (no executor) on the cluster's R3 streams, with short leases."""
    return Engine(
        tmp,
        url,
        fleet,
        "engine",
        name=rid,
        replica_id=rid,
        nats__replicas="3",
        nats__lease_s=str(LEASE_S),
        safety__breaker_share="1.0",
        safety__breaker_absolute="1000",
        safety__domain_budgets="{}",
        **env,
    )


def all_up(engines: dict[str, Engine]) -> bool:
    """Every replica still runs (one that exited fails the test, saying why)."""
    return all(engine.running() for engine in engines.values())


async def owners(bus: Bus) -> dict[int, str]:
    """Partition -> the replica whose lease is in the bucket now."""
    leases = await read_leases(NatsKV(bus.kv["leases"]), PARTITIONS)
    return {p: lease.owner for p, (lease, _) in leases.items()}


async def shared_out(bus: Bus, ids: set[str]) -> bool:
    """Every partition is held, only by `ids`, none of them over its fair share (so each
    holds some), and every partition's events durable is there to be read."""
    try:
        held = await owners(bus)
        durables = [lag.exists for lag in await lags(bus.js, False, PARTITIONS)]
    except (NatsError, JsError, TimeoutError):
        return False
    counts = [list(held.values()).count(r) for r in ids]
    share = math.ceil(PARTITIONS / len(ids))
    return (
        len(held) == PARTITIONS
        and set(held.values()) <= ids
        and max(counts) <= share
        and all(durables)
    )


def replica_keys(tmp: Path) -> KeyRing:
    """The keys of the replicas' shared state dir, its identity key made before any
    replica starts (so that they all read one key, none of them racing to make it)."""
    return node_keys(tmp / "state")


async def publish_xid(bus: Bus, keys: KeyRing, node: str, gpu: int) -> None:
    """Publish one XID 48 event, signed as the node's agent; while the stream elects a
    leader, the same message again (its Nats-Msg-Id makes the stream store it once)."""
    event = new_event("xid", node, time.time(), {"gpu": gpu, "xid": 48}, "test")
    subject, data = subject_for("xid", node), json.dumps(event).encode()
    headers = as_node(keys, subject, data, event["id"])
    for _ in range(120):
        try:
            await bus.js.publish(subject, data, headers=headers, timeout=2)
            return
        except (NatsError, JsError, TimeoutError):
            await asyncio.sleep(0.25)
    raise AssertionError("the cluster never took the event back")


@dataclass
class Load:
    """XID 48 events published without pause across the fleet, each stored once."""

    bus: Bus
    keys: KeyRing  # the nodes' agents' keys: each event signed as its node
    nodes: list[str]
    every_s: float = 0.15
    published: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            i = self.published
            node = self.nodes[i % len(self.nodes)]
            await publish_xid(self.bus, self.keys, node, i // len(self.nodes) % 8)
            self.published += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.every_s)

    async def stop(self) -> int:
        """Stop publishing; how many events were stored."""
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.published


async def decided_at_least(bus: Bus, n: int) -> bool:
    """The replicas have decided and acked `n` events (they are at work)."""
    try:
        return await acked(bus.js, False, PARTITIONS) >= n
    except (NatsError, JsError, TimeoutError):
        return False


async def handed_over_and_drained(bus: Bus) -> bool:
    """Every partition is read from its owner's consumer (no takeover still making its
    own), and that consumer has had every event of the partition decided and acked."""
    try:
        leases = await read_leases(NatsKV(bus.kv["leases"]), PARTITIONS)
        parts = await lags(bus.js, False, PARTITIONS)
    except (NatsError, JsError, TimeoutError):
        return False
    epochs = {p: lease.epoch for p, (lease, _) in leases.items()}
    return all(
        lag.drained and epoch_of(lag.durable, False, lag.partition) == epochs.get(lag.partition)
        for lag in parts
    )


async def settle(bus: Bus) -> None:
    """Until every partition's events are decided and acked by its owner's consumer."""
    await wait_for(lambda: handed_over_and_drained(bus), 90, 0.5)


async def one_decision_per_event(bus: Bus) -> list[dict[str, Any]]:
    """The audit's decisions: no event accepted twice (two replicas deciding one event),
    and no verdict on an event recorded twice. An event redelivered after a crash may be
    decided again differently (dropped while locked, accepted once the lock is free); both
    are recorded, and `assert_all_decided_once` ties the intents to the acceptance."""
    decisions = [r.body["decision"] async for r in read_audit(bus.js) if r.type == "decision"]
    verdicts = [
        (d["match"]["rule"], d["match"]["key"], d["match"]["event_id"], d["reason"])
        for d in decisions
    ]
    assert len(verdicts) == len(set(verdicts)), "a verdict on an event was recorded twice"
    accepted = [v[:3] for v in verdicts if v[3] == "accepted"]
    assert len(accepted) == len(set(accepted)), "an event was accepted twice"
    return decisions


def started(tmp_path: Path, bus: Bus, url: str, ids: str) -> tuple[dict[str, Engine], Load]:
    """A replica per id started on 12 simulated nodes x 8 GPUs, and the load for them."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=12, gpus=8)
    keys = replica_keys(tmp_path)
    engines = {rid: replica(tmp_path, url, fleet, rid) for rid in ids}
    for engine in engines.values():
        engine.start()
    return engines, Load(bus, keys, fleet.nodes)


async def at_work(bus: Bus, engines: dict[str, Engine], load: Load) -> None:
    """Every replica holds its share (the faults land on running replicas, not on ones
    still setting up), and the load is being decided."""
    await wait_for(lambda: all_up(engines) and shared_out(bus, set(engines)), 90, 0.5)
    load.start()
    await wait_for(lambda: decided_at_least(bus, 20), 60, 0.5)


async def stop_all(engines: dict[str, Engine]) -> None:
    """Stop every replica, the event loop running meanwhile (it runs the test's proxy)."""
    await asyncio.gather(*(asyncio.to_thread(e.stop) for e in engines.values()))


async def test_kill_9_of_a_replica_under_load_moves_its_partitions_and_loses_nothing(
    tmp_path: Path, cluster: LocalCluster, cluster_bus: Bus
) -> None:
    bus = cluster_bus
    engines, load = started(tmp_path, bus, cluster.url, "abc")
    try:
        await at_work(bus, engines, load)
        held = await owners(bus)
        victim = max(engines, key=lambda r: list(held.values()).count(r))
        engines[victim].kill()
        killed = time.monotonic()
        survivors = set(engines) - {victim}
        seen: list[tuple[float, dict[int, str]]] = []  # what the leases said, when

        async def look() -> bool:
            with contextlib.suppress(NatsError, JsError, TimeoutError):
                seen.append((time.monotonic() - killed, await owners(bus)))
            return await shared_out(bus, survivors)

        async def moved() -> bool:
            # A read the cluster answers only at its 10 s timeout (a consumer deleted under
            # it by the takeover) is "not yet": the next poll looks again, so the time
            # measured is the replicas', not one slow answer's.
            try:
                return await asyncio.wait_for(look(), 1.0)
            except TimeoutError:
                return False

        await wait_for(moved, 30, 0.05)
        moved_s = time.monotonic() - killed
        print(f"partitions of replica {victim} moved to {sorted(survivors)} in {moved_s:.2f}s")
        # Should it take longer, the failure says whether the leases moved late or the
        # rest of `shared_out` (fair shares, the new owners' consumers) came late.
        taken = next((t for t, held in seen if set(held.values()) <= survivors), None)
        lease_moves = [(round(t, 1), held) for t, held in seen[-3:]]
        await asyncio.sleep(ROUND_S)  # the survivors decide the new owners' events a while
        published = await load.stop()
        await settle(bus)
        # Counted while the replicas run: stopping them all at once races their takeovers
        # (a partition one gives back taken by another that is stopping too), which can
        # leave a newer consumer behind, made from a floor below what was decided.
        await assert_all_decided_once(bus, published)
    finally:
        await load.stop()
        await stop_all(engines)

    assert moved_s <= LEASE_S + ROUND_S + MOVE_SLACK_S, (
        f"moved within a lease and a round (leases all survivors' after {taken} s; "
        f"the last reads: {lease_moves})"
    )
    await one_decision_per_event(bus)


class Proxy:
    """A TCP relay to one NATS member that can be cut: every connection dropped and new
    ones closed as they come, as a network partition looks to a client."""

    def __init__(self, target_url: str) -> None:
        self.target = urlsplit(target_url).port or 4222
        self.cut = False
        self.port = 0
        self._links: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._links |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass
        finally:
            # One way ends: the other ends with it, as a TCP connection does.
            writer.transport.abort()
            self._links.discard(writer)

    def cut_off(self) -> None:
        """Drop every connection and refuse new ones."""
        self.cut = True
        for link in list(self._links):
            link.transport.abort()
        self._links.clear()

    def restore(self) -> None:
        self.cut = False

    async def close(self) -> None:
        self.cut_off()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def metric(port: int, name: str) -> float:
    """A replica's metric (summed over its labels), from its /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def decisions_made(port: int) -> float:
    """How many decisions a replica has made."""
    return await metric(port, "gpuops_decisions_total")


@pytest.mark.slow  # a lease's time cut off, then back: `make test-slow`
async def test_a_replica_cut_off_for_longer_than_its_lease_decides_nothing_it_lost(
    tmp_path: Path, cluster: LocalCluster, cluster_bus: Bus
) -> None:
    bus, fleet = cluster_bus, SimFleet.create(tmp_path / "sim", nodes=12, gpus=8)
    # The cut replica knows one member, through the proxy, and no other (no_advertise).
    proxy = await Proxy(cluster.members[0].url).start()
    http = free_port()
    engines = {rid: replica(tmp_path, cluster.url, fleet, rid) for rid in ("a", "b")}
    engines["c"] = replica(tmp_path, proxy.url, fleet, "c", http=f"127.0.0.1:{http}")
    load = Load(bus, replica_keys(tmp_path), fleet.nodes)
    for engine in engines.values():
        engine.start()
    began = time.monotonic()
    try:
        await wait_for(lambda: all_up(engines) and shared_out(bus, set(engines)), 90, 0.5)
        print(f"replicas up in {time.monotonic() - began:.2f}s")
        load.start()
        await wait_for(lambda: decided_at_least(bus, 20), 60, 0.5)
        proxy.cut_off()
        cut = time.monotonic()
        await wait_for(lambda: shared_out(bus, {"a", "b"}), 30, 0.1)
        print(f"the survivors held replica c's partitions {time.monotonic() - cut:.2f}s after")
        # Nothing the cut replica had in hand can be decided without NATS; from here on,
        # until it holds a lease again, it must decide nothing at all.
        before = await decisions_made(http)

        async def noticed() -> bool:  # that it holds nothing, before NATS is back
            return await metric(http, "gpuops_partitions_held") == 0

        await wait_for(noticed, 30, 0.2)
        print(f"replica c knew it held nothing {time.monotonic() - cut:.2f}s after the cut")
        # Its leases ran out a lease after its last renewal, which was up to a round before
        # the cut: all of that can be over before a lease has passed since the cut. The cut
        # lasts longer than a lease all the same.
        await asyncio.sleep(max(0.0, cut + LEASE_S + ROUND_S - time.monotonic()))
        assert await metric(http, "gpuops_partitions_held") == 0, "still holds nothing"
        assert await decisions_made(http) == before, "decided nothing while cut off"
        proxy.restore()

        async def back_with_a_fair_share() -> bool:
            made = await decisions_made(http)  # read first: a lease seen after is newer
            if "c" not in (await owners(bus)).values():
                assert made == before, "the cut replica decided while it held no partition"
                return False
            return await shared_out(bus, set(engines))

        restored = time.monotonic()
        await wait_for(back_with_a_fair_share, 60, 0.1)
        print(f"replica c back with a fair share {time.monotonic() - restored:.2f}s after")
        published = await load.stop()
        t = time.monotonic()
        await settle(bus)
        # Counted while the replicas run: stopping them all at once races their takeovers
        # (a partition one gives back taken by another that is stopping too), which can
        # leave a newer consumer behind, made from a floor below what was decided.
        await assert_all_decided_once(bus, published)
        print(f"{published} events, settled in {time.monotonic() - t:.2f}s")
    finally:
        await load.stop()
        await stop_all(engines)
        await proxy.close()

    await one_decision_per_event(bus)


HOT_RULE = """\
rules:
  # Hot for 20 s by the samples' times: fires once, on the sample 20 s after the first hot one.
  - name: gpu-hot
    description: GPU core at 85 C or more for 20 seconds
    on: telemetry
    group_by: [node, gpu]
    when: temp_c >= 85
    for: 20s
    severity: critical
    cooldown: 30m
    actions:
      - playbook: drain.yml
        vars: {reason: "GPU {{ gpu }} hot"}
"""


async def _publish_sample(
    bus: Bus, keys: KeyRing, fleet: SimFleet, node: str, t: float
) -> tuple[int, str]:
    """One sample of the node with GPU 0 hot, signed as its agent; its stream sequence and
    event id."""
    event = fleet.telemetry(node, t)
    assert event is not None
    event["data"]["gpus"][0]["temp_c"] = 88.0
    subject, data = subject_for("telemetry", node), json.dumps(event).encode()
    ack = await bus.js.publish(subject, data, headers=as_node(keys, subject, data), timeout=5)
    return ack.seq, str(event["id"])


@pytest.mark.slow  # two replicas and a takeover: `make test-slow`
async def test_a_takeover_mid_window_fires_the_rule_once_at_its_event_time(
    tmp_path: Path, cluster: LocalCluster, cluster_bus: Bus
) -> None:
    bus, fleet = cluster_bus, SimFleet.create(tmp_path / "sim", nodes=4, gpus=8)
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "hot.yml").write_text(HOT_RULE)
    keys = replica_keys(tmp_path)
    engines = {rid: replica(tmp_path, cluster.url, fleet, rid, rules=rules) for rid in "ab"}
    node = fleet.nodes[0]
    p = partition_of(node, PARTITIONS)
    t0 = float(int(time.time()) - 40)  # 1 Hz event times, within the engine's horizon
    for engine in engines.values():
        engine.start()
    try:
        await wait_for(lambda: all_up(engines) and shared_out(bus, set(engines)), 90, 0.5)
        owner = (await owners(bus))[p]
        ids = []
        for k in range(8):
            seq, event_id = await _publish_sample(bus, keys, fleet, node, t0 + k)
            ids.append(event_id)

        async def acked_up_to(last: int) -> bool:
            try:
                return (await lags(bus.js, True, PARTITIONS))[p].ack_floor >= last
            except (NatsError, JsError, TimeoutError):  # the cluster busy electing
                return False

        await wait_for(lambda: acked_up_to(seq), 30, 0.1)
        engines[owner].kill()  # 7 s into the 20 s window
        for k in range(8, 31):
            seq, event_id = await _publish_sample(bus, keys, fleet, node, t0 + k)
            ids.append(event_id)

        await wait_for(lambda: acked_up_to(seq), 60, 0.2)
        survivor = (await owners(bus)).get(p)
    finally:
        await stop_all(engines)

    assert survivor is not None and survivor != owner, "the partition moved to the survivor"
    decisions = [
        r.body["decision"]
        async for r in read_audit(bus.js, node)
        if r.type == "decision" and r.rule == "gpu-hot"
    ]
    # A condition held keeps matching each sample after it fired; the cooldown drops
    # those (the audit keeps the first drop). Fired means accepted: once.
    fired = [d["match"] for d in decisions if d["accepted"]]
    assert len(fired) == 1, f"the rule fired once, not {len(fired)} times"
    assert fired[0]["event_ts"] == t0 + 20, "on the sample 20 s after the first hot one"
    assert fired[0]["event_id"] == ids[20]
    later = [d for d in decisions if not d["accepted"]]
    assert all(d["reason"] == "cooldown" for d in later), "what matched after was held back"
    assert all(d["match"]["event_ts"] > t0 + 20 for d in later), "nothing matched early"
