"""The stage interface and the decider that runs the stages in order.

A match becomes a Proposal; each stage may let it pass, change what it would do (the
ladder picks a rung, the breaker asks for approval), or drop it with a named Reason.
When a stage drops it, the stages before it `abort` (a lock taken is given back); when
all pass, each `commit`s what it must remember (cooldowns, attempt counts).

Crash consistency: the decider calls `write` (which stores the intents) after every
check passed and before any commit. A crash before `write` leaves nothing but a
short-lived pending lock; a crash after it lets the redelivered event decide again,
and every commit is idempotent by event id, so the second decision is the first one.

Round trips: each stage names the records its check will read (`reads`). Reaching the
first stage with a record not yet read, the decider reads those of every stage left in
one concurrent round; the checks then run in order as before (the first drop wins). A
stage whose read follows from an earlier stage's change (the ladder's rung decides
whether the stages below it act) gets its records in a second round, when it is
reached. The commits touch distinct records and are each idempotent, so they are
issued together, after `write`, each starting its compare-and-set from the revision
its check read; what the record stage writes after a decision goes with them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpuops.bus.store import Read, Reads, together
from gpuops.clock import Clock
from gpuops.errors import StateUnreadable
from gpuops.match.expr import render
from gpuops.match.rules import Rule
from gpuops.models import ActionSpec, Decision, Match, Reason
from gpuops.record.unreadable import UnreadableState

log = logging.getLogger(__name__)

Write = Callable[[Decision], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Drop:
    """Why a stage stopped a match; `keep` commits the stages passed (dry-run, record-only)."""

    reason: Reason
    detail: str = ""
    keep: bool = False


@dataclass(slots=True)
class Proposal:
    """A match on its way through the stages, and what it would do if it got through."""

    match: Match
    rule: Rule
    now: float
    actions: list[ActionSpec]
    notify: bool
    dry_run: bool = False
    dry_run_why: str = ""
    approval: bool = False
    approved_by: str | None = None
    closes_breaker: bool = False
    holds_lock: bool = False
    peers: tuple[str, ...] = ()  # nodes a fabric check pairs with: locked with the node
    locked: list[str] = field(default_factory=list)  # the locks this decision holds
    rung: int | None = None
    notes: list[str] = field(default_factory=list)
    reads: Reads = field(default_factory=Reads)  # what the stages read from KV
    episode: str = ""  # the rule's open episode on the node (EpisodeName), for its intents
    gate: int = 0  # the gate's grade after this fix: the rule's, or its ladder rung's

    @property
    def node(self) -> str:
        """The node the proposal would act on."""
        return self.match.node

    @property
    def event_id(self) -> str:
        """The triggering event: what makes every commit idempotent."""
        return self.match.event_id

    @property
    def acts(self) -> bool:
        """Whether the proposal would run a playbook for real."""
        return bool(self.actions) and not self.dry_run


class Stage(Protocol):
    """One safety stage."""

    name: str

    def reads(self, p: Proposal) -> Sequence[Read]:
        """The records `check` will read for `p` as it stands (fetched ahead, together)."""
        ...

    async def check(self, p: Proposal) -> Drop | None:
        """None to let the proposal pass (possibly changed), or the Drop that stops it."""
        ...

    async def commit(self, p: Proposal) -> None:
        """The proposal was decided: remember what must be remembered (idempotent)."""
        ...

    async def abort(self, p: Proposal) -> None:
        """A later stage dropped the proposal: give back what `check` took."""
        ...


class BaseStage:
    """Stages that keep nothing need neither commit nor abort."""

    name = "stage"

    def reads(self, p: Proposal) -> Sequence[Read]:
        return ()

    async def commit(self, p: Proposal) -> None:
        return None

    async def abort(self, p: Proposal) -> None:
        return None


class GlobalDryRun(Protocol):
    """Whether the whole engine decides without acting (gpuops.decide.gates.DryRunSwitch)."""

    @property
    def on(self) -> bool:
        """Dry-run now."""
        ...


class Live:
    """No global dry-run (rules may still be dry-run on their own)."""

    on = False


class Decider:
    """Runs the stages in order; the first drop wins."""

    def __init__(
        self,
        stages: Sequence[Stage],
        clock: Clock,
        dry_run: GlobalDryRun | None = None,
        unreadable: UnreadableState | None = None,
    ) -> None:
        self.stages = tuple(stages)
        self.clock = clock
        self.dry_run = dry_run or Live()
        self.unreadable = unreadable or UnreadableState()
        # What each stage does beyond its check. A decision passes some twenty stages;
        # one that reads, keeps or gives back nothing (BaseStage's own methods) is not
        # asked to: each ask is a coroutine made and run, for nothing.
        self._reads = tuple(_does(s, "reads") for s in self.stages)
        self._commits = frozenset(i for i, s in enumerate(self.stages) if _does(s, "commit"))
        self._aborts = frozenset(i for i, s in enumerate(self.stages) if _does(s, "abort"))

    def propose(self, match: Match, rule: Rule, approved_by: str | None = None) -> Proposal:
        """The proposal a match starts as: the rule's actions, rendered from the fact."""
        return Proposal(
            match=match,
            rule=rule,
            now=self.clock.now(),
            actions=rule_actions(rule, match),
            notify=any(a.notify for a in rule.actions),
            dry_run=self.dry_run.on or rule.dry_run,
            dry_run_why="global dry-run" if self.dry_run.on else "rule dry-run",
            approval=rule.approval,
            approved_by=approved_by,
            gate=rule.gate,
        )

    async def decide(
        self,
        match: Match,
        rule: Rule,
        write: Write | None = None,
        approved_by: str | None = None,
        record: Write | None = None,
    ) -> Decision:
        """The decision for one match; `write` stores it before anything is committed, and
        `record` (what follows a decision: audit, node state, episode) runs alongside the
        commits, or after the aborts of a dropped proposal."""
        p = self.propose(match, rule, approved_by)
        passed: list[int] = []
        try:
            drop = await self._check(p, passed)
        except Exception:
            # A check that failed (the bus) leaves nothing the passed stages took: the
            # decision made again takes it anew, and one never made again (a telemetry
            # sample dead-lettered) would hold a budget or a breaker slot for good.
            await self._give_back(p, passed, failed=True)
            raise
        if drop is not None and not drop.keep:
            await self._give_back(p, passed)
            d = decision(p, False, drop.reason, drop.detail)
            if record is not None:
                await record(d)
            return d
        if drop is None:
            d = decision(p, True, Reason.ACCEPTED, "; ".join(p.notes))
        else:
            d = decision(p, False, drop.reason, drop.detail)
        if write is not None:
            await write(d)
        commits = (self.stages[i].commit(p) for i in passed if i in self._commits)
        await together(*commits, *([record(d)] if record else []))
        return d

    async def _give_back(self, p: Proposal, passed: list[int], failed: bool = False) -> None:
        """What the passed stages took, given back in reverse (a dropped proposal). After
        a `failed` check, as far as the bus lets: the check's error is the one raised, and
        what is not given back stays until its own lease or window ends, as after a crash."""
        for i in reversed(passed):
            if i not in self._aborts:
                continue
            try:
                await self.stages[i].abort(p)
            except Exception as exc:
                if not failed:
                    raise
                log.warning(
                    "%s: not given back after a failed check (%s)", self.stages[i].name, exc
                )

    async def _check(self, p: Proposal, passed: list[int]) -> Drop | None:
        """The drop that stopped the proposal, if one did; `passed` gets the places of
        the stages passed, in order."""
        for i, stage in enumerate(self.stages):
            try:
                if self._reads[i] and not p.reads.has(stage.reads(p)):
                    await self._fetch(p, i)
                drop = await stage.check(p)
            except StateUnreadable as exc:
                # Fail closed: a lock, cooldown, breaker or silence that cannot be read
                # may be the one that says no.
                found = self.unreadable.note(exc)
                detail = f"{stage.name}: {found.bucket}/{found.key} unreadable ({found.detail})"
                return Drop(Reason.STATE_UNREADABLE, detail)
            if drop is not None:
                return drop
            passed.append(i)
        return None

    async def _fetch(self, p: Proposal, i: int) -> None:
        """Stage `i` needs a record not read yet: read those of stages `i` on."""
        later = (s for s, reads in zip(self.stages[i:], self._reads[i:], strict=True) if reads)
        await p.reads.fetch(r for stage in later for r in stage.reads(p))


def _does(stage: Stage, method: str) -> bool:
    """Whether a stage's `method` is its own (BaseStage's reads, keeps and gives back
    nothing); a stage not built on BaseStage is always asked."""
    return getattr(type(stage), method, None) is not getattr(BaseStage, method)


def decision(p: Proposal, accepted: bool, reason: Reason, detail: str) -> Decision:
    """The typed outcome of a proposal."""
    return Decision(
        match=p.match,
        accepted=accepted,
        reason=reason,
        detail=detail,
        actions=tuple(p.actions),
        notify=p.notify,
        rung=p.rung,
        holds_lock=p.holds_lock and accepted,
        peers_locked=tuple(n for n in p.locked if n != p.node) if accepted else (),
        closes_breaker=p.closes_breaker,
        approved_by=p.approved_by,
        episode=p.episode,
        gate=p.gate,
    )


def rule_actions(rule: Rule, match: Match) -> list[ActionSpec]:
    """The rule's playbook actions with `{{ field }}` filled from the match."""
    return [
        ActionSpec(
            playbook=a.playbook, ref=a.ref, vars=render(a.vars, match.facts), timeout_s=a.timeout_s
        )
        for a in rule.actions
        if a.playbook
    ]
