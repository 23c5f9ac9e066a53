"""One GPU fenced through Kubernetes DRA, for real: the engine, the executor running
fence_gpu.yml with ansible-runner against the simulated Kubernetes node (kubectl's shim
keeps the node's ResourceSlice and the cluster's DeviceTaintRules), and the DRA source
publishing the driver's taint as `gpuops ingest dra` does.

NVIDIA's driver taints GPU 3 of node-001 (XID 79: NoSchedule) while a pod trains on it.
The gpu-fence ladder reports first (effect None: the rule's status says the pod would be
evicted), then fences (NoSchedule), asks a person before evicting (NoExecute, approved),
then resets the idle GPU (gpu_reset.yml drains the node first, as always on Kubernetes);
the gate back into service passes and the fence is removed. The fence rungs leave the
node in service, and the breaker counts it from the first fence.

Two nodes whose names are alike in their first 63 characters (FQDNs) are fenced, and one
returns to service: the other's fence stays (the label is each node's own).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.bus.conn import Bus
from gpuops.bus.identity import source as source_identity
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ScaledClock, SystemClock
from gpuops.inventory.hosts import load_inventory
from gpuops.models import RunOutcome, RunStatus
from gpuops.ops.commands import Caller
from gpuops.record.nodestate import NodeState
from gpuops.sim.dra_shims import resource_slice
from gpuops.sim.driver import SimDriver
from gpuops.sim.fleet import SimFleet
from gpuops.sources.dra import DraSource

from tests.conftest import ROOT, calls, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = pytest.mark.integration
NODE = "node-001"
ALICE = Caller.of("cli", "alice")
SPEED = 60.0  # the rule's 10-minute cooldown between rungs is 10 s of wall time


def _effects(fleet: SimFleet) -> list[str]:
    return [r["spec"]["taint"]["effect"] for r in fleet.taint_rules().values()]


@pytest.mark.slow  # a minute: four rungs, each after the rule's cooldown: `make test-slow`
async def test_none_then_noschedule_then_approved_noexecute_then_reset_and_unfenced(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4, workload_manager="kubernetes")
    fleet.inject(NODE, "pod", 3, name="train-0", gpus=[3], duration=3600, grace=1)
    fleet.inject(NODE, "dra_taint", 3)
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        safety={"validation_timeout_s": 36000.0, "approval_timeout_s": 36000.0},
    )
    clock = ScaledClock(SPEED)
    seen: list[list[str]] = []
    async with running_engine(settings, bus, clock) as app:
        driver = SimDriver(fleet, bus, clock, probe_s=0, keys=app.keys)
        feeder = asyncio.create_task(driver.run(app.stop))
        signer = app.keys.signer(source_identity("dra"))
        source = DraSource(
            load_inventory(settings.inventory),
            JetStreamPublisher(bus.js, signer),
            clock,
            lambda: {"items": [resource_slice(fleet.state(NODE))]},
            interval_s=1.0,
        )
        taints = asyncio.create_task(source.run(app.stop))

        async def stage(effects: list[str]) -> bool:
            record = await app.engine.states.get(NODE)
            assert record.state is not NodeState.NEEDS_HUMAN, record.why
            now = _effects(fleet)
            if now and (not seen or seen[-1] != now):
                seen.append(now)
            return now == effects

        await wait_for(lambda: stage(["None"]), 120)
        [reported] = fleet.taint_rules().values()
        [condition] = reported["status"]["conditions"]
        assert condition["message"] == "1 pods would be evicted by NoExecute", "the evidence"
        breaker, _ = await app.engine.breaker.get()
        assert NODE in breaker.recent(clock.now(), 600), "the breaker counts the fenced GPU"

        async def in_service() -> bool:  # the fence ran; the node never left service
            record = await app.engine.states.get(NODE)
            assert record.state is not NodeState.QUARANTINED, record.why
            return record.state is NodeState.HEALTHY

        await wait_for(in_service, 60)
        await wait_for(lambda: stage(["NoSchedule"]), 120)

        async def asked() -> bool:
            return bool(await app.engine.approvals.all())

        await wait_for(asked, 120)
        [approval] = await app.engine.approvals.all()
        assert "fence_gpu.yml" in approval.summary and _effects(fleet) == ["NoSchedule"]
        reply = await app.commands().run(f"approve {approval.id}", ALICE)
        assert reply.startswith(f"approved {approval.id}")
        await wait_for(lambda: stage(["NoExecute"]), 120)

        async def unfenced() -> bool:
            record = await app.engine.states.get(NODE)
            assert record.state is not NodeState.NEEDS_HUMAN, record.why
            outcomes = await run_outcomes(bus, NODE)
            done = [o.playbook for o in outcomes if o.status is RunStatus.SUCCESSFUL]
            return "return_to_service.yml" in done and record.state is NodeState.HEALTHY

        await wait_for(unfenced, 240)
        app.stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(feeder, taints)

    runs = [(o.playbook, o.status) for o in await run_outcomes(bus, NODE)]
    assert runs == [
        ("fence_gpu.yml", RunStatus.SUCCESSFUL),
        ("fence_gpu.yml", RunStatus.SUCCESSFUL),
        ("fence_gpu.yml", RunStatus.SUCCESSFUL),
        ("gpu_reset.yml", RunStatus.SUCCESSFUL),
        ("return_to_service.yml", RunStatus.SUCCESSFUL),
    ]
    assert seen == [["None"], ["NoSchedule"], ["NoExecute"]]
    assert _effects(fleet) == [], "the gate passed: return_to_service removed the fence"
    log = fleet.state(NODE).get("work_log", [])
    assert {"kind": "pod", "name": "default/train-0", "how": "evicted"}.items() <= next(
        (e for e in log if e["name"] == "default/train-0"), {}
    ).items(), "NoExecute evicted the pod"
    verbs = [c[0] for c in calls(fleet, NODE, "kubectl")]
    assert verbs.count("apply") == 3 and "drain" in verbs
    assert verbs.index("drain") > max(i for i, v in enumerate(verbs) if v == "apply"), (
        "no fence rung drained: only the reset, as gpu_reset.yml does on Kubernetes"
    )
    assert not calls(fleet, "node-002"), "the other node was never touched"


# Two FQDN node names alike in their first 63 characters: a label cut to 63 was shared.
LONG = "dgx-h200-superpod-2-scalable-unit-04-rack-07.cluster-east.corp.example"
K8S_NAMES = {"node-001": f"{LONG}.node-011", "node-002": f"{LONG}.node-012"}


def _playbook(fleet: SimFleet, playbook: str, hosts: list[str], **gpuops: object) -> RunOutcome:
    request = RunRequest(
        key="t",
        rule="test",
        node=hosts[0],
        playbook=resolve(ROOT / "playbooks", playbook, None, fleet.root / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=300,
        limit=",".join(hosts),
        extravars={"gpuops": {"node": hosts[0], **gpuops}},
    )
    return run_playbook(request, SystemClock())


def test_returning_one_node_leaves_the_fence_of_another_with_a_name_alike(tmp_path: Path) -> None:
    fleet = SimFleet.create(
        tmp_path / "sim", nodes=3, gpus=2, workload_manager="kubernetes", k8s_names=K8S_NAMES
    )
    fenced = _playbook(fleet, "fence_gpu.yml", ["node-001", "node-002"], gpu=1, effect="NoSchedule")
    assert fenced.status is RunStatus.SUCCESSFUL, fenced.error
    pools = {r["spec"]["deviceSelector"]["pool"] for r in fleet.taint_rules().values()}
    assert pools == set(K8S_NAMES.values()), "one fence on each node"

    back = _playbook(fleet, "return_to_service.yml", ["node-001", "node-003"])

    assert back.status is RunStatus.SUCCESSFUL, back.error
    pools = {r["spec"]["deviceSelector"]["pool"] for r in fleet.taint_rules().values()}
    assert pools == {K8S_NAMES["node-002"]}, "node-001's fence went, node-002's stays"
    assert "node-001: Remove the node's DRA fences" in back.changed
    assert "node-003: Remove the node's DRA fences" not in back.changed, (
        "kubectl's `No resources found` (on stdout) is no change"
    )


def test_a_consolidated_fence_fences_every_gpu_it_names(tmp_path: Path) -> None:
    """Review of issue 30: the catalogue says fence_gpu.yml acts on `gpuops.gpus`, as a rule
    grouped by GPU consolidates them by default (gpu None, gpus [0, 1]); it read only
    `gpuops.gpu`, ran `nvidia-smi -i ''` and fenced nothing."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2, workload_manager="kubernetes")
    fenced = _playbook(
        fleet, "fence_gpu.yml", ["node-001"], gpu=None, gpus=[0, 1], effect="NoSchedule"
    )
    assert fenced.status is RunStatus.SUCCESSFUL, fenced.error
    devices = {r["spec"]["deviceSelector"]["device"] for r in fleet.taint_rules().values()}
    assert len(devices) == 2, f"one fence a GPU: {devices}"
    again = _playbook(
        fleet, "fence_gpu.yml", ["node-001"], gpu=None, gpus=[0, 1], effect="NoSchedule"
    )
    assert again.status is RunStatus.SUCCESSFUL and not again.changed, "the same fences: no change"
