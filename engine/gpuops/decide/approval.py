"""Stage: approvals. Rules or rungs marked `approval: required` (and the one action a
half-open breaker lets through) wait for a person's approve or deny; no answer before
the timeout is a deny. The records are gpuops/record/approvals.py.
"""

from __future__ import annotations

from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.models import Reason


class ApprovalGate(BaseStage):
    """Holds proposals that need approval until a person approves them."""

    name = "approval"

    async def check(self, p: Proposal) -> Drop | None:
        if not p.approval or not p.acts or p.approved_by is not None:
            return None
        why = "; ".join(p.notes) if p.closes_breaker else f"rule {p.rule.name} requires approval"
        return Drop(Reason.APPROVAL_PENDING, why)
