"""What one NATS user may not do to another's work, on a real server with the real
permissions: read or answer another's deliveries through its inbox."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
from gpuops import subjects
from gpuops.bus.auth import Credentials, node_credentials, read_credentials
from gpuops.bus.conn import ACTIONS, open_bus
from gpuops.bus.embedded import enrol
from gpuops.settings import NatsSettings
from gpuops.signing import load_key
from nats.aio.client import Client

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
            "cli": (read_credentials(state, "cli"), subjects.inbox_of("cli")),
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
