"""Partitions: every event of a node lands in one partition, in order.

The streams map `gpuops.telemetry.<node>` to `gpuops.telemetry.<p>.<node>` and
`gpuops.events.<kind>.<node>` to `gpuops.events.<p>.<kind>.<node>` with NATS's
deterministic subject mapping `partition(N, node)`, applied by the server as it stores a
message: publishers do not know partitions exist. The server's hash is FNV-1a (32 bit)
of the node's subject token, modulo N; `partition_of` computes the same here, so a
replica knows which nodes it owns without asking.
"""

from __future__ import annotations

from nats.js.api import SubjectTransform

from gpuops import subjects

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def partition_of(node: str, partitions: int) -> int:
    """The partition of a node, as the NATS server computes it for its subject token."""
    h = _FNV_OFFSET
    for byte in subjects.token(node).encode():
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h % partitions


def telemetry_transform(partitions: int) -> SubjectTransform:
    """The telemetry stream's mapping: the partition goes before the node."""
    return SubjectTransform(
        src=subjects.TELEMETRY,
        dest=subjects.stored_telemetry_at(f"{{{{partition({partitions},1)}}}}", "{{wildcard(1)}}"),
    )


def events_transform(partitions: int) -> SubjectTransform:
    """The health events stream's mapping: the partition goes before the kind."""
    return SubjectTransform(
        src=subjects.EVENTS,
        dest=subjects.stored_event_at(
            f"{{{{partition({partitions},2)}}}}", "{{wildcard(1)}}", "{{wildcard(2)}}"
        ),
    )


def telemetry_filter(partition: int) -> str:
    """The stored subjects of one partition's samples."""
    return subjects.telemetry_partition(partition)


def events_filter(partition: int) -> str:
    """The stored subjects of one partition's health events."""
    return subjects.events_partition(partition)


def durable(telemetry: bool, partition: int, epoch: int | None = None) -> str:
    """The durable consumer of one partition of a stream, as made by the owner that took
    it at `epoch` (None: the name's stem, shared by every epoch's).

    Each owner makes its own, named by its epoch, from where the last one's ack floor
    stood: a replica that lost the partition cannot pull from, or ack on, the consumer
    of the one that has it now, since it does not know its name."""
    stem = f"gpuops-engine-{'telemetry' if telemetry else 'events'}-p{partition}"
    return stem if epoch is None else f"{stem}-e{epoch}"


def epoch_of(name: str, telemetry: bool, partition: int) -> int | None:
    """The epoch of a partition's consumer by its name; None: not one of the partition's."""
    rest = name.removeprefix(durable(telemetry, partition) + "-e")
    return int(rest) if rest != name and rest.isdigit() else None


def nodes_of(nodes: frozenset[str] | set[str], partition: int, partitions: int) -> set[str]:
    """The nodes of a set that fall in `partition`."""
    return {n for n in nodes if partition_of(n, partitions) == partition}
