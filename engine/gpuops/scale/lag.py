"""How far the replicas are behind, per partition: for status, tests and the soak tally."""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from gpuops.bus.conn import EVENTS, TELEMETRY
from gpuops.bus.partitions import durable, epoch_of, events_filter, telemetry_filter
from gpuops.bus.store import KV
from gpuops.scale.leases import read_leases, read_replicas
from gpuops.scale.takeover import all_consumers

_PARTITIONS = re.compile(r"partition\((\d+),")


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition of one stream: what its consumer has not delivered or not had acked."""

    partition: int
    durable: str
    exists: bool
    pending: int = 0  # stored, not yet delivered
    ack_pending: int = 0  # delivered, not yet acked
    ack_floor: int = 0  # stream sequence up to which all is acked
    delivered: int = 0  # stream sequence of the last delivery
    messages: int = 0  # what the stream holds of the partition
    last: int = 0  # stream sequence of the partition's newest message (0: none)

    @property
    def drained(self) -> bool:
        """Every message of the partition was handled (or there is none): its consumer
        has gone past the newest one and has nothing delivered unacked.

        Past the newest, not only nothing pending: on a cluster the consumer counts from
        the stream's copy on its own server, which can be a follower a few messages
        behind the acked publish (a quorum stored it, not yet every copy). `last` comes
        from the stream's leader."""
        if not self.messages:
            return True
        return (
            self.exists and self.delivered >= self.last and not (self.pending or self.ack_pending)
        )


async def lags(js: JetStreamContext, telemetry: bool, partitions: int) -> list[PartitionLag]:
    """Every partition's lag on the telemetry or the health events stream, read from the
    consumer of its newest owner."""
    stream = TELEMETRY if telemetry else EVENTS
    newest: dict[int, tuple[int, ConsumerInfo]] = {}
    for info in await all_consumers(js, stream):
        for p in _partition_of_name(info.name or "", telemetry, partitions):
            epoch = epoch_of(info.name or "", telemetry, p)
            if epoch is not None and epoch >= newest.get(p, (-1, info))[0]:
                newest[p] = (epoch, info)
    stored = await asyncio.gather(
        *(
            _stored(js, stream, telemetry_filter(p) if telemetry else events_filter(p))
            for p in range(partitions)
        )
    )
    out = []
    for p, (messages, last) in enumerate(stored):
        if p not in newest:
            out.append(PartitionLag(p, durable(telemetry, p), False, messages=messages, last=last))
            continue
        info = newest[p][1]
        out.append(
            PartitionLag(
                p,
                info.name or "",
                True,
                pending=info.num_pending or 0,
                ack_pending=info.num_ack_pending or 0,
                ack_floor=int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0,
                delivered=int(info.delivered.stream_seq or 0) if info.delivered else 0,
                messages=messages,
                last=last,
            )
        )
    return out


def _partition_of_name(name: str, telemetry: bool, partitions: int) -> list[int]:
    stem = durable(telemetry, 0).removesuffix("0")  # "gpuops-engine-events-p"
    head = name.removeprefix(stem).split("-", 1)[0]
    return [int(head)] if head.isdigit() and int(head) < partitions else []


async def _stored(js: JetStreamContext, stream: str, subject: str) -> tuple[int, int]:
    """How many messages the stream holds of a partition, and the newest one's sequence."""
    count, newest = await asyncio.gather(_count(js, stream, subject), _newest(js, stream, subject))
    return count, newest


async def _count(js: JetStreamContext, stream: str, subject: str) -> int:
    with contextlib.suppress(NotFoundError):
        info = await js.stream_info(stream, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    return 0


async def _newest(js: JetStreamContext, stream: str, subject: str) -> int:
    with contextlib.suppress(NotFoundError):  # none stored (or the stream is not there)
        return int((await js.get_last_msg(stream, subject)).seq or 0)
    return 0


async def drained(js: JetStreamContext, telemetry: bool, partitions: int) -> bool:
    """Every partition of the stream handled everything stored."""
    return all(lag.drained for lag in await lags(js, telemetry, partitions))


async def acked(js: JetStreamContext, telemetry: bool, partitions: int) -> int:
    """Messages handled and acked, over all partitions (see `handled`)."""
    return handled(await lags(js, telemetry, partitions))


def handled(parts: list[PartitionLag]) -> int:
    """Messages handled and acked (exact for drained partitions; for the others, what is
    stored minus what is not delivered or not acked)."""
    return sum(max(0, lag.messages - lag.pending - lag.ack_pending) for lag in parts)


async def partition_count(js: JetStreamContext) -> int:
    """How many partitions the telemetry stream is split into (1 when it is not)."""
    config = (await js.stream_info(TELEMETRY)).config
    found = _PARTITIONS.search(config.subject_transform.dest if config.subject_transform else "")
    return int(found.group(1)) if found else 1


async def replica_view(js: JetStreamContext, leases: KV) -> dict[str, Any]:
    """The replicas, which partitions each owns, and each partition's lag (for status)."""
    count = await partition_count(js)
    owners = {p: lease.owner for p, (lease, _) in (await read_leases(leases, count)).items()}
    events, telemetry = await lags(js, False, count), await lags(js, True, count)
    return {
        "replicas": [r.model_dump() for r in (await read_replicas(leases)).values()],
        "partitions": [
            {
                "partition": p,
                "owner": owners.get(p),
                "events_lag": events[p].pending + events[p].ack_pending,
                "telemetry_lag": telemetry[p].pending + telemetry[p].ack_pending,
            }
            for p in range(count)
        ],
    }


def render_replicas(view: dict[str, Any]) -> list[str]:
    """Status lines: each replica with its partitions, partitions nobody owns, the lag."""
    parts = view.get("partitions", [])
    lines = [f"replicas: {len(view.get('replicas', []))} over {len(parts)} partitions"]
    for r in sorted(view.get("replicas", []), key=lambda r: r["id"]):
        owned = [p["partition"] for p in parts if p["owner"] == r["id"]]
        lag = sum(p["events_lag"] + p["telemetry_lag"] for p in parts if p["owner"] == r["id"])
        listed = ",".join(map(str, owned)) or "none"
        lines.append(f"  {r['id']} ({r['host']} pid {r['pid']}): partitions {listed}; lag {lag}")
    orphans = [str(p["partition"]) for p in parts if p["owner"] is None]
    if orphans:
        lines.append(f"  not owned (waiting for a replica): {','.join(orphans)}")
    behind = sorted(parts, key=lambda p: -(p["events_lag"] + p["telemetry_lag"]))[:3]
    if behind and behind[0]["events_lag"] + behind[0]["telemetry_lag"]:
        lines.append(
            "  most behind: "
            + ", ".join(
                f"p{p['partition']} events {p['events_lag']} telemetry {p['telemetry_lag']}"
                for p in behind
            )
        )
    return lines
