"""Intents fetched together become batches: same playbook, ref, timeout and shared vars.

A batch names each host once and holds at most `size` intents; each intent keeps its
own message, so it is acked, or given back for redelivery, on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from gpuops.act.hostdata import batch_key
from gpuops.models import Intent

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Pending:
    """An admitted intent and its message, until it is acked."""

    intent: Intent
    msg: Msg
    tries: int = 0  # set once this executor holds the claim
    done: bool = False  # acked, or given back: nothing more to do with the message

    async def give_back(self) -> None:
        """Let JetStream deliver the intent again (unless it is already acked)."""
        if not self.done:
            self.done = True
            with contextlib.suppress(Exception):
                await self.msg.nak(delay=5)


Batch = list[Pending]


def group(pending: list[Pending], size: int) -> list[Batch]:
    """Batches of at most `size` intents sharing a batch key, each host once per batch."""
    groups: dict[str, list[Batch]] = {}
    for p in pending:
        batches = groups.setdefault(batch_key(p.intent), [])
        home = next((b for b in batches if _fits(b, p.intent, size)), None)
        if home is None:
            batches.append([p])
        else:
            home.append(p)
    return [batch for batches in groups.values() for batch in batches]


def _fits(batch: Batch, intent: Intent, size: int) -> bool:
    return len(batch) < size and all(p.intent.node != intent.node for p in batch)


async def gather(sub: JetStreamContext.PullSubscription, size: int, window_s: float) -> list[Msg]:
    """What is ready now, then what arrives within the window after it (up to `size`)."""
    loop = asyncio.get_running_loop()
    msgs = await _fetch(sub, size, 0.5)
    deadline = loop.time() + window_s
    while msgs and len(msgs) < size and (left := deadline - loop.time()) > 0.05:
        more = await _fetch(sub, size - len(msgs), left)
        if not more:
            break
        msgs += more
    return msgs


async def _fetch(sub: JetStreamContext.PullSubscription, n: int, wait_s: float) -> list[Msg]:
    """Up to `n` messages, [] when none came in time or the connection is being restored."""
    try:
        return list(await sub.fetch(n, timeout=wait_s))
    except (NatsTimeout, TimeoutError):
        return []
    except NatsError as exc:  # a reconnect in progress: the consumer is durable
        log.warning("executor fetch failed (%s); retrying", exc)
        await asyncio.sleep(1.0)
        return []
