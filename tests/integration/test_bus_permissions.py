"""What one NATS user may not do to another's work, on a real server with the real
permissions: read or answer another's deliveries through its inbox (an operator
another operator's too), or change the engine's consumers through the JetStream API;
and what a role notices when its own durable consumer was changed behind its back."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import nats
import pytest
from gpuops import subjects
from gpuops.bus.auth import Credentials, node_credentials, operators_dir, read_credentials
from gpuops.bus.conn import ACTIONS, EVENTS, Bus, open_bus
from gpuops.bus.embedded import enrol
from gpuops.bus.partitions import durable
from gpuops.bus.reader import slot_read
from gpuops.clock import SystemClock
from gpuops.errors import BusError
from gpuops.intake.consumer import Intake
from gpuops.settings import NatsSettings
from gpuops.signing import load_key
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from tests.conftest import wait_for

pytestmark = pytest.mark.integration


async def _client(cred: Credentials, url: str, inbox: str, errors: list[str]) -> Client:
    async def collect(exc: Exception) -> None:
        errors.append(str(exc).lower())  # nats-py lowercases the server's line anyway

    return await nats.connect(
        url,
        user=cred.user,
        password=cred.password,
        error_cb=collect,
        allow_reconnect=False,
        inbox_prefix=inbox,
    )


async def _refused(errors: list[str], verb: str, subject: str) -> bool:
    return f'permissions violation for {verb} to "{subject.lower()}"' in " ".join(errors)


async def test_no_other_user_reads_or_answers_the_executors_deliveries(tmp_path: Path) -> None:
    state = tmp_path / "state"
    enrol(state, ["node-001"], load_key(state / "keys" / "identity.key", "identity key"))
    async with open_bus(NatsSettings(), state) as engine:
        await engine.js.publish("gpuops.actions.node-001", b'{"intent": 1}')
        snoops = {
            "node": (node_credentials(state, "node-001"), subjects.node_inbox("node-001")),
            "cli": (read_credentials(state, "cli"), subjects.operator_inbox("operator")),
        }
        for who, (cred, inbox) in snoops.items():
            await _snoop_on_the_executor(state, engine.url, who, cred, inbox)
        assert (await engine.js.stream_info(ACTIONS)).state.messages == 1, "not terminated"


async def _snoop_on_the_executor(
    state: Path, url: str, who: str, cred: Credentials, inbox: str
) -> None:
    """`who` tries to hear the executor's delivery of the intent queued, and to end it."""
    errors: list[str] = []
    snoop = await _client(cred, url, inbox, errors)
    try:
        heard = [await snoop.subscribe(s) for s in ("_INBOX.>", "_INBOX.executor.>")]
        for subject in ("_INBOX.>", "_INBOX.executor.>"):
            await wait_for(lambda s=subject: _refused(errors, "subscription", s), 10)
        async with open_bus(NatsSettings(), state, role="executor") as executor:
            sub = await executor.js.pull_subscribe(
                "gpuops.actions.>", durable="gpuops-executor", stream=ACTIONS
            )
            [msg] = await sub.fetch(1, timeout=5)
            assert msg.data == b'{"intent": 1}', f"the executor still works ({who})"
            # Knowing the delivery's reply subject is not enough to end it.
            await snoop.publish(msg.reply, b"+TERM")
            await wait_for(lambda r=msg.reply: _refused(errors, "publish", r), 10)
            info = await executor.js.consumer_info(ACTIONS, "gpuops-executor")
            assert info.num_ack_pending == 1, f"the intent is still the executor's ({who})"
            await msg.nak()  # for the next snoop's round
        assert all(h.pending_msgs == 0 for h in heard), f"{who} heard no delivery"
    finally:
        await snoop.close()


async def test_an_operator_hears_only_answers_to_their_own_requests(tmp_path: Path) -> None:
    state = tmp_path / "state"
    operators_dir(state).mkdir(parents=True)
    mallory = Credentials("mallory", "mallory-has-her-own-password")
    (operators_dir(state) / "mallory.json").write_text(
        json.dumps({"user": mallory.user, "password": mallory.password})
    )

    async def respond(msg: Msg) -> None:
        await msg.respond(b"yours")

    async with open_bus(NatsSettings(), state) as engine:
        answer = await engine.nc.subscribe("gpuops.cmd.>", cb=respond)
        errors: list[str] = []
        snoop = await _client(mallory, engine.url, subjects.operator_inbox("mallory"), errors)
        try:
            heard = [await snoop.subscribe(s) for s in ("_INBOX.cli.>", "_INBOX.cli.operator.>")]
            for subject in ("_INBOX.cli.>", "_INBOX.cli.operator.>"):
                await wait_for(lambda s=subject: _refused(errors, "subscription", s), 10)
            async with open_bus(NatsSettings(), state, role="cli") as ops:
                reply = await ops.nc.request("gpuops.cmd.operator.status", b"{}", timeout=5)
                assert reply.data == b"yours", "the operator's own answer still comes"
            mine = await snoop.request("gpuops.cmd.mallory.status", b"{}", timeout=5)
            assert mine.data == b"yours", "and mallory's to her"
            assert all(h.pending_msgs == 0 for h in heard), "mallory heard no other answer"
        finally:
            await snoop.close()
            await answer.unsubscribe()


async def test_an_operator_cannot_change_the_engines_consumer_by_any_create_subject(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    async with open_bus(NatsSettings(), state) as engine:
        name = durable(False, 0, 1)  # a partition owner's, as `gpuops status` lists it
        want = ConsumerConfig(
            durable_name=name, filter_subject="gpuops.events.0.>", max_deliver=20, ack_wait=60.0
        )
        await engine.js.add_consumer(EVENTS, want)
        tampered = {"name": name, "filter_subject": "gpuops.events.>", "max_deliver": 1}
        attempts = {
            f"$JS.API.CONSUMER.CREATE.{EVENTS}": tampered,  # the name in the body only
            f"$JS.API.CONSUMER.CREATE.{EVENTS}.{name}": tampered,
            f"$JS.API.CONSUMER.CREATE.{EVENTS}.{name}.gpuops.events.>": tampered,
            f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS}.{name}": {**tampered, "durable_name": name},
        }
        errors: list[str] = []
        cred = read_credentials(state, "cli")
        cli = await _client(cred, engine.url, subjects.operator_inbox(cred.user), errors)
        try:
            for subject, config in attempts.items():
                body = json.dumps({"stream_name": EVENTS, "config": config}).encode()
                await cli.publish(subject, body, reply=cli.new_inbox())
                await wait_for(lambda s=subject: _refused(errors, "publish", s), 10)
        finally:
            await cli.close()
        kept = (await engine.js.consumer_info(EVENTS, name)).config
        assert (kept.durable_name, kept.filter_subject, kept.max_deliver) == (
            name,
            "gpuops.events.0.>",
            20,
        )
        # A read of the operator's own still works: a consumer of a reader's own name.
        await engine.js.publish("gpuops.events.xid.node-001", b"{}")
        async with (
            open_bus(NatsSettings(), state, role="cli") as ops,
            slot_read(ops.js, "gpuops.events.>", EVENTS, ConsumerConfig()) as sub,
        ):
            [msg] = await sub.fetch(1, timeout=5)
            assert msg.data == b"{}"
        assert await _only(engine, name), "the read's consumer is deleted after it"


async def _only(bus: Bus, name: str) -> bool:
    return [i.name for i in await bus.js.consumers_info(EVENTS)] == [name]


def _intake(bus: Bus) -> Intake:
    """An engine's intake of one partition's kind of event (its handler plays no part)."""

    async def handle(msg: Msg) -> None:
        return None

    return Intake(
        bus.js, SystemClock(), stream=EVENTS, subject="gpuops.events.*.xid.>", durable="p0",
        handler=handle,
    )  # fmt: skip


async def _run_until(intake: Intake, done: asyncio.Event) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_an_engine_consumer_changed_behind_its_back_is_put_back(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    intake = _intake(bus)
    first = asyncio.Event()
    asyncio.get_running_loop().call_later(2, first.set)
    await _run_until(intake, first)
    assert (await bus.js.consumer_info(EVENTS, "p0")).config.max_deliver == 20, "made"
    # Someone with the JetStream API (the legacy subject, the name in the body) widens
    # its filter and lets a crash's unacked events go after one delivery.
    tampered = {"name": "p0", "filter_subject": "gpuops.events.>", "max_deliver": 1}
    body = {"stream_name": EVENTS, "config": {**tampered, "ack_policy": "explicit"}}
    await bus.nc.request(f"$JS.API.CONSUMER.CREATE.{EVENTS}", json.dumps(body).encode())
    assert (await bus.js.consumer_info(EVENTS, "p0")).config.max_deliver == 1, "it took"

    again = asyncio.Event()
    asyncio.get_running_loop().call_later(2, again.set)
    with caplog.at_level(logging.WARNING, "gpuops.bus.durable"):
        await _run_until(intake, again)
    config = (await bus.js.consumer_info(EVENTS, "p0")).config
    assert (config.durable_name, config.filter_subject, config.max_deliver) == (
        "p0",
        "gpuops.events.*.xid.>",
        20,
    )
    # The create set what it left out to the server's defaults: those are put back too.
    fields = "durable_name, filter_subject, ack_wait, max_deliver, max_ack_pending"
    assert f"changed behind this role's back ({fields}): putting it back" in caplog.text


async def test_a_consumer_that_acks_otherwise_is_not_run_on(bus: Bus) -> None:
    intake = _intake(bus)
    # Made anew by someone who may delete it: acks nothing, so a crash would lose events.
    await bus.js.add_consumer(
        EVENTS,
        ConsumerConfig(
            durable_name="p0", filter_subject="gpuops.events.*.xid.>", ack_policy=AckPolicy.NONE
        ),
    )
    with pytest.raises(BusError, match=r"consumer p0 of stream GPUOPS_EVENTS .*\(ack_policy"):
        await asyncio.wait_for(intake.run(asyncio.Event()), 30)
    config = (await bus.js.consumer_info(EVENTS, "p0")).config
    assert config.ack_policy == AckPolicy.NONE, "left for a person to look at, not run on"
