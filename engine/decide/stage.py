"""The stage interface and the decider that runs stages in order.

A stage looks at one match and either lets it pass or drops it with a named Reason;
`accepted` lets a stage remember what went through (cooldowns, counters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


class Stage(Protocol):
    """One safety stage."""

    name: str

    async def check(self, match: Match, rule: Rule, now: float) -> Drop | None:
        """None to let the match pass, or the Drop that stops it."""
        ...

    async def accepted(self, match: Match, rule: Rule, now: float) -> None:
        """Remember a match that every stage let through."""
        ...


class Decider:
    """Runs the stages in order; the first drop wins; then applies dry-run."""

    def __init__(self, stages: Sequence[Stage], clock: Clock, dry_run: bool = False) -> None:
        self.stages = tuple(stages)
        self.clock = clock
        self.dry_run = dry_run

    async def decide(self, match: Match, rule: Rule) -> Decision:
        """The decision for one match, with the reason when it is dropped."""
        now = self.clock.now()
        actions = tuple(_actions(rule, match))
        notify = any(a.notify for a in rule.actions)
        for stage in self.stages:
            drop = await stage.check(match, rule, now)
            if drop is not None:
                return Decision(match=match, accepted=False, reason=drop.reason, detail=drop.detail)
        for stage in self.stages:
            await stage.accepted(match, rule, now)
        if not actions:
            return Decision(
                match=match,
                accepted=False,
                reason=Reason.NO_ACTION,
                detail="rule records only",
                notify=notify,
            )
        if self.dry_run or rule.dry_run:
            which = "global" if self.dry_run else "rule"
            return Decision(
                match=match,
                accepted=False,
                reason=Reason.DRY_RUN,
                detail=f"{which} dry-run",
                actions=actions,
                notify=notify,
            )
        return Decision(
            match=match, accepted=True, reason=Reason.ACCEPTED, actions=actions, notify=notify
        )


def _actions(rule: Rule, match: Match) -> list[ActionSpec]:
    return [
        ActionSpec(
            playbook=a.playbook,
            ref=a.ref,
            vars=render(a.vars, match.facts),
            timeout_s=a.timeout_s,
        )
        for a in rule.actions
        if a.playbook
    ]
