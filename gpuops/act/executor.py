"""The executor: consumes intents from the actions work queue and runs their playbooks.

It runs only what the engine decided and signed: the signature must verify, the
playbook must be in the catalogue (resolved inside `playbooks/`), and the node must be
exactly one inventory host. Before running, it claims the intent's key in KV with a
create (which fails if the key exists), so an intent redelivered after a crash, or
published twice, never runs twice. A claim found `running` means an earlier executor
died mid-run: the run is retried once where the catalogue says that is safe, otherwise
the node goes to a person. The intent is acked only after the outcome is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial
from pathlib import Path
from typing import Protocol

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from pydantic import BaseModel, ConfigDict, ValidationError

from gpuops import subjects
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_async
from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.store import KV, Store
from gpuops.catalog import Catalog
from gpuops.clock import Clock
from gpuops.errors import ActionError
from gpuops.inventory import Inventory
from gpuops.models import Intent, RunOutcome, RunStatus
from gpuops.record.metrics import Metrics
from gpuops.record.nodestate import NodeState
from gpuops.record.recorder import Recorder, decision_msg_id, decision_record
from gpuops.signing import verify

log = logging.getLogger(__name__)

DURABLE = "gpuops-executor"
# A running claim is renewed every quarter of `claim_stale_s`; one not renewed for that
# long belongs to an executor that died (a live one may simply be slow: a duplicate copy
# of its intent must not judge it). The intent comes back after the same time.


class LockRelease(Protocol):
    """What the executor needs of the decide layer's node locks."""

    async def release(self, node: str, event_id: str) -> bool:
        """Give the node back when this event's decision holds it."""
        ...


class Claim(BaseModel):
    """An executor's claim on an intent."""

    model_config = ConfigDict(frozen=True)

    state: str  # running | done
    at: float
    rule: str = ""
    status: str | None = None
    tries: int = 1
    renewed: float = 0.0


class Executor:
    """Runs intents with at most `parallel` playbooks at once."""

    def __init__(
        self,
        bus: Bus,
        recorder: Recorder,
        clock: Clock,
        *,
        claims: KV,
        locks: LockRelease,
        catalog: Catalog,
        inventory: Inventory,
        signing_key: bytes,
        metrics: Metrics,
        playbooks_dir: Path,
        cache_dir: Path,
        parallel: int = 4,
        max_timeout_s: float = 900.0,
        claim_stale_s: float = 90.0,
    ) -> None:
        self.bus = bus
        self.recorder = recorder
        self.clock = clock
        self.claims: Store[Claim] = Store(claims, Claim, "intent")
        self.locks = locks
        self.catalog = catalog
        self.inventory = inventory
        self.signing_key = signing_key
        self.metrics = metrics
        self.playbooks_dir = playbooks_dir
        self.cache_dir = cache_dir
        self.max_timeout_s = max_timeout_s
        self.claim_stale_s = claim_stale_s
        self.slots = asyncio.Semaphore(parallel)
        self.parallel = parallel

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and run intents until `stop` is set; in-flight runs are awaited."""
        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.claim_stale_s,
            max_ack_pending=self.parallel * 4,
        )
        sub = await self.bus.js.pull_subscribe(
            "gpuops.actions.>", durable=DURABLE, stream=ACTIONS, config=config
        )
        tasks: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                await self.slots.acquire()
                try:
                    msgs = await sub.fetch(1, timeout=0.5)
                except (NatsTimeout, TimeoutError):
                    self.slots.release()
                    continue
                except NatsError as exc:  # a reconnect in progress: the consumer is durable
                    self.slots.release()
                    log.warning("executor fetch failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
                task = asyncio.create_task(self._handle_slot(msgs[0]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
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
        """Check, claim, run, record, then ack one intent."""
        intent, why = self._admit(msg.data)
        if intent is None or why:
            await self._refuse(intent, why, msg.data)
            await msg.term()
            return
        if intent.decision is not None:  # the decision's record, in case the engine died first
            record = decision_record(intent.decision, [intent.key], intent.decided_at)
            await self.recorder.auditor.write(record, decision_msg_id(intent.decision))
        tries = await self._claim(intent)
        if tries is None:
            await msg.ack()
            return
        await self.recorder.run_started(intent)
        outcome = await self._execute(intent, msg)
        await self._finish(intent, outcome, tries)
        await msg.ack()

    def _admit(self, data: bytes) -> tuple[Intent | None, str]:
        """The intent and '' when it may run, else why not."""
        try:
            intent = Intent.model_validate_json(data)
        except ValidationError as exc:
            return None, f"unreadable intent: {exc.error_count()} errors"
        if not verify(intent, self.signing_key):
            return intent, "signature does not verify: not decided by this engine"
        if intent.action.playbook not in self.catalog:
            return intent, f"playbook {intent.action.playbook!r} is not in the catalogue"
        if intent.node not in self.inventory:
            return intent, f"{intent.node!r} is not one host of the inventory"
        return intent, ""

    async def _refuse(self, intent: Intent | None, why: str, raw: bytes) -> None:
        self.metrics.runs.labels(RunStatus.REFUSED.value).inc()
        log.warning("intent refused: %s", why)
        await self.recorder.auditor.note(
            self.clock.now(),
            intent.node if intent is not None and intent.node in self.inventory else "",
            f"intent refused, nothing run: {why}",
            {"raw": raw[:2048].decode(errors="replace")},
        )

    async def _claim(self, intent: Intent) -> int | None:
        """The try number when this executor now runs the intent; None when it must not."""
        now = self.clock.now()
        fresh = Claim(state="running", at=now, rule=intent.rule, renewed=now)
        if await self.claims.cas(fresh, 0, intent.key):
            return 1
        held, revision = await self.claims.get(intent.key)
        alive = (
            held is not None and held.state == "running" and now - held.renewed < self.claim_stale_s
        )
        if held is None or held.state != "running" or alive:
            done = "running elsewhere" if alive else (held.status if held else "claimed")
            await self.recorder.auditor.note(
                now,
                intent.node,
                f"intent {intent.key[:12]} already {done}; not run again",
                {"intent": intent.key},
            )
            return None
        spec = self.catalog.get(intent.action.playbook)
        if spec is not None and spec.retry_safe and held.tries < 2:
            again = Claim(
                state="running", at=now, rule=intent.rule, tries=held.tries + 1, renewed=now
            )
            return again.tries if await self.claims.cas(again, revision, intent.key) else None
        await self._interrupted(intent, held, revision)
        return None

    async def _interrupted(self, intent: Intent, held: Claim, revision: int) -> None:
        """An earlier executor died mid-run: record it, free the node, tell a person."""
        now = self.clock.now()
        why = "the executor running it died; not run again (the playbook is not retry-safe)"
        outcome = RunOutcome.of(intent, RunStatus.INTERRUPTED, held.at, now, why)
        done = Claim(state="done", at=now, rule=intent.rule, status=outcome.status.value)
        if await self.claims.cas(done, revision, intent.key):
            await self._record(intent, outcome)

    async def _finish(self, intent: Intent, outcome: RunOutcome, tries: int) -> None:
        done = Claim(
            state="done",
            at=outcome.ended,
            rule=intent.rule,
            status=outcome.status.value,
            tries=tries,
        )
        await self._record(intent, outcome)
        await self.claims.put(done, intent.key)

    async def _record(self, intent: Intent, outcome: RunOutcome) -> None:
        self.metrics.runs.labels(outcome.status.value).inc()
        record = await self.recorder.run_ended(intent, outcome)
        if intent.holds_lock:
            await self.locks.release(intent.node, intent.event_id)
        if record.state is NodeState.VALIDATING and outcome.status is RunStatus.SUCCESSFUL:
            await self.bus.nc.publish(subjects.probe_request(intent.node), b"validate")

    async def _execute(self, intent: Intent, msg: Msg) -> RunOutcome:
        try:
            version = resolve(
                self.playbooks_dir, intent.action.playbook, intent.action.ref, self.cache_dir
            )
        except ActionError as exc:
            now = self.clock.now()
            return RunOutcome.of(intent, RunStatus.ERROR, now, now, str(exc))
        await self.recorder.auditor.note(
            self.clock.now(),
            intent.node,
            f"running {intent.action.playbook} on {intent.node}",
            {"intent": intent.key, "revision": version.revision, "sha256": version.sha256},
        )
        timeout = min(intent.action.timeout_s, self.max_timeout_s)
        request = RunRequest.for_intent(intent, version, self.inventory.path, timeout)
        keepalive = asyncio.create_task(self._keep_alive(msg, intent))
        try:
            return await run_async(request, self.clock)
        finally:
            keepalive.cancel()

    async def _keep_alive(self, msg: Msg, intent: Intent) -> None:
        """Tell JetStream and the claim that the run goes on (not redelivered, not judged dead)."""
        while True:
            await asyncio.sleep(self.claim_stale_s / 4)
            now = self.clock.now()
            with contextlib.suppress(Exception):
                await msg.in_progress()

                await self.claims.update(partial(_renewed, now=now), intent.key)


def _renewed(claim: Claim | None, now: float) -> Claim | None:
    """A running claim renewed at `now` (others are left alone)."""
    if claim is None or claim.state != "running":
        return None
    return claim.model_copy(update={"renewed": now})
