"""Batched runs: intents ready together run as one ansible-runner call, each with its own outcome.

Real nats-server, real ansible-runner, simulated nodes. Signed intents are put on the
actions stream before the executor starts, so its first fetch sees them together.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.models import Intent, RunOutcome, RunStatus, action_subject
from gpuops.record.audit import read_audit
from gpuops.settings import Settings
from gpuops.signing import load_key, sign
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import signing_key_path

from tests.conftest import (
    ROOT,
    calls,
    counted,
    engine_settings,
    run_outcomes,
    running_engine,
    wait_for,
)
from tests.support import drain_intent, gpuops_argv

pytestmark = pytest.mark.integration


def _intent(node: str, reason: str, **action: Any) -> Intent:
    return drain_intent(f"batch-{node}", node, reason, **action)


async def _publish(bus: Bus, intents: list[Intent]) -> None:
    for intent in intents:
        await bus.js.publish(action_subject(intent.node), intent.model_dump_json().encode())


async def _run(settings: Settings, bus: Bus, intents: list[Intent], runs: int) -> list[RunOutcome]:
    """Publish the intents, run the executor until `runs` outcomes are recorded."""
    key = load_key(signing_key_path(settings))
    await _publish(bus, [i if i.signature else sign(i, key) for i in intents])
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: counted(app.engine.metrics.runs) >= runs, 120)
    return await run_outcomes(bus)


def _settings(tmp_path: Path, fleet: SimFleet, url: str, **over: Any) -> Settings:
    return engine_settings(tmp_path, fleet, url, role="executor", **over)


def _gpuops(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = gpuops_argv(*args, state_dir=settings.state_dir)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


async def test_a_batch_runs_as_one_call_and_each_host_gets_its_own_outcome(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=1)
    settings = _settings(tmp_path, fleet, nats_server.url)
    # The reason is each host's own data, and never templated on the way to scontrol.
    reasons = {n: f"GPU 0 at 9{i} C {{{{ 6 * 7 }}}}" for i, n in enumerate(fleet.nodes)}
    outcomes = await _run(settings, bus, [_intent(n, r) for n, r in reasons.items()], 3)

    assert sorted(o.node for o in outcomes) == fleet.nodes
    assert all(o.status is RunStatus.SUCCESSFUL for o in outcomes), outcomes
    (run_id,) = {o.run_id for o in outcomes}
    assert run_id is not None and all(o.hosts_in_run == 3 for o in outcomes)
    for o in outcomes:
        assert set(o.stats) == {o.node} and o.stats[o.node]["changed"] == 1
        assert o.intent_key == f"batch-{o.node}"
        reason = fleet.state(o.node)["drain_reason"]
        assert reason == f"gpuops overheat: {reasons[o.node]}", "its own reason, verbatim"

    runs = settings.state_dir / "runs"
    assert [p.name for p in runs.iterdir()] == [run_id], "one ansible-runner call"
    kept = runs / run_id
    assert {"stdout", "rc", "command", "job_events", "run.json"} <= {p.name for p in kept.iterdir()}
    command = json.loads((kept / "command").read_text())["command"]
    assert command[command.index("--limit") + 1] == ",".join(fleet.nodes)
    assert json.loads((kept / "run.json").read_text())["intents"] == {
        n: f"batch-{n}" for n in fleet.nodes
    }

    shown = _gpuops(settings, "history", "--run", run_id)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (kept / "stdout").read_text()
    assert "PLAY RECAP" in shown.stdout and all(n in shown.stdout for n in fleet.nodes)


async def test_a_host_whose_tool_fails_fails_alone_with_the_task_and_message(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=1)
    # node-002's Slurm name is wrong in the inventory: its scontrol refuses the drain.
    hosts_file = fleet.root / "inventory" / "hosts.yml"
    inventory = yaml.safe_load(hosts_file.read_text())
    inventory["all"]["children"]["sim"]["hosts"]["node-002"]["slurm_node_name"] = "gpu-x"
    hosts_file.write_text(yaml.safe_dump(inventory))
    settings = _settings(tmp_path, fleet, nats_server.url)
    outcomes = {
        o.node: o for o in await _run(settings, bus, [_intent(n, "hot") for n in fleet.nodes], 3)
    }

    bad = outcomes.pop("node-002")
    assert bad.status is RunStatus.FAILED and bad.failed_task == "Drain the node in Slurm"
    assert bad.failed_message is not None
    assert "Invalid node name specified gpu-x" in bad.failed_message
    assert all(
        o.status is RunStatus.SUCCESSFUL and o.failed_task is None for o in outcomes.values()
    )
    assert {o.run_id for o in outcomes.values()} == {bad.run_id}, "all in one run"
    assert not fleet.state("node-002")["drained"]
    assert all(fleet.state(n)["drained"] for n in outcomes)

    shown = _gpuops(settings, "history", "node-002", "--nats", nats_server.url)
    assert shown.returncode == 0, shown.stderr
    assert "failed task: Drain the node in Slurm" in shown.stdout
    listed = shown.stdout.split("failed tasks:\n", 1)[1].splitlines()
    (line,) = [x for x in listed if "Invalid node name specified" in x]
    assert f"node-002 drain.yml run {bad.run_id}: task 'Drain the node in Slurm': " in line
    assert line.endswith(
        "non-zero return code: slurm_update error: Invalid node name specified gpu-x"
    )


async def test_a_forged_intent_in_a_batch_is_refused_alone(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=1)
    settings = _settings(tmp_path, fleet, nats_server.url)
    forged = sign(_intent("node-002", "forged"), b"not the engine's key" * 2)
    intents = [_intent("node-001", "hot"), forged, _intent("node-003", "hot")]
    outcomes = await _run(settings, bus, intents, 3)  # two runs and one refusal

    assert sorted(o.node for o in outcomes) == ["node-001", "node-003"]
    assert all(o.status is RunStatus.SUCCESSFUL and o.hosts_in_run == 2 for o in outcomes)
    assert len({o.run_id for o in outcomes}) == 1
    assert calls(fleet, "node-002") == [], "nothing ran on the forged intent's node"
    notes = [r.summary async for r in read_audit(bus.js) if "intent refused" in r.summary]
    assert len(notes) == 1 and "signature does not verify" in notes[0]


@pytest.mark.slow
async def test_a_batch_past_its_timeout_times_out_every_host(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=1)
    slow = fleet.node_dir("node-002") / "bin" / "scontrol"
    slow.write_text("#!/bin/sh\nsleep 60\n")  # node-002's Slurm hangs
    settings = _settings(tmp_path, fleet, nats_server.url)
    intents = [_intent(n, "hot", timeout_s=8) for n in fleet.nodes]
    started = time.monotonic()
    outcomes = await _run(settings, bus, intents, 2)
    assert time.monotonic() - started < 55, "the run was stopped at its timeout"
    assert [o.status for o in outcomes] == [RunStatus.TIMEOUT] * 2
    assert len({o.run_id for o in outcomes}) == 1


@pytest.mark.slow
async def test_a_storm_on_50_nodes_runs_in_a_few_batches(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=50, gpus=1)
    settings = _settings(tmp_path, fleet, nats_server.url, executor={"batch_size": 25, "forks": 10})
    started = time.monotonic()
    outcomes = await _run(settings, bus, [_intent(n, "hot") for n in fleet.nodes], 50)
    wall = time.monotonic() - started
    print(f"storm on 50 simulated nodes: {wall:.1f}s wall")
    runs = {o.run_id for o in outcomes}
    assert len(runs) <= 4, f"{len(runs)} ansible-runner calls for 50 hosts"
    assert len(list((settings.state_dir / "runs").iterdir())) == len(runs)
    assert sorted(o.node for o in outcomes) == fleet.nodes, "one outcome per host"
    assert all(o.status is RunStatus.SUCCESSFUL for o in outcomes)
    assert all(fleet.state(n)["drained"] for n in fleet.nodes)
