"""A site's NATS in operator (JWT) mode, from deploy/nats/jwt_setup.py: a real nats-server
trusts the generated operator and accounts, and each node's user may speak only for
its own node (the subject templates of its JWT, filled in with its name)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import nats
import pytest
from gpuops import subjects
from gpuops.bus.conn import connect
from gpuops.bus.server import EmbeddedNats
from gpuops.settings import NatsSettings
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 5.0


def load_setup() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "nats_jwt_setup", ROOT / "deploy/nats/jwt_setup.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


jwt_setup = load_setup()


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """The generator's output for a 2-node inventory."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  hosts:\n    node-a:\n    node-b:\n")
    out = tmp_path / "nats-jwt"
    assert jwt_setup.main(["--inventory", str(inventory), "--out", str(out)]) == 0
    return out


@pytest.fixture
def server(site: Path, tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server (JetStream on) with only the generated config."""
    nats_server = EmbeddedNats(tmp_path / "nats", config_text=(site / jwt_setup.CONF).read_text())
    yield nats_server.start()
    nats_server.stop()


@dataclass
class Conn:
    """A client and the errors the server sent it (permission violations)."""

    nc: Client
    errors: asyncio.Queue[Exception]

    async def next_error(self) -> str:
        return str(await asyncio.wait_for(self.errors.get(), WAIT_S))


OpenAs = Callable[[str], Awaitable[Conn]]


@pytest.fixture
async def as_user(server: EmbeddedNats, site: Path) -> AsyncIterator[OpenAs]:
    """Connects with a generated creds file; every connection is closed afterwards."""
    opened: list[Client] = []

    async def open_as(creds: str) -> Conn:
        errors: asyncio.Queue[Exception] = asyncio.Queue()

        async def on_error(exc: Exception) -> None:
            errors.put_nowait(exc)

        nc = await nats.connect(
            server.url,
            user_credentials=str(site / creds),
            error_cb=on_error,
            allow_reconnect=False,
            inbox_prefix=_inbox(creds),
        )
        opened.append(nc)
        return Conn(nc, errors)

    yield open_as
    for nc in opened:
        await nc.close()


def test_every_file_is_private(site: Path) -> None:
    assert stat.S_IMODE(site.stat().st_mode) == 0o700
    for path in site.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    names = {p.relative_to(site).as_posix() for p in site.rglob("*.creds")}
    assert names == {
        "creds/engine.creds",
        "creds/executor.creds",
        "creds/operators/operator.creds",
        "creds/nodes/node-a.creds",
        "creds/nodes/node-b.creds",
    }


def test_running_again_keeps_every_key(site: Path, tmp_path: Path) -> None:
    before = {p: p.read_text() for p in (site / "keys").iterdir()}
    seed = jwt_setup.natsjwt.creds_seed((site / "creds/nodes/node-a.creds").read_text())
    inventory = tmp_path / "hosts.yml"
    assert jwt_setup.main(["--inventory", str(inventory), "--out", str(site)]) == 0
    assert {p: p.read_text() for p in (site / "keys").iterdir()} == before
    again = jwt_setup.natsjwt.creds_seed((site / "creds/nodes/node-a.creds").read_text())
    assert again.public == seed.public


def test_a_node_user_is_named_by_its_subject_token(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  hosts:\n    gpu.a1:\n")
    out = tmp_path / "out"
    assert jwt_setup.main(["--inventory", str(inventory), "--out", str(out)]) == 0
    token = (out / "creds/nodes/gpu_a1.creds").read_text().splitlines()[1]
    body = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    assert claims["name"] == subjects.token("gpu.a1") == "gpu_a1"


def test_a_missing_inventory_is_one_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = jwt_setup.main(["--inventory", str(tmp_path / "none.yml"), "--out", str(tmp_path / "o")])
    assert code == 1
    assert "none.yml does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


async def drain(sub: Subscription, count: int) -> list[str]:
    return [(await sub.next_msg(timeout=WAIT_S)).subject for _ in range(count)]


def _inbox(creds: str) -> str:
    """The inbox prefix a creds file's user may subscribe: its node's, or its role's."""
    path = Path(creds)
    if path.parent.name == "nodes":
        return subjects.node_inbox(path.stem)
    if path.parent.name == "operators":
        return subjects.operator_inbox(path.stem)
    return subjects.inbox_of(path.stem)


# nats-py's flush() writes its PING ahead of commands still in its buffer (2.16), so a
# flush proves nothing about an earlier SUB: a message through the subscription does.
READY = subjects.audit("")


async def listening(conn: Conn, sub: Subscription) -> None:
    """Return once the server holds `sub` (the connection may publish READY)."""
    await conn.nc.publish(READY, b"")
    assert await drain(sub, 1) == [READY]


async def test_a_node_publishes_only_its_own_subjects(as_user: OpenAs) -> None:
    engine = await as_user("creds/engine.creds")
    node = await as_user("creds/nodes/node-a.creds")
    seen = await engine.nc.subscribe(subjects.EVERYTHING)
    await listening(engine, seen)
    refused = [
        subjects.telemetry("node-b"),
        subjects.event("xid", "node-b"),
        subjects.event("probe", "node-b"),
        subjects.event("alert", "node-a"),  # not an agent's to send (auth.py)
    ]
    allowed = [subjects.telemetry("node-a"), subjects.event("xid", "node-a")]
    for subject in [*refused, *allowed]:
        await node.nc.publish(subject, b"{}")
    errors = [await node.next_error() for _ in refused]
    for subject, error in zip(refused, errors, strict=True):
        assert f'permissions violation for publish to "{subject}"' in error.lower()
    # One connection's messages keep their order: node-a's refused ones came before
    # these, so anything the server had let through would be here first.
    assert await drain(seen, len(allowed)) == allowed
    # Control: node-b's own publish on its subject arrives, so the subscriber saw
    # nothing of node-a's above because the server dropped it.
    node_b = await as_user("creds/nodes/node-b.creds")
    await node_b.nc.publish(subjects.telemetry("node-b"), b"{}")
    assert await drain(seen, 1) == [subjects.telemetry("node-b")]
    assert seen.pending_msgs == 0
    assert node.errors.empty()


async def test_a_node_reads_only_its_own_requests(as_user: OpenAs) -> None:
    engine = await as_user("creds/engine.creds")
    node = await as_user("creds/nodes/node-a.creds")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"ok")  # a reply needs allow_responses: no _INBOX publish right

    await node.nc.subscribe(subjects.probe_request("node-a"), cb=answer)
    other = await node.nc.subscribe(subjects.agent_requests_to("node-b"))
    # The refusal of the second SUB comes after the first is in place (one connection).
    error = (await node.next_error()).lower()
    assert 'permissions violation for subscription to "gpuops.agent.node-b.>"' in error
    reply = await engine.nc.request(subjects.probe_request("node-a"), b"{}", timeout=WAIT_S)
    assert reply.data == b"ok"
    await engine.nc.publish(subjects.probe_request("node-b"), b"{}")
    # A second request behind it: node-a would have got node-b's before answering this.
    reply = await engine.nc.request(subjects.probe_request("node-a"), b"{}", timeout=WAIT_S)
    assert reply.data == b"ok"
    assert other.pending_msgs == 0
    assert node.errors.empty()


async def test_the_engine_sets_up_jetstream_in_the_account(
    server: EmbeddedNats, site: Path
) -> None:
    engine = await connect(server.url, NatsSettings(creds=site / "creds/engine.creds"))
    await engine.close()
    executor = await connect(
        server.url, NatsSettings(creds=site / "creds/executor.creds"), setup="open", role="executor"
    )
    await executor.close()


async def test_an_operator_with_only_their_creds_reads_and_commands_as_themselves(
    server: EmbeddedNats, site: Path
) -> None:
    # The operator sets nats.creds and nothing else: their user name is the JWT's, and
    # so are their inbox (JetStream's answers come there) and their command subject.
    engine = await connect(server.url, NatsSettings(creds=site / "creds/engine.creds"))

    async def respond(msg: Msg) -> None:
        await msg.respond(msg.subject.encode())

    await engine.nc.subscribe("gpuops.cmd.>", cb=respond)
    await engine.nc.flush()
    creds = site / "creds/operators/operator.creds"
    ops = await connect(server.url, NatsSettings(creds=creds), setup="open", role="cli")
    try:
        assert ops.user == "operator"
        assert (await ops.js.account_info()).streams >= 1, "a JetStream read answers"
        reply = await ops.nc.request(subjects.command(ops.user, "status"), b"{}", timeout=WAIT_S)
        assert reply.data == subjects.command("operator", "status").encode()
    finally:
        await ops.close()
        await engine.close()
