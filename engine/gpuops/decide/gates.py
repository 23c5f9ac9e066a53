"""Stages at the end of the line: a rule that only records, and dry-run.

Both stop the proposal before anything runs but keep what the stages before them
remember (a dry-run rule cools down like a live one, so replay shows one firing per
cooldown, as the live engine would).
"""

from __future__ import annotations

from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.models import Reason


class RecordOnly(BaseStage):
    """A rule with no playbook is decided and recorded, nothing more."""

    name = "record_only"

    async def check(self, p: Proposal) -> Drop | None:
        if p.actions:
            return None
        return Drop(Reason.NO_ACTION, "rule records only", keep=True)


class DryRun(BaseStage):
    """Global or per-rule dry-run: decide and record, never execute."""

    name = "dry_run"

    async def check(self, p: Proposal) -> Drop | None:
        if not p.dry_run:
            return None
        return Drop(Reason.DRY_RUN, p.dry_run_why, keep=True)
