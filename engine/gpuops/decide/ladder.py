"""Stage: the remediation ladder. Each recurrence of a fault on a node within the ladder's
window steps one rung up (reset GPU -> reboot -> reprovision -> a person); a rung whose
run failed counts as an attempt, so the next recurrence climbs past it.

A recurrence while the rule's last rung still runs (its lock held by the rule) is not a
failed rung: the fault often outlives the cooldown until the fix ends (a driver keeps its
taint until the reset). Past the last rung it is dropped as locked, so a person is
called only when the rungs ran out and none of them is still running.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuops.bus.store import KV, Read, Store, kv_key
from gpuops.decide.history import AttemptLog, append
from gpuops.decide.lock import NodeLocks
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.durations import format_duration
from gpuops.match.expr import render
from gpuops.models import ActionSpec, Reason


class LadderStage(BaseStage):
    """Replaces a ladder rule's actions with the rung this recurrence has reached."""

    name = "ladder"

    def __init__(self, kv: KV, locks: NodeLocks) -> None:
        self.store: Store[AttemptLog] = Store(kv, AttemptLog, "ladder")
        self.locks = locks

    def reads(self, p: Proposal) -> Sequence[Read]:
        ladder = p.rule.ladder
        if ladder is None:
            return ()
        return (self.store.read(kv_key(p.node, ladder.name)), self.locks.store.read(p.node))

    async def check(self, p: Proposal) -> Drop | None:
        ladder = p.rule.ladder
        if ladder is None:
            return None
        log, _ = await p.reads.get(self.store, kv_key(p.node, ladder.name))
        step = len((log or AttemptLog()).within(p.now, ladder.window_s, p.event_id))
        if step >= len(ladder.rungs) or ladder.rungs[step].needs_human:
            if running := await self._running(p):
                return Drop(Reason.LOCKED, running)
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
        p.gate = rung.gate or p.gate
        p.approval = p.approval or rung.approval
        p.notes.append(f"ladder {ladder.name} rung {step + 1}/{len(ladder.rungs)}")
        return None

    async def _running(self, p: Proposal) -> str:
        """Why the rule's own last rung is still running on the node ("" when it is not:
        a lock another rule holds does not delay the hand-off)."""
        held, _ = await p.reads.get(self.locks.store, p.node)
        if held is None or held.event_id == p.event_id or held.until <= p.now:
            return ""
        if held.rule != p.rule.name or held.peer_of:  # another rule's, or a fabric check's peer
            return ""
        return f"{p.node} is locked by {held.rule}: its run ends before the ladder goes on"

    async def commit(self, p: Proposal) -> None:
        ladder = p.rule.ladder
        if ladder is None or not p.acts or p.rung is None:
            return
        key = kv_key(p.node, ladder.name)
        await append(
            self.store, key, p.now, p.event_id, ladder.window_s, p.reads.known(self.store, key)
        )
