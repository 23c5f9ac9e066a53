"""The executor: consumes intents from the actions work queue and runs their playbooks.

It runs only what the engine decided and signed: the signature must verify, the
playbook must be in the catalogue (resolved inside `playbooks/`), and the node must be
exactly one inventory host; an intent that fails any of these is refused alone.
Intents fetched together (or within the gather window) for the same playbook, ref and
shared vars run as one ansible-runner call over their hosts, with forks: a storm on 200
nodes starts a handful of runs, not 200. Each intent of a batch is still checked,
claimed, recorded and acked on its own, with its own outcome from its host's stats.

Before running, each intent's key is claimed in KV with a create (which fails if the
key exists), so an intent redelivered after a crash, or published twice, never runs
twice. A claim found `running` means an earlier executor died mid-run: the run is
retried once where the catalogue says that is safe, otherwise the node goes to a
person. A run's end is written to its claim (`ended`, with the outcome) before the
outcome is recorded, and the claim is `done` after: a claim found `ended` has its
outcome recorded again, never its playbook run again. The intent is acked only after
its outcome is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from pydantic import BaseModel, ConfigDict, ValidationError

from gpuops import subjects
from gpuops.act.batching import Batch, Pending, gather, group
from gpuops.act.completion import Completion, LockRelease
from gpuops.act.evidence import Evidence, RunMeta, new_run_id
from gpuops.act.hostdata import RESERVED
from gpuops.act.playbooks import resolve
from gpuops.act.runenv import RunEnv
from gpuops.act.runner import RunRequest, RunResult, run_hosts_async
from gpuops.bus import durable
from gpuops.bus.auth import EXECUTOR_DURABLE
from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.identity import Signer
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.store import KV, Store
from gpuops.catalog import Catalog
from gpuops.clock import Clock
from gpuops.errors import ActionError
from gpuops.inventory.hosts import Inventory
from gpuops.models import Intent, RunOutcome, RunStatus, subject_for
from gpuops.record.metrics import Metrics
from gpuops.record.recorder import Recorder, decision_msg_id, decision_record
from gpuops.settings import ExecutorSettings
from gpuops.signing import verify

log = logging.getLogger(__name__)

DURABLE = EXECUTOR_DURABLE  # the one name the executor user may consume by
# A running claim is renewed every quarter of `claim_stale_s`; one not renewed for that
# long belongs to an executor that died (a live one may simply be slow: a duplicate copy
# of its intent must not judge it). The intent comes back after the same time.
RECHECK_MARGIN_S = 0.5  # past the moment a claim goes stale, so it is stale when read
ROTATE_EVERY_S = 60.0  # evidence rotation reads every kept run's record: not after each run


@dataclass(frozen=True)
class Busy:
    """Another executor's claim on the intent is fresh: look again after `recheck_s`."""

    recheck_s: float


# The try `_claim` gives an intent too old to run that no executor began: none.
NOT_BEGUN = 0

# A claim's states while an executor holds it (renewed, waited out while fresh): taken
# (`claimed`: the run's start not yet recorded, nothing run), the playbook `running`, the
# run `ended` and its outcome being recorded. `done` ends it.
HELD = ("claimed", "running", "ended")


class Claim(BaseModel):
    """An executor's claim on an intent."""

    model_config = ConfigDict(frozen=True)

    state: Literal["claimed", "running", "ended", "done"]
    at: float
    rule: str = ""
    status: str | None = None
    tries: int = 1
    renewed: float = 0.0
    # Kept while `ended`: the run is over and its outcome is being recorded. An executor
    # that died in between left this, and the next one records it again (recording is
    # idempotent) instead of running the playbook again or calling it interrupted.
    outcome: RunOutcome | None = None

    def done(self) -> Claim:
        """The claim once the outcome is recorded."""
        return self.model_copy(update={"state": "done", "outcome": None})


def interrupted_why(playbook: str, retry_safe: bool, tries: int) -> str:
    """Why an interrupted run is not run again, as the catalogue says of its playbook."""
    if retry_safe:
        return (
            f"the executor running it died on each of its {tries} tries; not run again "
            f"({playbook} is retry-safe, but {tries} interrupted runs need a person)"
        )
    return f"the executor running it died; not run again ({playbook} is not retry-safe)"


class Executor:
    """Runs intents in batches, with at most `parallel` ansible-runner calls at once."""

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
        max_age_s: float = 1800.0,
        runs: ExecutorSettings | None = None,
        evidence: Evidence | None = None,
        run_env: RunEnv | None = None,
        signer: Signer | None = None,
    ) -> None:
        self.bus = bus
        # What its graded runs measured goes on the bus as the executor's word.
        self.teller = JetStreamPublisher(bus.js, signer)
        self.recorder = recorder
        self.clock = clock
        self.claims: Store[Claim] = Store(claims, Claim, "intent")
        self.locks = locks
        self.completion = Completion(recorder, locks, self._ask_probe, catalog, self._tell)
        self.catalog = catalog
        self.inventory = inventory
        self.signing_key = signing_key
        self.metrics = metrics
        self.playbooks_dir = playbooks_dir
        self.cache_dir = cache_dir
        self.max_timeout_s = max_timeout_s
        self.claim_stale_s = claim_stale_s
        # An intent decided longer ago than its node lock's lease (`lock_lease_s`) runs no
        # more: the lock may be another decision's by now, and a signed intent captured
        # off the queue and sent again once its claim aged out must not run twice.
        self.max_age_s = max_age_s
        self.slots = asyncio.Semaphore(parallel)
        self.parallel = parallel
        self.runs = runs or ExecutorSettings()
        self.evidence = evidence
        self.run_env = run_env or RunEnv()
        self._rotated_at: float | None = None
        self._running: set[str] = set()  # run ids in flight: rotation never takes their dirs

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and run intents until `stop` is set; in-flight runs are awaited."""
        if self.evidence is not None:  # what an executor that died mid-run left unsealed
            try:
                await asyncio.to_thread(self.evidence.scrub_unsealed, self.claim_stale_s)
            except OSError as exc:
                log.warning("unsealed runs not scrubbed: %s", exc)
        size = self.runs.batch_size
        config = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.claim_stale_s,
            max_deliver=-1,  # an intent comes back until its run is recorded, however often
            max_ack_pending=max(self.parallel * 4, size * (self.parallel + 1)),
        )
        sub = await self.bus.js.pull_subscribe(
            subjects.ACTIONS, durable=DURABLE, stream=ACTIONS, config=config
        )
        # An existing durable is bound as found: put back what was changed in it (its
        # filter, ack wait, redeliveries, a cap on unacked intents) before running on it.
        want = ConsumerConfig.from_response(config.as_dict())
        want.durable_name, want.filter_subject = DURABLE, subjects.ACTIONS
        await durable.keep(self.bus.js, ACTIONS, await sub.consumer_info(), want)
        tasks: set[asyncio.Task[None]] = set()
        try:
            while not stop.is_set():
                async with self.slots:  # fetch only when a run could start
                    pass
                for batch in await self._admit_all(
                    await gather(sub, self.runs.batch_size, self.runs.gather_window_s)
                ):
                    task = await self._dispatch(batch, stop)
                    if task is not None:
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _admit_all(self, msgs: list[Msg]) -> list[Batch]:
        """Refuse what may not run (each alone); group the rest into batches."""
        admitted = []
        for msg in msgs:
            intent, why = self._admit(msg.data)
            aged = self._aged(intent) if intent is not None and not why else ""
            if intent is not None and not why and not aged:
                admitted.append(Pending(intent, msg))
                continue
            try:
                # Signed and ours, only too old: it may have been taken before it aged.
                if intent is not None and aged and await self._settle_aged(intent, msg):
                    continue
                await self._refuse(intent, why or aged, msg.data)
                await msg.term()
            except Exception:
                log.exception("refusing an intent failed; it will be redelivered")
                with contextlib.suppress(Exception):
                    await msg.nak(delay=5)
        return group(admitted, self.runs.batch_size)

    async def _dispatch(self, batch: Batch, stop: asyncio.Event) -> asyncio.Task[None] | None:
        """Start the batch's run once a slot is free; on stop, hand it back unclaimed."""
        keepalive = asyncio.create_task(self._keep_alive(batch))
        await self.slots.acquire()
        if stop.is_set():
            self.slots.release()
            keepalive.cancel()
            for p in batch:
                with contextlib.suppress(Exception):
                    await p.msg.nak()
            return None
        return asyncio.create_task(self._run_slot(batch, keepalive))

    async def _run_slot(self, batch: Batch, keepalive: asyncio.Task[None]) -> None:
        try:
            await self._run_batch(batch)
        except Exception:
            log.exception("batch handling failed; its intents will be redelivered")
            for p in batch:
                await p.give_back()
        finally:
            keepalive.cancel()
            self.slots.release()

    async def _run_batch(self, batch: Batch) -> None:
        """Claim each intent, run the claimed ones together, record and ack each."""
        claimed = await asyncio.gather(*(self._prepare(p) for p in batch))
        ready = [p for p in claimed if p is not None]
        if not ready:
            return
        outcomes = await self._execute(ready)
        await asyncio.gather(*(self._conclude(p, o) for p, o in zip(ready, outcomes, strict=True)))

    async def _prepare(self, p: Pending) -> Pending | None:
        """The decision's record, the claim, the node's state: None when it must not run."""
        try:
            return await self._claimed(p)
        except Exception:  # this intent alone comes back; the batch runs without it
            log.exception("intent %s could not be claimed; it will be redelivered", p.intent.key)
            await p.give_back()
            return None

    async def _claimed(self, p: Pending) -> Pending | None:
        intent = p.intent
        if intent.decision is not None:  # the decision's record, in case the engine died first
            record = decision_record(intent.decision, [intent.key], intent.decided_at)
            await self.recorder.auditor.write(record, decision_msg_id(intent.decision))
        tries = await self._claim(intent)
        if isinstance(tries, Busy):
            # Never acked while its claim looks alive: if that executor died just after
            # claiming, this message is the only thing left that will record the run.
            await p.msg.nak(delay=tries.recheck_s)
            p.done = True
            return None
        if tries is None:
            await p.msg.ack()
            p.done = True
            return None
        # The claim says `running` only once the start is recorded: one left `claimed`
        # (the record refused, the bus away, a crash) ran nothing and is taken again.
        await self.completion.started(intent)
        now = self.clock.now()
        running = Claim(state="running", at=now, rule=intent.rule, tries=tries, renewed=now)
        await self.claims.put(running, intent.key)
        p.tries = tries
        return p

    async def _conclude(self, p: Pending, outcome: RunOutcome) -> None:
        """Record the outcome, then ack; a failure gives back this intent alone."""
        try:
            await self._finish(p.intent, outcome, p.tries)
            await p.msg.ack()
            p.done = True
        except Exception:
            log.exception("outcome of %s not recorded; it will be redelivered", p.intent.key)
            await p.give_back()

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
        if clash := RESERVED & set(intent.action.vars):
            return intent, f"action vars may not redefine {sorted(clash)}"
        return intent, ""

    def _aged(self, intent: Intent) -> str:
        """Why an intent is too old to run ('' when it is not)."""
        age = self.clock.now() - intent.decided_at
        if age <= self.max_age_s:
            return ""
        return (
            f"decided {age:.0f} s ago, longer than a node lock's lease "
            f"({self.max_age_s:.0f} s): the engine decides again if the fault is still there"
        )

    async def _refuse(self, intent: Intent | None, why: str, raw: bytes) -> None:
        self.metrics.runs.labels(RunStatus.REFUSED.value).inc()
        log.warning("intent refused: %s", why)
        await self.recorder.auditor.note(
            self.clock.now(),
            intent.node if intent is not None and intent.node in self.inventory else "",
            f"intent refused, nothing run: {why}",
            {"raw": raw[:2048].decode(errors="replace")},
        )

    async def _claim(self, intent: Intent, may_start: bool = True) -> int | Busy | None:
        """The try number when this executor now runs the intent; Busy while another
        executor's claim on it is fresh; None when it must not run (ack it).

        `may_start` False (an intent too old to run): only a run some executor began is
        settled (an ended run recorded, one cut short recorded as interrupted, never run
        again); NOT_BEGUN when none began, so the intent is refused.
        """
        now = self.clock.now()
        fresh = Claim(state="claimed", at=now, rule=intent.rule, renewed=now)
        if may_start and await self.claims.cas(fresh, 0, intent.key):
            return 1
        held, revision = await self.claims.get(intent.key)
        if not may_start and (held is None or held.state not in ("running", "ended")):
            return NOT_BEGUN
        if held is not None and held.state in HELD:
            age = now - held.renewed
            if age < self.claim_stale_s:
                # Alive, or died before its first renewal (the claim is written after the
                # message's ack timer started, so the message can come back first). Looked
                # at again as often as a live claim is renewed, and just after it would go
                # stale: a copy of a live run's intent is acked soon after that run ends.
                wait = min(self.claim_stale_s - age, self.claim_stale_s / 4)
                return Busy(wait + RECHECK_MARGIN_S)
        if held is not None and held.state == "claimed":  # its start never recorded: ran nothing
            again = held.model_copy(update={"at": now, "renewed": now})
            return again.tries if await self.claims.cas(again, revision, intent.key) else None
        if held is not None and held.state == "ended" and held.outcome is not None:
            await self._record_again(intent, held, revision)
            return None
        if held is None or held.state != "running":
            done = held.status if held else "claimed"
            await self.recorder.auditor.note(
                now,
                intent.node,
                f"intent {intent.key[:12]} already {done}; not run again",
                {"intent": intent.key},
            )
            return None
        spec = self.catalog.get(intent.action.playbook)
        retry_safe = may_start and spec is not None and spec.retry_safe
        if retry_safe and held.tries < 2:
            again = Claim(
                state="claimed", at=now, rule=intent.rule, tries=held.tries + 1, renewed=now
            )
            return again.tries if await self.claims.cas(again, revision, intent.key) else None
        await self._interrupted(intent, held, revision, retry_safe)
        return None

    async def _record_again(self, intent: Intent, held: Claim, revision: int) -> None:
        """The run ended and its executor died while recording it: record it again."""
        taken = held.model_copy(update={"renewed": self.clock.now()})
        if await self.claims.cas(taken, revision, intent.key):
            await self._conclude_claim(intent, taken)

    async def _settle_aged(self, intent: Intent, msg: Msg) -> bool:
        """An intent too old to run: settled as `_claim` settles a run some executor
        began; False when none began (refuse it)."""
        taken = await self._claim(intent, may_start=False)
        if taken == NOT_BEGUN:
            return False
        if isinstance(taken, Busy):  # its executor is alive: look again when it may not be
            await msg.nak(delay=taken.recheck_s)
        else:
            await msg.ack()
        return True

    async def _interrupted(
        self, intent: Intent, held: Claim, revision: int, retry_safe: bool
    ) -> None:
        """An earlier executor died mid-run: record it, free the node, tell a person."""
        now = self.clock.now()
        why = interrupted_why(intent.action.playbook, retry_safe, held.tries)
        outcome = RunOutcome.of(intent, RunStatus.INTERRUPTED, held.at, now, why)
        ended = self._ended(intent, outcome, held.tries)
        if await self.claims.cas(ended, revision, intent.key):
            await self._conclude_claim(intent, ended)

    async def _finish(self, intent: Intent, outcome: RunOutcome, tries: int) -> None:
        ended = self._ended(intent, outcome, tries)
        await self.claims.put(ended, intent.key)
        await self._conclude_claim(intent, ended)

    def _ended(self, intent: Intent, outcome: RunOutcome, tries: int) -> Claim:
        return Claim(
            state="ended",
            at=outcome.ended,
            rule=intent.rule,
            status=outcome.status.value,
            tries=tries,
            renewed=self.clock.now(),
            outcome=outcome,
        )

    async def _conclude_claim(self, intent: Intent, ended: Claim) -> None:
        """Record an ended claim's outcome, then mark the claim done: a crash in between
        leaves it `ended`, and the intent's next delivery records it again."""
        assert ended.outcome is not None
        await self._record(intent, ended.outcome)
        await self.claims.put(ended.done(), intent.key)

    async def _record(self, intent: Intent, outcome: RunOutcome) -> None:
        self.metrics.runs.labels(outcome.status.value).inc()
        await self.completion.ended(intent, outcome)

    async def _ask_probe(self, node: str, nonce: str) -> None:
        """The node's agent runs its probe: its answer, echoing the nonce, decides whether
        the node returns."""
        request = json.dumps({"nonce": nonce}).encode()
        await self.bus.nc.publish(subjects.probe_request(node), request)

    async def _tell(self, event: dict[str, Any]) -> None:
        """A graded run's result, an event the engine decides (a failed gate climbs)."""
        payload = json.dumps(event).encode()
        await self.teller.publish(subject_for(event["kind"], event["node"]), payload, event["id"])

    async def _execute(self, ready: Batch) -> list[RunOutcome]:
        """One run over the batch's hosts; an outcome per intent, in order."""
        intents = [p.intent for p in ready]
        first = intents[0].action
        try:
            version = resolve(self.playbooks_dir, first.playbook, first.ref, self.cache_dir)
        except ActionError as exc:
            now = self.clock.now()
            return [RunOutcome.of(i, RunStatus.ERROR, now, now, str(exc)) for i in intents]
        run_id = new_run_id(self.clock.now())
        request = RunRequest.for_intents(
            intents,
            version,
            self.inventory.path,
            min(first.timeout_s, self.max_timeout_s),
            forks=self.runs.forks,
            run_id=run_id,
            evidence=self.evidence,
            env=self.run_env,
        )
        with_others = f" (one run with {len(intents) - 1} other hosts)" if len(intents) > 1 else ""
        body = {"run_id": run_id, "revision": version.revision, "sha256": version.sha256}
        await asyncio.gather(
            *(
                self.recorder.auditor.note(
                    self.clock.now(),
                    i.node,
                    f"running {first.playbook} on {i.node}{with_others}",
                    {"intent": i.key, **body},
                )
                for i in intents
            )
        )
        self._running.add(run_id)
        try:
            result = await run_hosts_async(request, self.clock)
        finally:
            self._running.discard(run_id)
        if self.evidence is not None:
            await asyncio.to_thread(self._keep, self.evidence, result)
        return [result.outcome(t) for t in request.targets]

    def _keep(self, evidence: Evidence, result: RunResult) -> None:
        """Seal the run's evidence; now and then drop what is past the limits."""
        req = result.req
        meta = RunMeta(
            run_id=req.run_id or "",
            playbook=req.playbook_name,
            revision=req.playbook.revision,
            sha256=req.playbook.sha256,
            started=result.started,
            ended=result.ended,
            status=result.status,
            rc=result.rc,
            intents={t.node: t.key for t in req.targets},
        )
        try:
            evidence.seal(meta)
            now = self.clock.now()
            if self._rotated_at is None or now - self._rotated_at >= ROTATE_EVERY_S:
                self._rotated_at = now
                evidence.rotate(now, in_flight=frozenset(self._running))
        except (OSError, ActionError) as exc:  # evidence is kept best-effort: the run counts
            log.warning("run %s: evidence not kept: %s", req.run_id, exc)

    async def _keep_alive(self, batch: Batch) -> None:
        """Tell JetStream and the claims that the intents are in hand (not redelivered, alive)."""
        while True:
            await asyncio.sleep(self.claim_stale_s / 4)
            now = self.clock.now()
            await asyncio.gather(
                *(self._renew(p, now) for p in batch if not p.done), return_exceptions=True
            )

    async def _renew(self, p: Pending, now: float) -> None:
        await p.msg.in_progress()
        if p.tries:
            await self.claims.update(partial(_renewed, now=now), p.intent.key)


def _renewed(claim: Claim | None, now: float) -> Claim | None:
    """A held claim renewed at `now` (a done one is left alone)."""
    if claim is None or claim.state not in HELD:
        return None
    return claim.model_copy(update={"renewed": now})
