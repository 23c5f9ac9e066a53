"""The typed stores over the KV buckets, one set per process.

The engine's stages and the commands people run (CLI, ChatOps, console) read and change
the same objects: `build_engine` makes this set and `Commands` receives it; nothing else
opens a store from a bucket of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import Publisher
from gpuops.bus.store import Store
from gpuops.clock import Clock
from gpuops.decide.breaker import BreakerStore
from gpuops.decide.gates import DryRunSwitch
from gpuops.decide.lock import NodeLocks
from gpuops.decide.silence import SilenceStore
from gpuops.record.approvals import ApprovalStore
from gpuops.record.audit import Auditor
from gpuops.record.episodes import Episode, episode_records
from gpuops.record.metrics import Metrics
from gpuops.record.nodestate import NodeStates
from gpuops.record.unreadable import UnreadableState


@dataclass(frozen=True, slots=True)
class Stores:
    """Every store people and loops act on, over one set of buckets."""

    buckets: Buckets
    auditor: Auditor
    approvals: ApprovalStore
    silences: SilenceStore
    breaker: BreakerStore
    states: NodeStates
    locks: NodeLocks
    dry_run: DryRunSwitch
    episodes: Store[Episode]
    unreadable: UnreadableState  # records met that do not decode (gpuops.record.unreadable)

    @classmethod
    def over(
        cls,
        buckets: Buckets,
        publisher: Publisher,
        dry_run: bool = False,
        metrics: Metrics | None = None,
        clock: Clock | None = None,
    ) -> Stores:
        """The stores of these buckets; audit records go out through `publisher`."""
        unreadable = UnreadableState(metrics, clock)
        return cls(
            buckets=buckets,
            auditor=Auditor(publisher),
            approvals=ApprovalStore(buckets.control),
            silences=SilenceStore(buckets.control),
            breaker=BreakerStore(buckets.control),
            states=NodeStates(buckets.nodes),
            locks=NodeLocks(buckets.locks),
            dry_run=DryRunSwitch(buckets.control, dry_run, unreadable),
            episodes=episode_records(buckets.nodes),
            unreadable=unreadable,
        )
