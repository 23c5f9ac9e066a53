"""How a run begins and ends for the record, whoever ran it.

The live executor and shadow mode (`replay`, `test-rules`, whose runs are simulated)
call the same two functions, so what a finished run does to the node (its state, its
episode, its lock, the validation probe asked for) cannot differ between them. A run
that graded the node (diagnose.yml, the gate of return_to_service.yml) has its result
told as a `diagnostics` event: the engine decides a failed gate as its fault again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gpuops.catalog import Catalog, Effect
from gpuops.models import Intent, RunOutcome, RunStatus, new_event
from gpuops.record.nodestate import NodeRecord, NodeState, fault_key, validation_nonce
from gpuops.record.recorder import Recorder


class LockRelease(Protocol):
    """What a run's ending needs of the decide layer's node locks."""

    async def release(self, node: str, event_id: str) -> bool:
        """Give the node back when this event's decision holds it."""
        ...


Tell = Callable[[dict[str, Any]], Awaitable[None]]


async def _untold(event: dict[str, Any]) -> None:
    """Shadow mode: the live executor's diagnostics events are in the recording."""


def diagnostics_event(
    intent: Intent, outcome: RunOutcome, record: NodeRecord, gate: bool
) -> dict[str, Any] | None:
    """The `diagnostics` event of a graded run (None for a run that graded nothing); its
    id is the intent's, so an outcome recorded twice tells it once."""
    g = outcome.grade
    if g is None:
        return None
    first = g.failing[0] if g.failing else None
    data = {
        "grade": g.grade,
        "ok": g.ok,
        "summary": g.summary(),
        "failed": first.name if first else "",
        "value": first.value if first else None,
        "checks": len(g.checks),
        "gate": gate,
        "fault_rule": record.rule if gate else "",
        "fault_key": fault_key(record) if gate else "",
        "run_id": outcome.run_id or "",
        **g.measures(),
    }
    event = new_event("diagnostics", intent.node, outcome.ended, data, "gpuops-executor")
    return event | {"id": f"diagnostics-{intent.key}"}


class Completion:
    """The start and the end of a run: recorded, the lock given back, a probe asked for,
    a grade's result told."""

    def __init__(
        self,
        recorder: Recorder,
        locks: LockRelease,
        ask_probe: Callable[[str, str], Awaitable[None]],
        catalog: Catalog | None = None,
        tell: Tell = _untold,
    ) -> None:
        self.recorder, self.locks, self.ask_probe = recorder, locks, ask_probe
        self.catalog, self.tell = catalog, tell

    async def started(self, intent: Intent) -> None:
        """The run is about to start (recorded before ansible-runner is called)."""
        await self.recorder.run_started(intent)

    async def ended(self, intent: Intent, outcome: RunOutcome) -> NodeRecord:
        """Record the outcome, free the node, and ask its agent to validate it when the
        run left it validating."""
        record = await self.recorder.run_ended(intent, outcome)
        for node in intent.locked:  # the node, and a fabric check's peers
            await self.locks.release(node, intent.event_id)
        if record.state is NodeState.VALIDATING and outcome.status is RunStatus.SUCCESSFUL:
            await self.ask_probe(intent.node, validation_nonce(record))
        spec = self.catalog.get(intent.action.playbook) if self.catalog else None
        gate = spec is not None and spec.effect is Effect.RETURN
        told = diagnostics_event(intent, outcome, record, gate)
        if told is not None:
            await self.tell(told)
        return record
