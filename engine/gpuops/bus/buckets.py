"""The KV buckets by purpose: the one place their names are written.

`BUCKETS` is how the engine creates them (history, TTL); `Buckets` is what the rest of
the engine holds, the buckets of a connected bus or in-memory ones (replay, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from nats.js.api import KeyValueConfig

from gpuops.bus.store import KV, MemoryKV, NatsKV
from gpuops.settings import MAX_SKEW_S

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

_DAY = 86400.0

LEASES_KEY = "leases"  # entries expire `NatsSettings.lease_s` after their last write
REPLAY_KEY = "replay"  # ChatOps request ids seen; written by engines only (bus.auth)
# A signed request is fresh for `max_skew_s` either side of its timestamp: its id is kept
# as long as the largest window allows, by the server's clock, so every engine sharing
# the bucket refuses it again within its window (a later one is refused as stale).
REPLAY_TTL_S = 2 * MAX_SKEW_S
FACTS_KEY = "facts"

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
    # ChatOps requests already served (Slack, Mattermost): the first engine to create a
    # request's key serves it, any other refuses it as a replay
    REPLAY_KEY: KeyValueConfig(bucket="gpuops_replay", history=1, ttl=REPLAY_TTL_S),
    # each node's telemetry v2 static facts (gpuops.intake.compact), written by engines
    # only: a replica taking a partition over joins its samples to them
    FACTS_KEY: KeyValueConfig(bucket="gpuops_facts", history=1),
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
    replay: KV
    facts: KV

    @classmethod
    def of(cls, kv: dict[str, KeyValue]) -> Buckets:
        """The JetStream buckets a connection opened (`Bus.kv`)."""
        return cls(**{f.name: NatsKV(kv[f.name], f.name) for f in fields(cls)})

    def by_name(self) -> dict[str, KV]:
        """Each bucket under its purpose (what errors and repairs call it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def memory(cls) -> Buckets:
        """Fresh in-memory buckets."""
        return cls(**{f.name: MemoryKV(f.name) for f in fields(cls)})
