"""Where the pipeline's output goes: JetStream, or a list (shadow runs and tests).

Every message that must not be stored twice carries a `Nats-Msg-Id`; the memory
publisher honours it the way JetStream's duplicate window does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from nats.js import JetStreamContext

from gpuops import subjects
from gpuops.bus.identity import Signer


class Publisher(Protocol):
    """Stores a message and returns once it is stored."""

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> bool:
        """Store `payload` on `subject`, once per `msg_id`; False when it was stored
        before (a duplicate of that id, dropped)."""
        ...


class JetStreamPublisher:
    """Publishes to JetStream and awaits the store's ack; with a signer, the events and
    samples carry their publisher's MAC (gpuops.bus.identity): the engine's audit
    records and intents through the same publisher need none (intents are signed
    whole, gpuops.signing), so the decision path computes no MAC nobody checks."""

    def __init__(self, js: JetStreamContext, signer: Signer | None = None) -> None:
        self.js = js
        self.signer = signer

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> bool:
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        if self.signer is not None and subjects.is_checked(subject):
            headers = self.signer.headers(payload, headers)
        ack = await self.js.publish(subject, payload, headers=headers)
        return not ack.duplicate


@dataclass
class MemoryPublisher:
    """Keeps what was published, in order, deduplicated by message id."""

    messages: list[tuple[str, bytes]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> bool:
        if msg_id is not None:
            if msg_id in self._seen:
                return False
            self._seen.add(msg_id)
        self.messages.append((subject, payload))
        return True
