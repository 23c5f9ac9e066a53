"""The KV buckets by purpose: the one place their names are written.

`BUCKETS` is how the engine creates them (history, TTL); `Buckets` is what the rest of
the engine holds, the buckets of a connected bus or in-memory ones (replay, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from nats.js.api import KeyValueConfig

from gpuops.bus.store import KV, MemoryKV, NatsKV

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

_DAY = 86400.0

LEASES_KEY = "leases"  # the one bucket whose entries expire (`NatsSettings.lease_s`)

# Each bucket by purpose, as JetStream creates it; `Buckets` below has a field per key.
BUCKETS: dict[str, KeyValueConfig] = {
    "claims": KeyValueConfig(bucket="gpuops_claims", history=1, ttl=30 * _DAY),
    "cooldowns": KeyValueConfig(bucket="gpuops_cooldowns", history=1, ttl=30 * _DAY),
    "nodes": KeyValueConfig(bucket="gpuops_nodes", history=5),
    "locks": KeyValueConfig(bucket="gpuops_locks", history=1),
    # silences, approvals, the breaker, runtime switches such as dry-run
    "control": KeyValueConfig(bucket="gpuops_control", history=5),
    # remediation history per node: attempt counts and ladder rungs (survives restarts)
    "history": KeyValueConfig(bucket="gpuops_history", history=1, ttl=30 * _DAY),
    # engine replicas and the partitions each owns; an entry not renewed expires (nats.lease_s)
    "leases": KeyValueConfig(bucket="gpuops_leases", history=1),
}


@dataclass(frozen=True, slots=True)
class Buckets:
    """The KV stores by purpose."""

    locks: KV
    cooldowns: KV
    history: KV
    control: KV
    nodes: KV
    claims: KV
    leases: KV

    @classmethod
    def of(cls, kv: dict[str, KeyValue]) -> Buckets:
        """The JetStream buckets a connection opened (`Bus.kv`)."""
        return cls(**{f.name: NatsKV(kv[f.name]) for f in fields(cls)})

    @classmethod
    def memory(cls) -> Buckets:
        """Fresh in-memory buckets."""
        return cls(**{f.name: MemoryKV() for f in fields(cls)})
