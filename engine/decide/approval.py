"""Stage and store: approvals. Rules or rungs marked `approval: required` wait for a
person's approve or deny (ChatOps or CLI); no answer before the timeout is a deny.

An approval record holds the intents that would be written, so approving writes them
exactly as decided.
"""

from __future__ import annotations

import secrets
from typing import Any

from nats.js.kv import KeyValue

from engine.bus.kvjson import cas_json, get_json, keys, put_json
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.errors import ConfigError

PENDING, APPROVED, DENIED, EXPIRED, EXECUTED = (
    "pending",
    "approved",
    "denied",
    "expired",
    "executed",
)


class ApprovalGate(BaseStage):
    """Marks proposals of rules that require approval; the decider then holds them."""

    name = "approval"

    async def check(self, p: Proposal) -> Drop | None:
        if p.rule.approval:
            p.approval = True
            p.notes.append(f"rule {p.rule.name} requires approval")
        return None


class ApprovalStore:
    """Approval records in the control bucket under `approval.<id>`."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def create(self, body: dict[str, Any], now: float, timeout_s: float) -> str:
        """A pending approval; returns its id."""
        approval_id = secrets.token_hex(3)
        record = {
            **body,
            "id": approval_id,
            "status": PENDING,
            "created": now,
            "expires": now + timeout_s,
        }
        await put_json(self.kv, f"approval.{approval_id}", record)
        return approval_id

    async def get(self, approval_id: str) -> tuple[dict[str, Any] | None, int]:
        """One record and its revision."""
        return await get_json(self.kv, f"approval.{approval_id}")

    async def decide(self, approval_id: str, approve: bool, by: str, now: float) -> dict[str, Any]:
        """Approve or deny a pending approval; raise ConfigError saying why not."""
        record, rev = await self.get(approval_id)
        if record is None:
            raise ConfigError(f"no approval {approval_id!r}")
        if record["status"] != PENDING:
            raise ConfigError(f"approval {approval_id} is already {record['status']}")
        if now >= record["expires"]:
            raise ConfigError(f"approval {approval_id} expired (a timeout is a deny)")
        record = {**record, "status": APPROVED if approve else DENIED, "by": by, "decided_at": now}
        if not await cas_json(self.kv, f"approval.{approval_id}", record, rev):
            raise ConfigError(f"approval {approval_id} changed meanwhile; look again")
        return record

    async def mark(self, record: dict[str, Any], status: str, rev: int) -> bool:
        """Move a record on (executed, expired) if nobody changed it meanwhile."""
        return await cas_json(
            self.kv, f"approval.{record['id']}", {**record, "status": status}, rev
        )

    async def all(self) -> list[tuple[dict[str, Any], int]]:
        """Every approval record with its revision."""
        out = []
        for key in await keys(self.kv, "approval."):
            record, rev = await get_json(self.kv, key)
            if record is not None:
                out.append((record, rev))
        return out
