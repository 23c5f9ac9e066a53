"""Approval records: held decisions waiting for a person's approve or deny (ChatOps or
CLI), in the control bucket. The recorder opens them, people answer them, the pipeline
decides an approved one again (the stage that holds proposals is gpuops/decide/approval.py).

An approval record keeps the match. Approving does not write stored intents: the match
is decided again, approved, so it passes the lock, the breaker and every other stage at
the moment it would run.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store, together
from gpuops.errors import ConfigError, Contended, StateUnreadable
from gpuops.models import Decision, Match


class ApprovalStatus(StrEnum):
    """Where an approval stands."""

    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"
    EXECUTED = "executed"


SETTLED = frozenset({ApprovalStatus.DENIED, ApprovalStatus.EXPIRED, ApprovalStatus.EXECUTED})
# A settled record is deleted this long after its window closed (`expires`): `approve`
# still says what became of it meanwhile, and the audit trail keeps its history.
SETTLED_KEPT_S = 86400.0


class ApprovalRecord(BaseModel):
    """One held decision waiting for a person."""

    model_config = ConfigDict(frozen=True)

    id: str
    status: ApprovalStatus = ApprovalStatus.PENDING
    rule: str
    node: str
    key: str
    summary: str
    detail: str = ""
    match: Match
    closes_breaker: bool = False
    created: float
    expires: float
    by: str = ""
    decided_at: float | None = None

    @property
    def settled(self) -> bool:
        """Denied, expired or executed: nothing changes it any more."""
        return self.status in SETTLED


# An id is 64 bits of a hash of the held match (16 hex digits): 32 bits met another
# decision's id after some 65,000 events. Two matches that still meet take the next id
# of the match's own sequence, so a replay of either finds its own record again.
ID_HEX = 16
ID_PROBES = 4


def approval_id(d: Decision, probe: int = 0) -> str:
    """Derived from the held match, so a decision replayed after a crash opens it once;
    `probe` counts the ids this match found held by another match."""
    m = d.match
    again = f"|{probe}" if probe else ""
    return hashlib.sha256(f"{m.rule}|{m.key}|{m.event_id}{again}".encode()).hexdigest()[:ID_HEX]


def _if_absent(new: ApprovalRecord, old: ApprovalRecord | None) -> ApprovalRecord | None:
    """`new` where there is no record yet; the stored one stays."""
    return new if old is None else None


def _same_match(record: ApprovalRecord, d: Decision) -> bool:
    """Whether a stored record holds this decision's match (what its id is made of)."""
    m = record.match
    return (m.rule, m.key, m.event_id) == (d.match.rule, d.match.key, d.match.event_id)


class ApprovalStore:
    """Approval records in the control bucket under `approval.<id>`."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[ApprovalRecord] = Store(kv, ApprovalRecord, "approval")

    async def open(self, d: Decision, now: float, timeout_s: float) -> tuple[ApprovalRecord, bool]:
        """A pending approval for a held decision (the existing one when already open),
        and whether this call opened it (the decision made again finds it open).
        Contended when every id of the match is another match's (never in practice)."""
        for probe in range(ID_PROBES):
            record = self._record(d, approval_id(d, probe), now, timeout_s)
            stored = await self.store.update(functools.partial(_if_absent, record), record.id)
            if stored is record:
                return record, True
            if stored is not None and _same_match(stored, d):
                return stored, False  # the one found is another object
        raise Contended(self.store.key(approval_id(d)), ID_PROBES)

    @staticmethod
    def _record(d: Decision, ident: str, now: float, timeout_s: float) -> ApprovalRecord:
        """A new pending record of a held decision."""
        m = d.match
        plays = ", ".join(a.playbook for a in d.actions) or "nothing"
        return ApprovalRecord(
            id=ident,
            rule=m.rule,
            node=m.node,
            key=m.key,
            summary=f"{m.rule} on {m.key} would run {plays}",
            detail=d.detail,
            match=m,
            closes_breaker=d.closes_breaker,
            created=now,
            expires=now + timeout_s,
        )

    async def get(self, approval_id: str) -> ApprovalRecord | None:
        """One record."""
        record, _ = await self.store.get(approval_id)
        return record

    async def decide(self, approval_id: str, approve: bool, by: str, now: float) -> ApprovalRecord:
        """Approve or deny a pending approval; raise ConfigError saying why not."""
        record, rev = await self.store.get(approval_id)
        if record is None:
            raise ConfigError(f"no approval {approval_id!r}")
        if record.status is not ApprovalStatus.PENDING:
            raise ConfigError(f"approval {approval_id} is already {record.status.value}")
        if now >= record.expires:
            raise ConfigError(f"approval {approval_id} expired (a timeout is a deny)")
        status = ApprovalStatus.APPROVED if approve else ApprovalStatus.DENIED
        record = record.model_copy(update={"status": status, "by": by, "decided_at": now})
        if not await self.store.cas(record, rev, approval_id):
            raise ConfigError(f"approval {approval_id} changed meanwhile; look again")
        return record

    async def mark(self, record: ApprovalRecord, status: ApprovalStatus) -> bool:
        """Move a record on (executed, expired) if nobody changed it meanwhile."""

        def move(current: ApprovalRecord | None) -> ApprovalRecord | None:
            if current is None or current.status is not record.status:
                return None
            return current.model_copy(update={"status": status})

        stored = await self.store.update(move, record.id)
        return stored is not None and stored.status is status

    async def all(self) -> list[ApprovalRecord]:
        """Every approval record that decodes (one that does not approves nothing)."""
        found, _ = await self.store.readable()
        return [r for _, r in found]

    async def ids(self) -> list[str]:
        """The id of every record stored (one listing, no record read)."""
        keys = await self.store.kv.keys(self.store.prefix + ".")
        return [key.removeprefix(self.store.prefix + ".") for key in keys]

    async def read(self, ids: Iterable[str]) -> list[tuple[ApprovalRecord, int]]:
        """The records of `ids` that are there and decode, with their revisions."""
        wanted = list(ids)
        keys = [self.store.key(i) for i in wanted]
        entries = await together(*(self.store.kv.get(key) for key in keys))
        found: list[tuple[ApprovalRecord, int]] = []
        for key, entry in zip(keys, entries, strict=True):
            try:
                record, revision = self.store.decode(entry, key)
            except StateUnreadable:
                continue  # approves nothing; `state` names it for a repair
            if record is not None:
                found.append((record, revision))
        return found

    async def remove(self, approval_id: str, revision: int) -> bool:
        """Delete a settled record if nobody wrote it since `revision`."""
        return await self.store.delete(approval_id, revision=revision)
