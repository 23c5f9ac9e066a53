"""Issue 10, defect 10: an agent started while NATS is down must sample, spool and stop."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from gpuops.bus.conn import EVENTS, ensure_streams
from gpuops.bus.embedded import enrol
from gpuops.bus.server import EmbeddedNats
from gpuops.signing import load_key
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, wait_for
from tests.support import free_port, gpuops_argv

pytestmark = pytest.mark.faults


@pytest.fixture
def agent_setup(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, int]]:
    """`gpuops agent` on a simulated node, pointed at a port where NATS is not (yet)."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    port, spool, state = free_port(), tmp_path / "spool.jsonl", tmp_path / "state"
    # As a deployment does, the node's publisher key is in place before its agent starts
    # (here the one an engine on this state dir writes at start: bus.embedded.enrol).
    enrol(state, ["node-001"], load_key(state / "keys" / "identity.key", "identity key"))
    args = gpuops_argv(state_dir=state)
    args += ["agent", "--backend", "sim", "--sim-root", str(fleet.root), "--node", "node-001"]
    args += ["--nats", f"nats://127.0.0.1:{port}", "--spool", str(spool)]
    args += ["--interval", "0.2", "--heartbeat", "0.2", "--probe-command", "true"]
    agent = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        yield agent, spool, port
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(10)


def _spooled(spool: Path) -> int:
    return len(spool.read_text().splitlines()) if spool.exists() else 0


async def test_agent_without_nats_spools_and_exits_promptly_on_sigterm(
    agent_setup: tuple[subprocess.Popen[str], Path, int],
) -> None:
    agent, spool, _ = agent_setup
    await wait_for(lambda: _spooled(spool) >= 2, 30)  # the probe of each GPU (not heartbeats)
    agent.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = agent.wait(timeout=5)
    assert code == 0, agent.stderr.read() if agent.stderr else ""
    assert time.monotonic() - started < 5


async def test_agent_started_before_nats_delivers_its_spool_when_nats_comes_up(
    tmp_path: Path, agent_setup: tuple[subprocess.Popen[str], Path, int]
) -> None:
    agent, spool, port = agent_setup
    await wait_for(lambda: _spooled(spool) >= 2, 30)  # the probe of each GPU (not heartbeats)
    held = [json.loads(line)["msg_id"] for line in spool.read_text().splitlines()]
    server = EmbeddedNats(tmp_path / "nats", port=port).start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)

        async def heartbeat_stored() -> bool:
            info = await js.stream_info(EVENTS)
            return info.state.messages > len(held)

        await wait_for(heartbeat_stored, 30)
        seqs = range(1, len(held) + 2)
        stored = [json.loads((await js.get_msg(EVENTS, seq)).data or b"") for seq in seqs]
        assert [e["id"] for e in stored[:-1]] == held, "the spool is delivered first, in order"
        assert stored[-1]["kind"] == "heartbeat", "then heartbeats, which were not spooled"
        assert {e["node"] for e in stored} == {"node-001"}
        assert agent.poll() is None, "the agent kept running through the outage"
        await nc.close()
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
        server.stop()
