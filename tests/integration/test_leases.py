"""Partition leases on a real nats-server: replicas share the partitions fairly, a
replica that stops renewing loses them to the others when its entries expire (the
server's clock), a clean stop hands them over at once, and a restarted replica takes
its own back without waiting."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from gpuops.bus.conn import Bus, connect
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.clock import SystemClock
from gpuops.scale.leases import Ownership, read_leases
from gpuops.settings import NatsSettings

from tests.conftest import wait_for

LEASE_S = 2.0
PARTITIONS = 8


class Replica:
    """An Ownership whose gains and losses are recorded."""

    def __init__(self, bus: Bus, name: str, lease_s: float = LEASE_S) -> None:
        self.gained: list[int] = []
        self.lost: list[int] = []
        self.ownership = Ownership(
            NatsKV(bus.kv["leases"]),
            name,
            PARTITIONS,
            lease_s,
            SystemClock(),
            self._gain,
            self._lose,
        )

    async def _gain(self, p: int) -> None:
        self.gained.append(p)

    async def _lose(self, p: int) -> None:
        self.lost.append(p)

    @property
    def held(self) -> set[int]:
        return set(self.ownership.held)


async def _bus(server: EmbeddedNats) -> Bus:
    return await connect(server.url, NatsSettings(lease_s=LEASE_S))


async def _rounds(*replicas: Replica, times: int = 3) -> None:
    for _ in range(times):
        for r in replicas:
            await r.ownership.round()


async def test_replicas_share_fairly_and_a_silent_one_loses_its_partitions(
    nats_server: EmbeddedNats,
) -> None:
    bus = await _bus(nats_server)
    try:
        a, b = Replica(bus, "a"), Replica(bus, "b")
        await _rounds(a)
        assert a.held == set(range(PARTITIONS)), "alone, a replica owns everything"
        await _rounds(a, b)
        assert len(a.held) == len(b.held) == PARTITIONS // 2 and not a.held & b.held
        handed = set(a.lost)
        assert handed == b.held, "b got exactly what a gave back"
        owners = await read_leases(NatsKV(bus.kv["leases"]), PARTITIONS)
        assert {p for p, (lease, _) in owners.items() if lease.owner == "b"} == b.held

        # b stops renewing (hung, or cut off): its entries expire on the server.
        silent = set(b.held)
        await asyncio.sleep(LEASE_S + 0.5)
        assert not any(b.ownership.holds(p) for p in silent), "b stopped deciding on its own"
        await _rounds(a, times=1)
        assert a.held == set(range(PARTITIONS)), "a took b's partitions after they expired"
        await b.ownership.round()  # b comes back: what it held is gone, nothing is taken twice
        assert not b.held & a.held
        assert set(b.lost) >= silent
    finally:
        await bus.close()


async def test_a_clean_stop_hands_over_at_once_and_a_restart_takes_its_own_back(
    nats_server: EmbeddedNats,
) -> None:
    bus = await _bus(nats_server)
    try:
        a, b = Replica(bus, "a"), Replica(bus, "b")
        await _rounds(a, b)
        await b.ownership.release_all()
        await _rounds(a, times=1)
        assert a.held == set(range(PARTITIONS)), "given back, taken without waiting for expiry"

        # a crashes (nothing given back) and starts again under the same name at once.
        again = Replica(bus, "a")
        await _rounds(again, times=1)
        assert again.held == set(range(PARTITIONS)), "its own leases, taken back at once"
    finally:
        await bus.close()


async def test_a_lease_taken_over_cannot_be_renewed_by_the_old_owner(
    nats_server: EmbeddedNats,
) -> None:
    bus = await _bus(nats_server)
    try:
        a = Replica(bus, "a")
        await _rounds(a, times=1)
        await asyncio.sleep(LEASE_S + 0.5)  # a paused past its lease (a stop-the-world)
        b = Replica(bus, "b")
        await _rounds(b, times=1)
        assert b.held == set(range(PARTITIONS))
        await wait_for(lambda: _renews(a), 5)
        assert a.held == set() and set(a.lost) == set(range(PARTITIONS))
        assert b.held == set(range(PARTITIONS)), "the new owner keeps them"
    finally:
        await bus.close()


async def _renews(r: Replica) -> bool:
    await r.ownership.round()
    return not r.held


async def test_a_lease_reads_back_with_the_epoch_it_was_taken_at_before_and_after_renewal(
    nats_server: EmbeddedNats,
) -> None:
    # The epoch names the owner's consumers; one taken a moment ago has not written it yet.
    bus = await _bus(nats_server)
    try:
        a = Replica(bus, "a")
        await a.ownership.round()
        taken = {p: held.epoch for p, held in a.ownership.held.items()}
        assert set(taken) == set(range(PARTITIONS))
        read = await read_leases(NatsKV(bus.kv["leases"]), PARTITIONS)
        assert {p: lease.epoch for p, (lease, _) in read.items()} == taken, "before renewal"
        await a.ownership.round()
        renewed = await read_leases(NatsKV(bus.kv["leases"]), PARTITIONS)
        assert {p: lease.epoch for p, (lease, _) in renewed.items()} == taken, "after"
        assert all(renewed[p][1] > read[p][1] for p in taken), "renewed: a newer revision"
    finally:
        await bus.close()


async def test_a_lease_loop_away_from_nats_for_less_than_a_lease_keeps_every_partition(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """NATS gone for a moment: the renewals fail with OutboundBufferLimitError (an engine's
    client sends now or not at all), the loop goes on, and once NATS is back the leases
    are renewed as they were: nothing given back, no new epoch, every one held."""
    lease_s = 20.0
    settings = NatsSettings(lease_s=lease_s)
    await (await connect(nats_server.url, settings)).close()  # the buckets, as an engine makes
    bus = await connect(nats_server.url, settings, setup="open", buffer=False)
    replica = Replica(bus, "a", lease_s)
    ownership, stop = replica.ownership, asyncio.Event()
    loop = asyncio.create_task(ownership.run(stop))
    try:
        await wait_for(lambda: replica.held == set(range(PARTITIONS)), 30)
        epochs = {p: held.epoch for p, held in ownership.held.items()}
        first = dict(ownership.held)
        renewed = {p: h.revision for p, h in first.items()}
        # Right after a round's renewals, so the outage fits in what is left of the lease.
        await wait_for(lambda: all(h.revision > renewed[p] for p, h in first.items()), 30, 0.02)
        with caplog.at_level(logging.WARNING, logger="gpuops.scale.leases"):
            nats_server.kill()
            await wait_for(lambda: "outbound buffer limit exceeded" in caplog.text, 15)
            assert not loop.done() and all(ownership.holds(p) for p in range(PARTITIONS))
            nats_server.start()  # the same port and store
            away = {p: h.revision for p, h in ownership.held.items()}
            await wait_for(
                lambda: all(h.revision > away[p] for p, h in ownership.held.items()), 30, 0.1
            )
        assert not loop.done(), "the lease loop goes on"
        assert replica.lost == [] and replica.held == set(range(PARTITIONS)), "nothing given up"
        assert all(ownership.holds(p) for p in range(PARTITIONS))
        assert {p: h.epoch for p, h in ownership.held.items()} == epochs, "the same leases"
        stored = await read_leases(NatsKV(bus.kv["leases"]), PARTITIONS)
        assert {p: (lease.owner, lease.epoch) for p, (lease, _) in stored.items()} == {
            p: ("a", e) for p, e in epochs.items()
        }
    finally:
        stop.set()
        await asyncio.wait_for(loop, 30)
        await bus.close()


class _LateAnswer:
    """The leases bucket, whose answer to the next renewal of partition 0 comes only at
    `until` (the loop's clock), its write done at once (a slow or electing server)."""

    def __init__(self, kv: NatsKV) -> None:
        self.kv, self.late = kv, 0
        self.until: float | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.kv, name)

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        done = await self.kv.cas(key, value, revision)
        if self.until is not None and key == "partition.0" and revision:
            until, self.until, self.late = self.until, None, self.late + 1
            await asyncio.sleep(until - time.monotonic())
        return done


async def test_a_renewal_answered_after_the_lease_ran_out_here_gives_the_lease_up(
    nats_server: EmbeddedNats,
) -> None:
    """Review of issue 30: such a renewal extended the lease, whose consumers had stopped
    when it ran out: the partition was held, renewed every round, and read by nobody
    (nor could another replica take it). Now it is given up and taken over afresh."""
    bus = await _bus(nats_server)
    try:
        kv = _LateAnswer(NatsKV(bus.kv["leases"]))
        a = Replica(bus, "a")
        a.ownership.kv = kv
        await _rounds(a, times=1)
        epoch = a.ownership.held[0].epoch
        # The others' renewals in the next round outlast partition 0's lease by this much.
        await asyncio.sleep(LEASE_S / 4)
        kv.until = a.ownership.held[0].valid_until + 0.1  # answered after it ran out here
        await a.ownership.round()
        assert kv.late == 1
        await wait_for(lambda: a.lost == [0], 5)  # given up, and only it
        await a.ownership.round()
        assert 0 in a.held and a.gained.count(0) == 2 and a.lost == [0], "taken over again"
        assert a.ownership.held[0].epoch > epoch, "a new lease, so new consumers"
    finally:
        await bus.close()
