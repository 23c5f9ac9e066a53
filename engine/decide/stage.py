"""The stage interface and the decider that runs the stages in order.

A match becomes a Proposal; each stage may let it pass, change what it would do (the
ladder picks a rung, the breaker asks for approval), or drop it with a named Reason.
When a stage drops it, the stages before it `abort` (a lock taken is given back); when
all pass, each `commit`s what it must remember (cooldowns, attempt counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.clock import Clock
from engine.match.expr import render
from engine.match.rules import Rule
from engine.models import ActionSpec, Decision, Match, Reason


@dataclass(frozen=True, slots=True)
class Drop:
    """Why a stage stopped a match."""

    reason: Reason
    detail: str = ""


@dataclass(slots=True)
class Proposal:
    """A match on its way through the stages, and what it would do if it got through."""

    match: Match
    rule: Rule
    now: float
    actions: list[ActionSpec]
    notify: bool
    dry_run: bool = False
    approval: bool = False
    rung: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def node(self) -> str:
        """The node the proposal would act on."""
        return self.match.node


class Stage(Protocol):
    """One safety stage."""

    name: str

    async def check(self, p: Proposal) -> Drop | None:
        """None to let the proposal pass (possibly changed), or the Drop that stops it."""
        ...

    async def commit(self, p: Proposal) -> None:
        """Every stage passed: remember what must be remembered."""
        ...

    async def abort(self, p: Proposal) -> None:
        """A later stage dropped the proposal: give back what `check` took."""
        ...


class BaseStage:
    """Stages that keep nothing need neither commit nor abort."""

    name = "stage"

    async def commit(self, p: Proposal) -> None:
        return None

    async def abort(self, p: Proposal) -> None:
        return None


class Decider:
    """Runs the stages in order; the first drop wins."""

    def __init__(self, stages: Sequence[Stage], clock: Clock, dry_run: bool = False) -> None:
        self.stages = tuple(stages)
        self.clock = clock
        self.dry_run = dry_run

    def propose(self, match: Match, rule: Rule) -> Proposal:
        """The proposal a match starts as: the rule's actions, rendered from the fact."""
        return Proposal(
            match=match,
            rule=rule,
            now=self.clock.now(),
            actions=rule_actions(rule, match),
            notify=any(a.notify for a in rule.actions),
            dry_run=self.dry_run or rule.dry_run,
        )

    async def decide(self, match: Match, rule: Rule) -> Decision:
        """The decision for one match, with the reason when it is dropped."""
        p = self.propose(match, rule)
        passed: list[Stage] = []
        for stage in self.stages:
            drop = await stage.check(p)
            if drop is not None:
                for done in reversed(passed):
                    await done.abort(p)
                return self._decision(p, False, drop.reason, drop.detail)
            passed.append(stage)
        if p.approval and p.actions and not p.dry_run:
            for done in reversed(passed):
                await done.abort(p)  # nothing is held while a person decides
            return self._decision(p, False, Reason.APPROVAL_PENDING, "; ".join(p.notes) or "rule")
        for stage in self.stages:
            await stage.commit(p)
        if not p.actions:
            return self._decision(p, False, Reason.NO_ACTION, "rule records only")
        if p.dry_run:
            which = "global" if self.dry_run else "rule"
            return self._decision(p, False, Reason.DRY_RUN, f"{which} dry-run")
        return self._decision(p, True, Reason.ACCEPTED, "; ".join(p.notes))

    @staticmethod
    def _decision(p: Proposal, accepted: bool, reason: Reason, detail: str) -> Decision:
        return Decision(
            match=p.match,
            accepted=accepted,
            reason=reason,
            detail=detail,
            actions=tuple(p.actions),
            notify=p.notify,
            rung=p.rung,
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
