"""Shadow evaluation: events through the same engine the live one runs, never acting.

`gpuops replay` and `gpuops test-rules` use it. It is built by `build_engine` with
in-memory buckets, so every stage runs in the live order. Time is the events' own: the
clock is moved to each event's timestamp, so windows, cooldowns and `absent` behave
exactly as they did (or would) live. Intents are "run" at once and succeed (the
simulated fleet's outcome), which releases the node's lock and moves its state.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuops import subjects
from gpuops.act.completion import Completion
from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.catalog import load_catalog
from gpuops.clock import ManualClock, rfc3339
from gpuops.decide.silence import silence_span
from gpuops.errors import EngineError
from gpuops.inventory.hosts import Inventory
from gpuops.match.facts import Telemetry
from gpuops.match.rules import RuleSet
from gpuops.models import (
    ChatopsEvent,
    Decision,
    DiagnosticsEvent,
    Event,
    Intent,
    Reason,
    RunOutcome,
    RunStatus,
)
from gpuops.ops.power import do_power
from gpuops.record.nodestate import after_gate_failed
from gpuops.settings import Settings
from gpuops.spine.build import build_engine

# Decisions that say what the engine would do; the other drops say why it would not.
WOULD = (Reason.ACCEPTED, Reason.DRY_RUN, Reason.NO_ACTION, Reason.APPROVAL_PENDING)
# Drops that hand the node to a person: replay shows them as `needs-human`.
ESCALATES = (Reason.NEEDS_HUMAN, Reason.ATTEMPT_CAP)


@dataclass(frozen=True, slots=True)
class WouldRun:
    """One action the engine would have taken."""

    rule: str
    node: str
    gpu: int | None
    action: str
    ts: float
    dry_run: bool
    gpus: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """The `--json` line of replay."""
        return {
            "rule": self.rule,
            "node": self.node,
            "gpu": self.gpu,
            "gpus": list(self.gpus),
            "action": self.action,
            "ts": rfc3339(self.ts),
            "dry_run": self.dry_run,
        }


def would_run(d: Decision) -> list[WouldRun]:
    """What a decision amounts to, as replay reports it."""
    m = d.match
    if d.reason in ESCALATES:
        return [WouldRun(m.rule, m.node, m.gpu, "needs-human", m.event_ts, False, m.gpus)]
    if d.reason not in WOULD:
        return []
    actions = [a.playbook for a in d.actions]
    if d.notify:
        actions.append("notify:chatops")
    if not actions:
        actions.append("record")  # a rule that only records still fired
    dry = d.reason is Reason.DRY_RUN
    return [WouldRun(m.rule, m.node, m.gpu, a, m.event_ts, dry, m.gpus) for a in actions]


class Shadow:
    """The engine on in-memory stores and a manual clock, handing back its decisions.

    Events go through `Pipeline.handle`, silence and people's answers through the live
    tick, the power controller polls as the clock moves, and every intent "runs" at once
    through the executor's own start and end (`Completion`): only the playbook run itself
    is simulated (it succeeds, as on the simulated fleet)."""

    def __init__(
        self,
        rules: RuleSet,
        nodes: Iterable[str],
        settings: Settings | None = None,
        playbooks_dir: Path | None = None,
        hostvars: Mapping[str, dict[str, Any]] | None = None,
        groups: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.clock = ManualClock(0.0)
        self.publisher = MemoryPublisher()
        self.hosts = frozenset(nodes)
        inventory = Inventory(
            Path("<shadow>"), self.hosts, dict(groups or {}), dict(hostvars or {})
        )
        self.inventory = inventory
        self.engine = build_engine(
            self.settings,
            rules=rules,
            inventory=inventory,
            catalog=load_catalog(playbooks_dir or self.settings.playbooks_dir),
            buckets=Buckets.memory(),
            publisher=self.publisher,
            clock=self.clock,
            signing_key=secrets.token_bytes(32),
        )
        # The live executor tells graded runs' results; the recording holds them.
        catalog = self.engine.recorder.catalog
        self.completion = Completion(self.engine.recorder, self.engine.locks, self._probe, catalog)
        self._seeded = False
        self._ran = 0
        # A person's recorded command the replay could not carry out as live did -> times.
        self.unapplied: Counter[str] = Counter()

    @property
    def now(self) -> float | None:
        """The replay's clock: the latest time fed, None before the first."""
        return self.clock.now() if self._seeded else None

    async def feed(self, event: Event | Telemetry) -> list[Decision]:
        """Evaluate one event at its own time (ticking `absent` rules up to it first); the
        decisions made, the ticks' first."""
        out = await self.advance(event.epoch)
        if isinstance(event, ChatopsEvent):
            await self._command(event)
        if isinstance(event, DiagnosticsEvent) and event.data.gate and not event.data.ok:
            await self._gate_failed(event)
        out += self._seen(await self.engine.pipeline.handle(event))
        # Runs start once the event is decided, as live: a second rule matching the same
        # event sees the node as the first decision left it, not as its run would.
        await self._run_intents()
        return out

    async def advance(self, t: float) -> list[Decision]:
        """Move the clock to `t`; run what the live engine's loops would have run by then
        (silence, answered approvals, the power controller)."""
        if not self._seeded:
            self._seeded = True
            self.engine.matcher.seed(self.hosts, t)
        elif t <= self.clock.now():
            return []  # the loops ran at this time already (a fleet's samples share a second)
        self.clock.set(t)
        out = self._seen(await self.engine.tick())
        await self.engine.sweep(t)
        out += self._seen(await self.engine.power.poll())
        await self._run_intents()
        return out

    async def _command(self, event: ChatopsEvent) -> None:
        """A person's silence or power budget, as recorded, is in force in the replay as
        it was live (the live command wrote it to KV; the event is all the recording has)."""
        d = event.data
        try:
            if d.command == "silence":
                target, starts, ends, reason = silence_span(d.args, event.epoch)
                await self.engine.silences.add(target, starts, ends, reason, d.user)
            elif d.command == "power" and d.args[:1] == ["budget"]:
                control = self.engine.stores.buckets.control
                power = self.settings.power
                await do_power(d.args, d.user, control, power, self.inventory, event.epoch)
        except (ValueError, EngineError) as exc:
            # Live, the command was carried out (only those are recorded): here it could
            # not be, most likely for a group of an inventory the replay was not given.
            self.unapplied[f"{d.command} {' '.join(d.args[:2])}: {exc}"] += 1

    async def _gate_failed(self, event: DiagnosticsEvent) -> None:
        """The recording says the gate failed where the shadow's simulated return passed:
        the node is out again, as the live run left it, for the event to be decided."""
        d = event.data
        await self.engine.states.apply(
            event.node, lambda r: after_gate_failed(r, d.summary, d.grade, event.epoch)
        )

    def _seen(self, decisions: list[Decision]) -> list[Decision]:
        """The decisions the audit holds (a built-in rule for another state is not one)."""
        return [d for d in decisions if d.reason is not Reason.NOT_APPLICABLE]

    async def _probe(self, node: str, nonce: str) -> None:
        """Live, the agent is asked to probe; its answer is an event, which the recording
        holds (or a rule test gives) in its own place."""
        return None

    async def _run_intents(self) -> None:
        """Every new intent runs at once and succeeds, as on the simulated fleet."""
        new = self.publisher.messages[self._ran :]
        self._ran = len(self.publisher.messages)
        for subject, payload in new:
            if not subjects.is_action(subject):
                continue
            intent = Intent.model_validate_json(payload)
            now = self.clock.now()
            await self.completion.started(intent)
            await self.completion.ended(
                intent, RunOutcome.of(intent, RunStatus.SUCCESSFUL, now, now)
            )
