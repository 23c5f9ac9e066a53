"""Notifications to people: incidents, approvals needed, breaker trips, needs-human.

Each configured incoming webhook (Slack or Mattermost format) gets the message with
retries and exponential backoff, off the decision path. Webhook URLs carry tokens, so
they never appear in a log, a message or an audit record: a webhook is named by its
index and kind only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import SecretStr

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


@dataclass
class Notifier:
    """Sends to every webhook; remembers what it sent (for tests and `status`)."""

    webhooks: Sequence[Webhook] = ()
    attempts: int = 4
    backoff_s: float = 0.5
    # The last messages, for `status` and tests; bounded so a long run does not grow it.
    sent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))
    failed: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def notify(self, topic: str, text: str) -> None:
        """Queue a message; it is delivered in the background.

        The text is cleaned here, where every message passes: parts of it came from
        nodes (a task's stderr) and must not format, mention or forge a line."""
        message = {"topic": topic, "text": capped(clean(f"[gpuops] {topic}: {text}"), MAX_TEXT)}
        self.sent.append(message)
        log.info("notify %s", message["text"])
        for index, hook in enumerate(self.webhooks):
            task = asyncio.create_task(self._deliver(index, hook, message["text"]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _deliver(self, index: int, hook: Webhook, text: str) -> None:
        body: dict[str, Any] = {"text": text}
        if hook.channel:
            body["channel"] = hook.channel
        delay = self.backoff_s
        timeout = aiohttp.ClientTimeout(total=10)
        for attempt in range(1, self.attempts + 1):
            try:
                async with (
                    aiohttp.ClientSession(timeout=timeout) as session,
                    session.post(hook.url.get_secret_value(), json=body) as reply,
                ):
                    if reply.status < 300:
                        return
                    why = f"HTTP {reply.status}"
                    if reply.status < 500 and reply.status not in RETRIED_4XX:
                        break
            except (aiohttp.ClientError, TimeoutError) as exc:
                why = type(exc).__name__
            log.warning(
                "webhook #%d (%s) attempt %d/%d failed: %s",
                index,
                hook.kind,
                attempt,
                self.attempts,
                why,
            )
            await asyncio.sleep(delay)
            delay *= 2
        log.warning("webhook #%d (%s) gave up: %s", index, hook.kind, why)
        self.failed += 1

    async def drain(self) -> None:
        """Wait for deliveries in flight (at shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
