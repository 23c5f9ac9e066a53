"""An executor that died just after claiming an intent: its run is recorded, never lost.

Real nats-server and executor. The claim of a dead executor is written into the claims
bucket as it would have left it: running, renewed a moment ago (it died before its first
renewal). The intent's message reaches the live executor while that claim is still
fresh; it must not be acked then (nothing else would ever record the run), and once the
claim is stale the run is recorded as interrupted and the node handed to a person.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from gpuops import subjects
from gpuops.act.executor import DURABLE, Claim
from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV, Store
from gpuops.models import ActionSpec, Intent, RunOutcome, RunStatus, action_subject
from gpuops.record.audit import read_audit
from gpuops.record.nodestate import NodeState, NodeStates, after_run_started
from gpuops.signing import load_key, sign
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import signing_key_path
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from tests.conftest import calls, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = pytest.mark.integration
NODE = "node-001"
STALE_S = 3.0


def _reboot(now: float, playbook: str = "reboot.yml") -> Intent:
    return Intent(
        key="died-after-claim",
        rule="xid-79",
        node=NODE,
        action=ActionSpec(playbook=playbook, vars={"reason": "XID 79"}),  # not retry-safe
        event_id="event-1",
        event_ts=now,
        decided_at=now,
    )


async def test_a_fresh_claim_of_a_dead_executor_is_waited_out_then_recorded_interrupted(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, role="executor", run_claim_stale_s=STALE_S
    )
    now = time.time()
    intent = sign(_reboot(now), load_key(signing_key_path(settings)))
    claims: Store[Claim] = Store(NatsKV(bus.kv["claims"]), Claim, "intent")
    await claims.put(Claim(state="running", at=now, rule=intent.rule, renewed=now), intent.key)
    await bus.js.publish(action_subject(NODE), intent.model_dump_json().encode())

    async with running_engine(settings, bus):
        await wait_for(lambda: _delivered(bus), 30)  # seen while the claim is fresh
        states = NodeStates(NatsKV(bus.kv["nodes"]))

        async def handed_over() -> bool:
            return (await states.get(NODE)).state is NodeState.NEEDS_HUMAN

        await wait_for(handed_over, 30)

    (outcome,) = await run_outcomes(bus, NODE)
    assert outcome.status is RunStatus.INTERRUPTED and outcome.intent_key == intent.key
    assert outcome.error is not None and "reboot.yml is not retry-safe" in outcome.error
    assert "interrupted" in (await states.get(NODE)).why
    assert calls(fleet, NODE, "reboot") == [], "not run again: the playbook is not retry-safe"
    notes = [r.summary async for r in read_audit(bus.js, NODE) if r.type == "note"]
    assert not any("not run again" in n for n in notes), notes
    held, _ = await claims.get(intent.key)
    assert held is not None and held.state == "done" and held.status == "interrupted"
    assert (await bus.js.stream_info(ACTIONS)).state.messages == 0, "acked once recorded"


async def _delivered(bus: Bus, times: int = 1) -> bool:
    try:
        info = await bus.js.consumer_info(ACTIONS, DURABLE)
    except NotFoundError:  # the executor has not made its consumer yet
        return False
    return int(info.delivered.consumer_seq or 0) >= times


async def test_a_retry_safe_run_interrupted_on_each_try_says_so_not_that_it_is_unsafe(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    """gpu_reset.yml is retry-safe (the catalogue): killed on its second try too, the
    record says it was retried and stopped, never that it is not retry-safe."""
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, role="executor", run_claim_stale_s=STALE_S
    )
    then = time.time() - 10 * STALE_S  # both tries' executor died long ago
    intent = sign(_reboot(then, "gpu_reset.yml"), load_key(signing_key_path(settings)))
    claims: Store[Claim] = Store(NatsKV(bus.kv["claims"]), Claim, "intent")
    stale = Claim(state="running", at=then, rule=intent.rule, renewed=then, tries=2)
    await claims.put(stale, intent.key)
    await bus.js.publish(action_subject(NODE), intent.model_dump_json().encode())
    async with running_engine(settings, bus):
        await wait_for(lambda: _outcomes(bus), 30)
    (outcome,) = await run_outcomes(bus, NODE)
    assert outcome.status is RunStatus.INTERRUPTED and outcome.error is not None
    assert "gpu_reset.yml is retry-safe" in outcome.error and "2 tries" in outcome.error
    assert "not retry-safe" not in outcome.error
    assert calls(fleet, NODE, "nvidia-smi") == [], "not run a third time"


async def _outcomes(bus: Bus) -> bool:
    return bool(await run_outcomes(bus, NODE))


async def test_a_run_whose_executor_died_while_recording_it_is_recorded_not_run_again(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    """The reboot ran and succeeded; its executor wrote the end to the claim and died
    before the outcome reached the record. The next executor records that outcome: the
    node does not reboot twice, nor go to a person as interrupted."""
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, role="executor", run_claim_stale_s=STALE_S
    )
    then = time.time() - 10 * STALE_S
    intent = sign(_reboot(then), load_key(signing_key_path(settings)))
    states = NodeStates(NatsKV(bus.kv["nodes"]))
    await states.apply(NODE, lambda r: after_run_started(r, "reboot.yml", then))
    ran = RunOutcome.of(intent, RunStatus.SUCCESSFUL, then, then + 5)
    claims: Store[Claim] = Store(NatsKV(bus.kv["claims"]), Claim, "intent")
    ended = Claim(
        state="ended",
        at=then + 5,
        rule=intent.rule,
        status="successful",
        renewed=then + 5,
        outcome=ran,
    )
    await claims.put(ended, intent.key)
    await bus.js.publish(action_subject(NODE), intent.model_dump_json().encode())
    async with running_engine(settings, bus):
        await wait_for(lambda: _outcomes(bus), 30)
    (outcome,) = await run_outcomes(bus, NODE)
    assert outcome.status is RunStatus.SUCCESSFUL and (outcome.started, outcome.ended) == (
        then,
        then + 5,
    ), "the run's own outcome, not one made up now"
    record = await states.get(NODE)
    assert record.state is NodeState.HEALTHY and "reboot.yml succeeded" in record.why
    assert calls(fleet, NODE, "reboot") == [], "the reboot ran once, before the crash"
    held, _ = await claims.get(intent.key)
    assert held is not None and (held.state, held.status, held.outcome) == (
        "done",
        "successful",
        None,
    )
    assert (await bus.js.stream_info(ACTIONS)).state.messages == 0, "acked once recorded"


async def test_an_intent_whose_start_could_not_be_recorded_is_not_held_as_running(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    """The node's record is unreadable, so the run's start cannot be recorded and nothing
    runs. The claim goes back: once the record is repaired, the intent runs, rather than
    being called interrupted when a claim of a run that never began goes stale."""
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, role="executor", run_claim_stale_s=STALE_S
    )
    intent = sign(_reboot(time.time()), load_key(signing_key_path(settings)))
    nodes = NatsKV(bus.kv["nodes"])
    states = NodeStates(nodes)
    await nodes.put(states.store.key(NODE), b"garbage")
    claims: Store[Claim] = Store(NatsKV(bus.kv["claims"]), Claim, "intent")
    await bus.js.publish(action_subject(NODE), intent.model_dump_json().encode())
    async with running_engine(settings, bus):
        await wait_for(lambda: _delivered(bus, times=2), 30)  # tried, given back, tried again
        await asyncio.sleep(2 * STALE_S)  # a claim left running would be stale by now
        assert calls(fleet, NODE, "reboot") == [] and await run_outcomes(bus, NODE) == []
        held, _ = await claims.get(intent.key)
        assert held is None or held.state != "done", "not concluded without a run"
        await nodes.put(states.store.key(NODE), b'{"node": "node-001"}')  # repaired
        await wait_for(lambda: _outcomes(bus), 60)
    (outcome,) = await run_outcomes(bus, NODE)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert len(calls(fleet, NODE, "reboot")) == 1


async def test_a_run_ended_long_ago_whose_record_was_cut_short_is_recorded_not_refused(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    """An intent older than a lock's lease runs no more, but one an executor took, ran
    and died recording is not refused unheard: its run's outcome is recorded."""
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, role="executor", run_claim_stale_s=STALE_S
    )
    then = time.time() - 7200  # decided two hours ago: past any lock's lease
    intent = sign(_reboot(then), load_key(signing_key_path(settings)))
    states = NodeStates(NatsKV(bus.kv["nodes"]))
    await states.apply(NODE, lambda r: after_run_started(r, "reboot.yml", then))
    ran = RunOutcome.of(intent, RunStatus.SUCCESSFUL, then, then + 900)
    claims: Store[Claim] = Store(NatsKV(bus.kv["claims"]), Claim, "intent")
    ended = Claim(
        state="ended", at=then + 900, rule=intent.rule, status="successful", renewed=then + 900,
        outcome=ran,
    )  # fmt: skip
    await claims.put(ended, intent.key)
    await bus.js.publish(action_subject(NODE), intent.model_dump_json().encode())
    async with running_engine(settings, bus):
        await wait_for(lambda: _outcomes(bus), 30)
    (outcome,) = await run_outcomes(bus, NODE)
    assert (outcome.status, outcome.ended) == (RunStatus.SUCCESSFUL, then + 900)
    assert (await states.get(NODE)).state is NodeState.HEALTHY
    assert calls(fleet, NODE, "reboot") == []
    notes = [r.summary async for r in read_audit(bus.js, NODE) if r.type == "note"]
    assert not any("intent refused" in n for n in notes), notes
    assert (await bus.js.stream_info(ACTIONS)).state.messages == 0


async def test_the_executors_durable_changed_behind_its_back_is_put_back(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    """Review of issue 30: the executor compared only what its wanted config set, so a
    durable changed to deliver each intent once (a crash's intents dropped) or to be
    deleted when idle ran on as changed."""
    settings = engine_settings(tmp_path, fleet, nats_server.url, role="executor")
    tampered = ConsumerConfig(
        durable_name=DURABLE,
        filter_subject=subjects.ACTIONS,
        ack_policy=AckPolicy.EXPLICIT,
        max_deliver=1,
        inactive_threshold=600.0,
    )
    await bus.js.add_consumer(ACTIONS, tampered)

    async def put_back() -> bool:
        config = (await bus.js.consumer_info(ACTIONS, DURABLE)).config
        return config.max_deliver == -1 and not config.inactive_threshold

    async with running_engine(settings, bus):
        await wait_for(put_back, 30)
