"""Topology as code: a manifest learnt from a good node passes on its twins; a narrowed or
slow link, a GPU on another NUMA node and an HCA elsewhere in the PCI tree are named;
an idle GPU's Gen1 is not a fault."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.agent.topology import observe
from gpuops.diagnose.topology import (
    GpuPlace,
    Manifest,
    Manifests,
    NicPlace,
    Topology,
    differences,
    dump,
    from_readings,
    learned,
    load_manifest,
)
from gpuops.errors import ConfigError
from gpuops.sim.fleet import SimFleet
from gpuops.sim.nodebackend import SimBackend


def _seen(fleet: SimFleet, node: str, maxima: bool = False) -> tuple[Topology, dict[int, float]]:
    backend = SimBackend(fleet.root, node)
    gpus = backend.sample()[0]
    topology = observe(
        gpus, backend.pci_bus_ids(), fleet.node_dir(node) / "sys", None, None, maxima=maxima
    )
    return topology, {g["index"]: g["util_gpu"] for g in gpus}


def test_a_manifest_learnt_from_a_good_node_passes_on_its_twins(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=8)
    good, _ = _seen(fleet, "node-001", maxima=True)
    path = tmp_path / "h200-8gpu.yml"
    path.write_text(dump(learned(good, "node-001", "h200-8gpu", "2026-12-03T00:00:00Z")))
    manifest = load_manifest(path)
    assert manifest.sku == "h200-8gpu" and "learned from node-001" in manifest.sources[0]
    assert len(manifest.gpus) == 8 and {g.pcie_width for g in manifest.gpus.values()} == {16}
    assert [g.numa for _, g in sorted(manifest.gpus.items())] == [0, 0, 0, 0, 1, 1, 1, 1]
    for twin in ("node-002", "node-003"):
        seen, util = _seen(fleet, twin)
        assert differences(manifest.for_host(twin), seen, util) == [], twin


def test_a_loaded_gen5_x8_link_is_named_and_an_idle_gen1_x16_is_not(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=8)
    manifest = learned(_seen(fleet, "node-001", maxima=True)[0], "node-001", "h200-8gpu", "t")
    fleet.inject("node-002", "pcie_narrow", 3, width=8)
    fleet.inject("node-002", "load", 0, workload="training")
    seen, util = _seen(fleet, "node-002")
    assert seen.gpus[3].pcie_gen == 5 and util[3] > 30, "loaded: at full generation"
    [found] = differences(manifest, seen, util)
    assert (found.check, found.gpu, found.expected, found.actual) == ("pcie_width", 3, 16, 8)

    idle = SimFleet.create(tmp_path / "idle", nodes=1, gpus=8)
    idle.inject("node-001", "load", 0, workload="idle")
    seen, util = _seen(idle, "node-001")
    assert {g.pcie_gen for g in seen.gpus.values()} == {1} and set(util.values()) == {0}
    assert differences(manifest, seen, util) == [], "an idle GPU at Gen1 x16 is as designed"

    fleet.inject("node-002", "pcie_slow", 6, gen=3)
    fleet.inject("node-002", "numa", 1, to=1)
    seen, util = _seen(fleet, "node-002")
    found = {(d.check, d.gpu): (d.expected, d.actual) for d in differences(manifest, seen, util)}
    assert found[("pcie_gen", 6)] == (5, 3), "a slow link under load"
    assert found[("numa", 1)] == (0, 1), "a GPU on the wrong NUMA node"


def test_a_host_override_and_a_missing_gpu() -> None:
    base = {0: GpuPlace(pci="0000:18:00.0", pcie_width=16), 1: GpuPlace(pci="0000:2a:00.0")}
    manifest = Manifest(
        gpus=base, hosts={"node-009": Topology(gpus={1: GpuPlace(pci="0000:2b:00.0")})}
    )
    seen = Topology(gpus={0: GpuPlace(pci="0000:18:00.0", pcie_width=16, pcie_gen=1)})
    missing = differences(manifest.for_host("node-001"), seen, {})
    assert [(d.check, d.gpu, d.expected) for d in missing] == [("gpu_missing", 1, "0000:2a:00.0")]
    moved = Topology(gpus={**seen.gpus, 1: GpuPlace(pci="0000:2b:00.0")})
    assert differences(manifest.for_host("node-009"), moved, {}) == []


def test_an_hca_s_rate_numa_and_level_to_its_gpu() -> None:
    want = Topology(nics={"mlx5_0": NicPlace(numa=0, rate_gbps=400, gpu=0, level="PIX")})
    seen = Topology(nics={"mlx5_0": NicPlace(numa=1, rate_gbps=200, gpu=0, level="SYS")})
    found = {d.check: (d.expected, d.actual) for d in differences(want, seen, {})}
    assert found == {"nic_numa": (0, 1), "nic_level": ("PIX", "SYS"), "nic_rate": (400, 200)}
    gone = differences(want, Topology(), {})
    assert [(d.check, d.device) for d in gone] == [("nic_missing", "mlx5_0")]


def _device(sys_root: Path, chain: list[str], numa: int) -> Path:
    """A PCI device in a sysfs-like tree, and its /sys/bus/pci/devices link."""
    real = sys_root / "devices" / Path(*chain)
    real.mkdir(parents=True)
    (real / "numa_node").write_text(f"{numa}\n")
    link = sys_root / "bus" / "pci" / "devices" / chain[-1]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(real)
    return link


@pytest.mark.parametrize(
    ("nic_chain", "level"),
    [
        (["pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:04.0", "0000:1b:00.0"], "PIX"),
        (["pci0000:17", "0000:17:02.0", "0000:20:00.0"], "PHB"),
        (["pci0000:97", "0000:97:01.0", "0000:98:00.0"], "SYS"),
    ],
)
def test_the_level_between_an_hca_and_its_gpu_from_the_pci_tree(
    tmp_path: Path, nic_chain: list[str], level: str
) -> None:
    """`nvidia-smi topo -m`'s levels: a shared PCIe switch is PIX, a shared host bridge
    PHB, the other socket SYS."""
    sys_root = tmp_path / "sys"
    gpu = ["pci0000:17", "0000:17:01.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"]
    _device(sys_root, gpu, 0)
    ib_root = tmp_path / "infiniband"
    (ib_root / "mlx5_0").mkdir(parents=True)
    (ib_root / "mlx5_0" / "device").symlink_to(
        _device(sys_root, nic_chain, 0 if level != "SYS" else 1)
    )
    ib = {"detail": [{"device": "mlx5_0", "port": 1, "rate": "400 Gb/sec (4X NDR)"}]}
    sample = [{"index": 0, "pcie_gen": 5, "pcie_width": 16}]
    seen = observe(sample, {(0, 0x1A, 0): 0}, sys_root, ib, ib_root)
    assert seen.gpus[0].numa == 0
    assert seen.nics["mlx5_0"] == NicPlace(
        numa=0 if level != "SYS" else 1, rate_gbps=400.0, gpu=0, level=level
    )


def test_a_manifest_that_does_not_read_says_which_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("gpus:\n  0: {pcie_width: 16}\n")  # no PCI address
    with pytest.raises(ConfigError, match=r"bad\.yml: not a topology manifest"):
        load_manifest(path)


def test_the_drift_check_s_readings_become_the_node_s_gpus_and_their_load() -> None:
    """nvidia-smi's CSV rows (its 8-digit PCI domain, `[N/A]` where a field is not
    supported) and grep's sysfs lines, as baseline.yml reports them."""
    links = [
        "0, 00000000:18:00.0, 5, 16, 97",
        "1, 00000000:2A:00.0, 1, 8, 0",
        "2, 00000000:3A:00.0, [N/A], [N/A], [N/A]",
        "Unable to determine the device handle for GPU3: GPU is lost.",
    ]
    numa = [
        "/sys/bus/pci/devices/0000:18:00.0/numa_node:0",
        "/sys/bus/pci/devices/0000:2a:00.0/numa_node:-1",
        "/sys/bus/pci/devices/0000:3a:00.0/numa_node:x",
    ]
    seen, util = from_readings(links, numa)
    assert seen.gpus == {
        0: GpuPlace(pci="0000:18:00.0", pcie_gen=5, pcie_width=16, numa=0),
        1: GpuPlace(pci="0000:2a:00.0", pcie_gen=1, pcie_width=8, numa=-1),
        2: GpuPlace(pci="0000:3a:00.0"),
    }, "a lost GPU's line is no GPU: the manifest's comparison names it missing"
    assert util == {0: 97.0, 1: 0.0, 2: None}
    want = Topology(
        gpus={i: GpuPlace(pci=p.pci, pcie_gen=5, pcie_width=16) for i, p in seen.gpus.items()}
    )
    assert [d.check for d in differences(want, seen, util)] == ["pcie_width"], (
        "GPU 1's Gen1 is idle, its x8 is not; GPU 2 reports nothing to judge"
    )


def test_manifests_by_sku_and_a_second_one_for_a_sku_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yml").write_text("sku: h200-8gpu\ngpus: {0: {pci: '0000:18:00.0'}}\n")
    manifests = Manifests.load(tmp_path)
    assert manifests.for_host("node-001", "h200-8gpu") is not None
    assert manifests.for_host("node-001", "b200-8gpu") is None, "no manifest: not compared"
    assert Manifests.load(None).by_sku == {}
    with pytest.raises(ConfigError, match="no such directory of topology manifests"):
        Manifests.load(tmp_path / "typo")  # a wrong path is said, not an empty site
    (tmp_path / "b.yml").write_text("sku: h200-8gpu\n")
    with pytest.raises(ConfigError, match=r"b\.yml: sku h200-8gpu has a manifest already"):
        Manifests.load(tmp_path)
    (tmp_path / "b.yml").write_text("gpus: {}\n")
    with pytest.raises(ConfigError, match=r"b\.yml: a topology manifest names its sku"):
        Manifests.load(tmp_path)
