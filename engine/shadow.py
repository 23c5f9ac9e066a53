"""Shadow evaluation: events through matching and the safety stages, never acting.

`gpuops replay` and `gpuops test-rules` use it. Time is the events' own: the clock is
moved to each event's timestamp, so windows, cooldowns and `absent` behave exactly as
they did (or would) live.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.clock import ManualClock, rfc3339
from engine.decide.attempts import AttemptCap
from engine.decide.cooldown import Cooldown
from engine.decide.inventory import KnownNode
from engine.decide.ladder import LadderStage
from engine.decide.stage import Decider, Stage
from engine.decide.stale import StaleCutoff
from engine.inventory import Inventory
from engine.match.matcher import Matcher
from engine.match.rules import RuleSet
from engine.models import Decision, Event, Match, Reason


@dataclass(frozen=True, slots=True)
class WouldRun:
    """One action the engine would have taken."""

    rule: str
    node: str
    gpu: int | None
    action: str
    ts: float
    dry_run: bool

    def as_dict(self) -> dict[str, object]:
        """The `--json` line of replay."""
        return {
            "rule": self.rule,
            "node": self.node,
            "gpu": self.gpu,
            "action": self.action,
            "ts": rfc3339(self.ts),
            "dry_run": self.dry_run,
        }


class Shadow:
    """A matcher and decider on a manual clock, collecting decisions instead of acting."""

    def __init__(
        self, rules: RuleSet, nodes: Iterable[str] | None, stale_after_s: float = 900.0
    ) -> None:
        self.clock = ManualClock(0.0)
        self.matcher = Matcher(rules)
        self.rules = rules
        known = frozenset(nodes) if nodes is not None else None
        # The stages that need no shared store; lock and breaker state live only in KV.
        stages: list[Stage] = [
            StaleCutoff(stale_after_s),
            Cooldown(),
            LadderStage(None),
            AttemptCap(None),
        ]
        if known is not None:
            stages.insert(0, KnownNode(Inventory(Path("<shadow>"), known, {}, {})))
        self.decider = Decider(stages, self.clock)
        self.decisions: list[Decision] = []
        self._seeded = known

    async def feed(self, event: Event) -> list[WouldRun]:
        """Evaluate one event at its own time (ticking `absent` rules up to it first)."""
        t = event.epoch
        out = await self.advance(t)
        for match in self.matcher.match(event):
            out += await self._decide(match)
        return out

    async def advance(self, t: float) -> list[WouldRun]:
        """Move the clock to `t` and fire what silence has made due."""
        if self.clock.now() == 0.0 and self._seeded is not None:
            self.matcher.seed(self._seeded, t)
        self.clock.set(max(self.clock.now(), t))
        out: list[WouldRun] = []
        for match in self.matcher.tick(self.clock.now()):
            out += await self._decide(match)
        return out

    async def _decide(self, match: Match) -> list[WouldRun]:
        rule = self.rules.get(match.rule)
        if rule is None:
            return []
        decision = await self.decider.decide(match, rule)
        self.decisions.append(decision)
        if decision.reason in (Reason.NEEDS_HUMAN, Reason.ATTEMPT_CAP):
            return [
                WouldRun(match.rule, match.node, match.gpu, "needs-human", match.event_ts, False)
            ]
        if decision.reason not in (
            Reason.ACCEPTED,
            Reason.DRY_RUN,
            Reason.NO_ACTION,
            Reason.APPROVAL_PENDING,
        ):
            return []
        actions = [a.playbook for a in decision.actions]
        if decision.notify:
            actions.append("notify:chatops")
        if not actions:
            actions.append("record")  # a rule that only records still fired
        dry = decision.reason is Reason.DRY_RUN
        return [
            WouldRun(match.rule, match.node, match.gpu, a, match.event_ts, dry) for a in actions
        ]
