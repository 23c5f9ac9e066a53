"""Stages that stop a proposal before anything runs: a rule that only records (decided
right after the ladder: no later stage judges a proposal with no playbook), and dry-run,
at the end of the line.

Both keep what the stages before them remember (a dry-run rule cools down like a live
one, so replay shows one firing per cooldown, as the live engine would).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.errors import StateUnreadable
from gpuops.models import Reason
from gpuops.record.unreadable import UnreadableState

DRY_RUN_KEY = "dry_run"


class Switch(BaseModel):
    """A runtime switch people flip (`gpuops dry-run on`), in the control bucket."""

    model_config = ConfigDict(frozen=True)

    on: bool
    by: str = ""


class DryRunSwitch:
    """Global dry-run: the settings' flag, or the switch a person flipped, read once a tick
    (the decider asks `on` for every proposal; it never waits on KV for it). A switch
    that does not decode reads as on: a fleet a person put in dry-run stays in it."""

    def __init__(
        self, control: KV, configured: bool = False, unreadable: UnreadableState | None = None
    ) -> None:
        self.store: Store[Switch] = Store(control, Switch, "switch")
        self.configured = configured
        self.unreadable = unreadable or UnreadableState()
        self.flipped: Switch | None = None

    @property
    def on(self) -> bool:
        """Whether every decision is dry-run now."""
        return self.configured or bool(self.flipped and self.flipped.on)

    async def read(self) -> bool:
        """The switch as people left it (read again now)."""
        try:
            self.flipped, _ = await self.store.get(DRY_RUN_KEY)
        except StateUnreadable as exc:
            self.unreadable.note(exc)
            self.flipped = Switch(on=True, by=f"unreadable switch: {exc.detail}")
        else:
            self.unreadable.cleared(self.store.kv.name, self.store.key(DRY_RUN_KEY))
        return self.on

    async def flip(self, on: bool, by: str) -> None:
        """A person's switch, for every engine that reads it."""
        self.flipped = Switch(on=on, by=by)
        await self.store.put(self.flipped, DRY_RUN_KEY)


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
