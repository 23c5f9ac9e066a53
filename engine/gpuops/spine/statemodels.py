"""Which record type each stored key holds: what a repair validates a new value against.

Every `Store(kv, Model, prefix)` of the engine appears here as (bucket, prefix) ->
Model (tests/unit/spine/test_statemodels.py reads the package to hold it so). Keys
are `prefix.parts...`; the longest prefix that matches names the record.
"""

from __future__ import annotations

from pydantic import BaseModel

from gpuops.act.executor import Claim
from gpuops.decide.breaker import BreakerRecord
from gpuops.decide.cooldown import Firing
from gpuops.decide.correlate import DomainFaults
from gpuops.decide.domains import DomainRecord
from gpuops.decide.equivalence import Heavy
from gpuops.decide.gates import Switch
from gpuops.decide.history import AttemptLog
from gpuops.decide.lock import LockRecord
from gpuops.decide.silence import Silence
from gpuops.intake.alertmanager import AlertSeen
from gpuops.intake.scheduler import SlotClaim
from gpuops.ops.heartbeat import Heartbeat
from gpuops.power.budgets import BudgetOverride
from gpuops.power.engine import NodeAllocation
from gpuops.record.approvals import ApprovalRecord
from gpuops.record.episodes import Episode
from gpuops.record.nodestate import NodeRecord

STATE_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("locks", "node"): LockRecord,
    ("cooldowns", "cooldown"): Firing,
    ("history", "attempts"): AttemptLog,
    ("history", "ladder"): AttemptLog,
    ("history", "heavy"): Heavy,
    ("history", "alert"): AlertSeen,
    ("control", "switch"): Switch,
    ("control", "breaker"): BreakerRecord,
    ("control", "domain"): DomainRecord,
    ("control", "correlate"): DomainFaults,
    ("control", "silence"): Silence,
    ("control", "approval"): ApprovalRecord,
    ("control", "heartbeat"): Heartbeat,
    ("control", "power.override"): BudgetOverride,
    ("control", "power.alloc"): NodeAllocation,
    ("control", "drift.slot"): SlotClaim,
    ("nodes", "state"): NodeRecord,
    ("nodes", "episode"): Episode,
    ("claims", "intent"): Claim,
}


def model_of(bucket: str, key: str) -> type[BaseModel] | None:
    """The record type `key` holds in `bucket`; None for a key no store reads."""
    found = [
        (len(prefix), model)
        for (b, prefix), model in STATE_MODELS.items()
        if b == bucket and key.startswith(prefix + ".")
    ]
    return max(found, key=lambda f: f[0])[1] if found else None
