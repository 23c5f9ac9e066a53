"""The simulated bandwidth, NVLink and InfiniBand, and their faults through the shipped rules."""

from __future__ import annotations

from pathlib import Path

from gpuops.clock import ManualClock
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import EVENT_ADAPTER, GpuSample
from gpuops.sim.fleet import SimFleet
from gpuops.sim.interconnect import ib_root
from gpuops.sim.nodebackend import SimBackend
from gpuops.sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[3]
T0 = 1_800_000_000.0


def test_baseline_follows_the_h200_recording(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path, nodes=1, gpus=2)
    event = EVENT_ADAPTER.validate_python(fleet.telemetry("node-001", T0))
    gpu: GpuSample = event.data.gpus[0]  # type: ignore[union-attr]
    assert gpu.dram_bw_util is not None and gpu.sm_active is not None, "GPM answers on H200"
    assert gpu.nvlink_links_active is None, "the recorded board has no NVLink"
    assert fleet.ib("node-001", T0) is None, "nor InfiniBand"


def test_the_interconnect_scenario_fires_its_rules(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path, nodes=5, gpus=8)
    plan = load_scenario("interconnect", fleet.nodes)
    matcher = Matcher(load_rules([ROOT / "rules"]), ManualClock(T0))
    fired: set[tuple[str, str, int | None]] = set()
    pending = list(plan.faults)
    for step in range(0, 420, 5):
        t = T0 + step
        while pending and pending[0].at <= step:
            f = pending.pop(0)
            fleet.inject(f.node, f.fault, f.gpu, at=t, **f.params)
        for node in fleet.nodes:
            for raw in (fleet.telemetry(node, t), fleet.ib(node, t)):
                if raw is not None:
                    for m in matcher.match(EVENT_ADAPTER.validate_python(raw)):
                        fired.add((m.rule, m.node, m.gpu))
    interconnect = {f for f in fired if not f[0].startswith(("gpu-", "hbm-", "thermal", "power"))}
    assert interconnect == {
        ("nvlink-link-down", "node-002", 4),
        ("ib-port-down", "node-003", None),
        ("ib-symbol-errors-increasing", "node-004", None),
        ("memory-bandwidth-collapse", "node-005", 6),
    }


def test_the_agent_on_a_simulated_node_reads_its_infiniband_tree(tmp_path: Path) -> None:
    from gpuops.agent.infiniband import read_ib

    fleet = SimFleet.create(tmp_path, nodes=1, gpus=2)
    fleet.inject("node-001", "ib_down", None, device="mlx5_3")
    data = read_ib(ib_root(fleet.node_dir("node-001")))
    assert data is not None and data["down_ports"] == ["mlx5_3/1"] and data["ports"] == 8
    backend = SimBackend(fleet.root, "node-001")
    assert backend.pci_bus_ids()[(0, 0x2A, 0)] == 1
