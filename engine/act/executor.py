"""The executor: consumes intents from the actions work queue and runs their playbooks.

Before running, it claims the intent's idempotency key in KV with a create (which
fails if the key exists), so an intent redelivered after a crash, or published twice,
never runs twice. The intent is acked only after the outcome is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from engine.act.playbooks import resolve
from engine.act.runner import RunRequest, run_async
from engine.bus.conn import ACTIONS, Bus
from engine.clock import Clock
from engine.decide.lock import release
from engine.errors import ActionError
from engine.models import AuditRecord, Intent, RunOutcome, RunStatus
from engine.record.audit import Auditor
from engine.record.lifecycle import Lifecycle

log = logging.getLogger(__name__)

DURABLE = "gpuops-executor"


class Executor:
    """Runs intents with at most `parallel` playbooks at once."""

    def __init__(
        self,
        bus: Bus,
        auditor: Auditor,
        clock: Clock,
        *,
        playbooks_dir: Path,
        inventory: Path,
        cache_dir: Path,
        parallel: int = 4,
        max_timeout_s: float = 900.0,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.bus = bus
        self.auditor = auditor
        self.clock = clock
        self.playbooks_dir = playbooks_dir
        self.inventory = inventory
        self.cache_dir = cache_dir
        self.max_timeout_s = max_timeout_s
        self.slots = asyncio.Semaphore(parallel)
        self.parallel = parallel
        self.outcomes: list[RunOutcome] = []
        self.lifecycle = lifecycle

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and run intents until `stop` is set; in-flight runs are awaited."""
        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, ack_wait=60.0, max_ack_pending=self.parallel * 4
        )
        sub = await self.bus.js.pull_subscribe(
            "gpuops.actions.>", durable=DURABLE, stream=ACTIONS, config=config
        )
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            await self.slots.acquire()
            try:
                msgs = await sub.fetch(1, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                self.slots.release()
                continue
            task = asyncio.create_task(self._handle_slot(msgs[0]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle_slot(self, msg: Msg) -> None:
        try:
            await self.handle(msg)
        except Exception:
            log.exception("intent handling failed; it will be redelivered")
            with contextlib.suppress(Exception):
                await msg.nak(delay=5)
        finally:
            self.slots.release()

    async def handle(self, msg: Msg) -> None:
        """Claim, run, record, then ack one intent."""
        try:
            intent = Intent.model_validate_json(msg.data)
        except ValueError as exc:
            await self.auditor.note(
                self.clock.now(),
                "",
                f"unreadable intent dropped: {exc}",
                {"raw": msg.data.decode(errors="replace")},
            )
            await msg.term()
            return
        claim = await self._claim(intent)
        if claim is not None:
            await self.auditor.note(
                self.clock.now(),
                intent.node,
                f"intent {intent.key[:12]} already {claim}; not run again",
                {"intent": intent.key, "rule": intent.rule, "claim": claim},
            )
            await msg.ack()
            return
        if self.lifecycle is not None:
            await self.lifecycle.run_started(intent)
        outcome = await self._execute(intent, msg)
        self.outcomes.append(outcome)
        await self.auditor.write(
            AuditRecord(
                type="run",
                at=self.clock.now(),
                node=intent.node,
                rule=intent.rule,
                summary=f"{outcome.playbook} {outcome.status.value} rc={outcome.rc} "
                f"in {outcome.duration_s:.1f}s",
                body=outcome.model_dump(mode="json"),
            )
        )
        await self._finish_claim(intent, outcome)
        await release(self.bus.kv["locks"], intent.node, intent.event_id)
        if self.lifecycle is not None:
            await self.lifecycle.run_ended(intent, outcome)
        await msg.ack()

    async def _claim(self, intent: Intent) -> str | None:
        """None when this executor now owns the intent, else the state of the earlier claim."""
        kv = self.bus.kv["claims"]
        body = json.dumps({"state": "running", "at": self.clock.now(), "rule": intent.rule})
        try:
            await kv.create(intent.key, body.encode())
            return None
        except KeyWrongLastSequenceError:
            pass
        try:
            entry = await kv.get(intent.key)
        except KeyNotFoundError:
            return "claimed"
        # "running" here means an earlier executor died mid-run: a person decides, not a retry.
        state = json.loads(entry.value or b"{}").get("state", "claimed")
        return "interrupted while running" if state == "running" else str(state)

    async def _finish_claim(self, intent: Intent, outcome: RunOutcome) -> None:
        body = {"state": "done", "status": outcome.status.value, "at": outcome.ended}
        await self.bus.kv["claims"].put(intent.key, json.dumps(body).encode())

    async def _execute(self, intent: Intent, msg: Msg) -> RunOutcome:
        try:
            version = resolve(
                self.playbooks_dir, intent.action.playbook, intent.action.ref, self.cache_dir
            )
        except ActionError as exc:
            now = self.clock.now()
            return RunOutcome(
                intent_key=intent.key,
                rule=intent.rule,
                node=intent.node,
                playbook=intent.action.playbook,
                status=RunStatus.ERROR,
                started=now,
                ended=now,
                error=str(exc),
            )
        await self.auditor.note(
            self.clock.now(),
            intent.node,
            f"running {intent.action.playbook} on {intent.node}",
            {"intent": intent.key, "revision": version.revision, "sha256": version.sha256},
        )
        timeout = min(intent.action.timeout_s, self.max_timeout_s)
        request = RunRequest.for_intent(intent, version, self.inventory, timeout)
        keepalive = asyncio.create_task(_keep_in_progress(msg))
        try:
            return await run_async(request, self.clock)
        finally:
            keepalive.cancel()


async def _keep_in_progress(msg: Msg) -> None:
    """Tell JetStream the intent is still being worked on, so it is not redelivered mid-run."""
    while True:
        await asyncio.sleep(20)
        with contextlib.suppress(Exception):
            await msg.in_progress()
