"""How a run begins and ends for the record, whoever ran it.

The live executor and shadow mode (`replay`, `test-rules`, whose runs are simulated)
call the same two functions, so what a finished run does to the node (its state, its
episode, its lock, the validation probe asked for) cannot differ between them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from gpuops.models import Intent, RunOutcome, RunStatus
from gpuops.record.nodestate import NodeRecord, NodeState, validation_nonce
from gpuops.record.recorder import Recorder


class LockRelease(Protocol):
    """What a run's ending needs of the decide layer's node locks."""

    async def release(self, node: str, event_id: str) -> bool:
        """Give the node back when this event's decision holds it."""
        ...


class Completion:
    """The start and the end of a run: recorded, the lock given back, a probe asked for."""

    def __init__(
        self,
        recorder: Recorder,
        locks: LockRelease,
        ask_probe: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self.recorder, self.locks, self.ask_probe = recorder, locks, ask_probe

    async def started(self, intent: Intent) -> None:
        """The run is about to start (recorded before ansible-runner is called)."""
        await self.recorder.run_started(intent)

    async def ended(self, intent: Intent, outcome: RunOutcome) -> NodeRecord:
        """Record the outcome, free the node, and ask its agent to validate it when the
        run left it validating."""
        record = await self.recorder.run_ended(intent, outcome)
        if intent.holds_lock:
            await self.locks.release(intent.node, intent.event_id)
        if record.state is NodeState.VALIDATING and outcome.status is RunStatus.SUCCESSFUL:
            await self.ask_probe(intent.node, validation_nonce(record))
        return record
