"""Notifications to people: incidents, approvals needed, breaker trips, needs-human.

Each configured incoming webhook (Slack or Mattermost format) has a queue of the messages
not yet delivered, sent in order off the decision path. A receiver that is down (restarting,
its network cut) holds the queue: its first message is tried again with backoff capped at
`most_s`, for up to `keep_s`, so a receiver back within the hour still gets every message.
An episode is told once per repeat interval (4 h), so a message dropped after a few
seconds was an escalation lost for hours. The queue is bounded: past `queue_max` the
oldest goes, counted. Webhook URLs carry tokens, so they never appear in a log, a message
or an audit record: a webhook is named by its index and kind only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import SecretStr

from gpuops.clock import Clock, SystemClock
from gpuops.record.chattext import capped, clean

log = logging.getLogger(__name__)

# Slack cuts a message's text at 40,000 characters and Mattermost's posts at 16,383; one
# a person reads on a phone is far shorter. Longer ones say what they left out.
MAX_TEXT = 3500
# Answers worth trying again: a timeout, a rate limit, and every 5xx. Any other 4xx
# says the request itself is wrong (a revoked webhook, a bad payload): it never succeeds.
RETRIED_4XX = frozenset({408, 429})


@dataclass(frozen=True, slots=True)
class Webhook:
    """One incoming webhook."""

    kind: str  # slack | mattermost
    url: SecretStr
    channel: str | None = None


@dataclass(frozen=True, slots=True)
class _Pending:
    text: str
    queued: float


class _Answer(enum.Enum):
    DELIVERED = "delivered"
    REFUSED = "refused"  # a 4xx that no later try changes
    RETRY = "retry"


@dataclass
class Notifier:
    """Sends to every webhook; remembers what it sent (for tests and `status`)."""

    webhooks: Sequence[Webhook] = ()
    backoff_s: float = 0.5  # the first wait before a try again; doubled up to `most_s`
    most_s: float = 300.0
    keep_s: float = 3600.0  # a message undelivered this long is given up
    queue_max: int = 500  # per webhook
    # Time is injected: tests move a manual clock in their `sleep` and wait for nothing.
    clock: Clock = field(default_factory=SystemClock)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    # The last messages, for `status` and tests; bounded so a long run does not grow it.
    sent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))
    failed: int = 0  # messages given up: refused, or kept past `keep_s`, or at shutdown
    dropped: int = 0  # messages pushed out of a full queue
    _queues: dict[int, deque[_Pending]] = field(default_factory=dict)
    _workers: dict[int, asyncio.Task[None]] = field(default_factory=dict)

    def notify(self, topic: str, text: str) -> None:
        """Queue a message; it is delivered in the background.

        The text is cleaned here, where every message passes: parts of it came from
        nodes (a task's stderr) and must not format, mention or forge a line."""
        message = {"topic": topic, "text": capped(clean(f"[gpuops] {topic}: {text}"), MAX_TEXT)}
        self.sent.append(message)
        log.info("notify %s", message["text"])
        for index in range(len(self.webhooks)):
            self._enqueue(index, _Pending(message["text"], self.clock.now()))

    def _enqueue(self, index: int, pending: _Pending) -> None:
        queue = self._queues.setdefault(index, deque())
        queue.append(pending)
        if len(queue) > self.queue_max:
            queue.popleft()
            self.dropped += 1
            log.warning("webhook #%d: queue full, the oldest message dropped", index)
        worker = self._workers.get(index)
        if worker is None or worker.done():
            self._workers[index] = asyncio.create_task(self._work(index))

    async def _work(self, index: int) -> None:
        """Deliver the queue's messages in order; the first one waits out a receiver that
        is down, so the others keep their order behind it."""
        hook, queue, delay = self.webhooks[index], self._queues[index], self.backoff_s
        while queue:
            pending = queue[0]
            if self.clock.now() - pending.queued >= self.keep_s:
                self._give_up(index, queue, pending, f"undelivered for {self.keep_s:.0f}s")
                continue
            answer, why = await self._post(hook, pending.text)
            if answer is _Answer.RETRY:
                log.warning(
                    "webhook #%d (%s) failed: %s; again in %.0fs", index, hook.kind, why, delay
                )
                await self.sleep(delay)
                delay = min(delay * 2, self.most_s)
                continue
            if answer is _Answer.REFUSED:
                self._give_up(index, queue, pending, why)
            elif queue and queue[0] is pending:
                queue.popleft()
            delay = self.backoff_s

    def _give_up(self, index: int, queue: deque[_Pending], pending: _Pending, why: str) -> None:
        if queue and queue[0] is pending:  # a full queue may have pushed it out already
            queue.popleft()
            self.failed += 1
            log.warning(
                "webhook #%d (%s) gave up a message: %s", index, self.webhooks[index].kind, why
            )

    async def _post(self, hook: Webhook, text: str) -> tuple[_Answer, str]:
        body: dict[str, Any] = {"text": text}
        if hook.channel:
            body["channel"] = hook.channel
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
                session.post(hook.url.get_secret_value(), json=body) as reply,
            ):
                if reply.status < 300:
                    return _Answer.DELIVERED, ""
                if reply.status < 500 and reply.status not in RETRIED_4XX:
                    return _Answer.REFUSED, f"HTTP {reply.status}"
                return _Answer.RETRY, f"HTTP {reply.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _Answer.RETRY, type(exc).__name__

    async def drain(self, wait_s: float = 10.0) -> None:
        """At shutdown: wait up to `wait_s` for the queues to empty, then give up the rest
        (a receiver that is down is not waited on for an hour)."""
        workers = [w for w in self._workers.values() if not w.done()]
        if workers:
            await asyncio.wait(workers, timeout=wait_s)
        for index, worker in self._workers.items():
            worker.cancel()
            left = self._queues.get(index, deque())
            if left:
                log.warning("webhook #%d: %d messages undelivered at shutdown", index, len(left))
                self.failed += len(left)
                left.clear()
