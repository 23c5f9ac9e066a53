"""Issue 10, defects 5 and 6: a crash at any point loses no decision and runs nothing twice.

Black box: `gpuops run` as a subprocess against a nats-server started here, killed with
SIGKILL while it decides and while it runs a playbook, then started again. Counted from
the streams afterwards: every event published was decided (acked) or dead-lettered,
every intent has its accepted decision and every accepted decision its intent, no
intent ran twice, and an interrupted run hands its node to a person and frees its lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.conn import ACTIONS, DLQ, EVENTS, Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.decide.lock import NodeLocks
from gpuops.models import new_event, subject_for
from gpuops.record.audit import read_audit
from gpuops.record.nodestate import NodeState, NodeStates
from gpuops.scale.lag import drained, handled, lags
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, calls, wait_for
from tests.support import as_node, gpuops_argv, node_keys

pytestmark = [pytest.mark.faults, pytest.mark.slow]


class Engine:
    """`gpuops run` as a process that the test kills and starts again."""

    def __init__(
        self,
        tmp: Path,
        url: str,
        fleet: SimFleet,
        role: str,
        *,
        name: str = "",
        rules: Path = ROOT / "rules",
        **env: str,
    ) -> None:
        self.args = gpuops_argv(state_dir=tmp / "state")
        self.args += ["run", "--nats", url, "--rules", str(rules), "--role", role]
        self.args += ["--inventory", str(fleet.root / "inventory")]
        self.env = {**os.environ, **{f"GPUOPS_{k.upper()}": v for k, v in env.items()}}
        self.log_path = tmp / f"engine-{name or role}.log"  # replicas: one log each
        self.log = self.log_path.open("a")
        self.proc: subprocess.Popen[str] | None = None
        self.kills = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.args, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, text=True
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.kills += 1

    def running(self) -> bool:
        """True while the process runs; one that exited on its own (not killed here)
        fails the test with its log's end, which says why."""
        assert self.proc is not None
        if self.proc.poll() is None:
            return True
        tail = "".join(self.log_path.read_text().splitlines(keepends=True)[-25:])
        raise AssertionError(f"{self.log_path.name} exited {self.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def big_fleet(tmp_path: Path) -> SimFleet:
    return SimFleet.create(tmp_path / "sim", nodes=6, gpus=8)


async def _publish_xid(bus: Bus, keys: KeyRing, node: str, gpu: int, xid: int) -> None:
    """Publish one XID event, signed as the node's agent."""
    event = new_event("xid", node, time.time(), {"gpu": gpu, "xid": xid}, "test")
    subject, data = subject_for("xid", node), json.dumps(event).encode()
    await bus.js.publish(subject, data, headers=as_node(keys, subject, data, event["id"]))


async def _decisions(bus: Bus) -> list[dict[str, Any]]:
    return [r.body async for r in read_audit(bus.js) if r.type == "decision"]


async def test_kill_9_while_deciding_loses_no_decision_and_no_intent(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, big_fleet: SimFleet
) -> None:
    engine = Engine(
        tmp_path,
        nats_server.url,
        big_fleet,
        "engine",  # no executor: every intent stays in the queue to be counted
        safety__breaker_share="1.0",
        safety__breaker_absolute="1000",
        safety__domain_budgets="{}",
        safety__lock_lease_s="1",
    )
    keys = node_keys(tmp_path / "state")  # the engine's state dir: it reads the same key
    published = 0
    engine.start()
    try:
        for round_ in range(4):
            floor = await _ack_floor(bus)
            for i in range(60):
                node = big_fleet.nodes[i % len(big_fleet.nodes)]
                await _publish_xid(bus, keys, node, (i + round_) % 8, 48)
                published += 1
            await wait_for(lambda f=floor: _past(bus, f), 60)  # type: ignore[misc]
            engine.kill()  # mid-stream: some events decided, some not, some half-way
            engine.start()
        await wait_for(lambda: drained(bus.js, False, PARTITIONS), 240)
    finally:
        engine.stop()
    assert engine.kills == 4
    await assert_all_decided_once(bus, published)


PARTITIONS = NatsSettings().partitions


async def assert_all_decided_once(bus: Bus, published: int) -> None:
    """Counted from the streams: every event stored and acked (decided), none refused;
    every accepted decision has its intents, and no intent is stored twice."""
    stored = (await bus.js.stream_info(EVENTS)).state.messages
    dead = (await bus.js.stream_info(DLQ)).state.messages
    assert stored == published and dead == 0, "every event was stored and none was refused"
    # Drained: the engine acked every event, and it acks only after the decision (and
    # its intents) are stored. Repeated drops are summarised in the audit, so the audit
    # is not the count; the consumer's ack floor is.
    parts = await lags(bus.js, False, PARTITIONS)
    assert all(lag.drained for lag in parts), parts
    assert handled(parts) == published == stored + dead, parts
    decisions = await _decisions(bus)
    accepted = [d for d in decisions if d["decision"]["accepted"]]
    promised = [k for d in accepted for k in d["intents"]]
    queued = await _intent_keys(bus)
    assert len(queued) == len(set(queued)), "no intent stored twice"
    assert set(promised) == set(queued), "no intent without its decision, nor the reverse"
    assert accepted, "the test made remediations happen"


async def _ack_floor(bus: Bus) -> int:
    """The last event stored before this round."""
    return int((await bus.js.stream_info(EVENTS)).state.last_seq)


async def _past(bus: Bus, floor: int) -> bool:
    """The engine has taken some of this round's events (the kill lands mid-stream)."""
    try:
        delivered = [lag.delivered for lag in await lags(bus.js, False, PARTITIONS)]
    except Exception:  # not answering yet: the engine is still starting
        return False
    return sum(1 for d in delivered if d > floor) >= 2  # some partitions took this round's


async def _intent_keys(bus: Bus) -> list[str]:
    info = await bus.js.stream_info(ACTIONS)
    keys = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await bus.js.get_msg(ACTIONS, seq)
        keys.append(json.loads(msg.data)["key"])
    return keys


async def test_kill_9_mid_run_hands_the_node_to_a_person_and_frees_its_lock(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats, fleet: SimFleet
) -> None:
    engine = Engine(tmp_path, nats_server.url, fleet, "all", run_claim_stale_s="6")
    keys = node_keys(tmp_path / "state")  # the engine's state dir: it reads the same key
    engine.start()
    try:
        await _publish_xid(bus, keys, "node-001", 2, 79)  # reboot.yml: not retry-safe

        async def running() -> bool:
            return any(
                [
                    r.summary.startswith("running reboot.yml")
                    async for r in read_audit(bus.js, "node-001")
                ]
            )

        await wait_for(running, 120)
        engine.kill()  # the executor and its ansible-playbook die mid-run
        engine.start()
        states = NodeStates(NatsKV(bus.kv["nodes"]))

        async def handed_over() -> bool:
            return (await states.get("node-001")).state is NodeState.NEEDS_HUMAN

        await wait_for(handed_over, 120)
    finally:
        engine.stop()
    record = await states.get("node-001")
    assert "interrupted" in record.why
    runs = [r async for r in read_audit(bus.js, "node-001") if r.type == "run"]
    assert [r.body["status"] for r in runs] == ["interrupted"], "recorded, and not run again"
    assert (await NodeLocks(NatsKV(bus.kv["locks"])).holder("node-001"))[0] is None
    assert len(calls(fleet, "node-001", "reboot")) <= 1, "never rebooted twice"
