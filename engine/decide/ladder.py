"""Stage: the remediation ladder. Each recurrence of a fault on a node within the ladder's
window steps one rung up (reset GPU -> reboot -> reprovision -> a person); a rung whose
run failed counts as an attempt, so the next recurrence climbs past it.
"""

from __future__ import annotations

from nats.js.kv import KeyValue

from engine.bus.kvjson import get_json, kv_key, put_json
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.match.durations import format_duration
from engine.match.expr import render
from engine.models import ActionSpec, Reason


class LadderStage(BaseStage):
    """Replaces a ladder rule's actions with the rung this recurrence has reached."""

    name = "ladder"

    def __init__(self, kv: KeyValue | None) -> None:
        self.kv = kv
        self.memory: dict[str, list[float]] = {}  # used when no KV (shadow runs)

    async def _attempts(self, key: str, now: float, window: float) -> list[float]:
        if self.kv is None:
            stored = self.memory.get(key, [])
        else:
            value, _ = await get_json(self.kv, key)
            stored = value or []
        return [t for t in stored if now - t <= window]

    async def check(self, p: Proposal) -> Drop | None:
        ladder = p.rule.ladder
        if ladder is None:
            return None
        key = kv_key("ladder", p.node, ladder.name)
        tried = await self._attempts(key, p.now, ladder.window_s)
        step = len(tried)
        if step >= len(ladder.rungs) or ladder.rungs[step].needs_human:
            return Drop(
                Reason.NEEDS_HUMAN,
                f"ladder {ladder.name}: {step} attempts within "
                f"{format_duration(ladder.window_s)}; a person must look at {p.node}",
            )
        rung = ladder.rungs[step]
        assert rung.playbook is not None  # the loader allows only playbooks before needs_human
        p.actions = [
            ActionSpec(
                playbook=rung.playbook,
                vars=render(rung.vars, p.match.facts),
                timeout_s=rung.timeout_s,
            )
        ]
        p.rung = step
        p.approval = p.approval or rung.approval
        p.notes.append(f"ladder {ladder.name} rung {step + 1}/{len(ladder.rungs)}")
        return None

    async def commit(self, p: Proposal) -> None:
        ladder = p.rule.ladder
        if ladder is None or p.dry_run or p.rung is None:
            return
        key = kv_key("ladder", p.node, ladder.name)
        tried = [*await self._attempts(key, p.now, ladder.window_s), p.now]
        if self.kv is None:
            self.memory[key] = tried
        else:
            await put_json(self.kv, key, tried)
