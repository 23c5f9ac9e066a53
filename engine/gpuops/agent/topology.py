"""What the node's topology is now, read from NVML's samples and sysfs.

Each GPU: its PCI address (from the backend's bus ids), its PCIe link now (NVML's
current generation and width; `maxima` reads the link's maximum instead, which is what
`topology learn` records), NUMA node (`/sys/bus/pci/devices/ADDR/numa_node`) and NVLink
links active. Each HCA (the `ib` reader's ports): its fastest port's rate, its NUMA node,
and the GPU it sits nearest with the level `nvidia-smi topo -m` would print, from where
the two devices hang in the PCI tree (sysfs paths: a shared PCIe switch is PIX or PXB, a
shared host bridge PHB, the same NUMA node NODE, else SYS). What sysfs does not show is
left out, and the comparison (gpuops.diagnose.topology) then does not judge it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from gpuops.diagnose.topology import GpuPlace, Level, NicPlace, Topology

RATE = re.compile(r"([0-9.]+)\s*Gb/sec")
LEVELS: tuple[Level, ...] = ("PIX", "PXB", "PHB", "NODE", "SYS")
PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def pci_address(domain: int, bus: int, device: int) -> str:
    """`0000:18:00.0`, as sysfs and nvidia-smi spell it."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def observe(
    gpus: list[dict[str, Any]],
    bus_ids: dict[tuple[int, int, int], int],
    sys_root: Path,
    ib: dict[str, Any] | None,
    ib_root: Path | None,
    maxima: bool = False,
) -> Topology:
    """The node's topology from one telemetry reading (GpuSample dicts) and sysfs."""
    where = {index: pci_address(*bdf) for bdf, index in bus_ids.items()}
    places = {}
    for g in gpus:
        index = int(g["index"])
        if index not in where:
            continue
        gen, width = ("pcie_max_gen", "pcie_max_width") if maxima else ("pcie_gen", "pcie_width")
        places[index] = GpuPlace(
            pci=where[index],
            pcie_gen=g.get(gen),
            pcie_width=g.get(width),
            numa=_numa(sys_root / "bus" / "pci" / "devices" / where[index]),
            nvlinks=g.get("nvlink_links_active"),
        )
    return Topology(gpus=places, nics=_nics(ib, ib_root, sys_root, places))


def _numa(device: Path) -> int | None:
    try:
        return int((device / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None


def _nics(
    ib: dict[str, Any] | None, ib_root: Path | None, sys_root: Path, gpus: dict[int, GpuPlace]
) -> dict[str, NicPlace]:
    if not ib or ib_root is None:
        return {}
    rates: dict[str, float] = {}
    for port in ib.get("detail", []):
        found = RATE.search(str(port.get("rate", "")))
        name = str(port.get("device", ""))
        if name and found:
            rates[name] = max(rates.get(name, 0.0), float(found.group(1)))
    out = {}
    for name in sorted({str(p.get("device", "")) for p in ib.get("detail", [])} - {""}):
        device = ib_root / name / "device"
        gpu, level = _nearest(device, sys_root, gpus)
        out[name] = NicPlace(numa=_numa(device), rate_gbps=rates.get(name), gpu=gpu, level=level)
    return out


def _nearest(
    nic: Path, sys_root: Path, gpus: dict[int, GpuPlace]
) -> tuple[int | None, Level | None]:
    """The GPU nearest the HCA in the PCI tree, and the level of the path between them."""
    mine = _chain(nic)
    if not mine:
        return None, None
    best: tuple[int, int] | None = None
    for index, place in sorted(gpus.items()):
        theirs = _chain(sys_root / "bus" / "pci" / "devices" / place.pci)
        if not theirs:
            continue
        rank = LEVELS.index(_level(mine, theirs, _numa(nic), place.numa))
        if best is None or rank < best[1]:
            best = (index, rank)
    return (best[0], LEVELS[best[1]]) if best else (None, None)


def _chain(device: Path) -> list[str]:
    """The device's PCI ancestry, root complex first (`pci0000:17`, `0000:17:01.0`, ...)."""
    try:
        real = Path(os.path.realpath(device))
    except OSError:
        return []
    parts = real.parts
    roots = [i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p]
    if not roots:
        return []
    return [p for p in parts[roots[0] :] if p.startswith("pci") or PCI_ADDR.match(p)]


def _level(a: list[str], b: list[str], numa_a: int | None, numa_b: int | None) -> Level:
    """PIX: one PCIe switch between them; PXB: several; PHB: the same host bridge; NODE:
    the same NUMA node; SYS: across the interconnect between sockets."""
    shared = 0
    for x, y in zip(a[:-1], b[:-1], strict=False):  # the devices themselves never match
        if x != y:
            break
        shared += 1
    if shared == 0:
        return "NODE" if numa_a is not None and numa_a == numa_b else "SYS"
    bridges = min(len(a), len(b)) - 1 - shared  # bridges below the shared part, the nearer side
    if shared == 1:
        return "PHB"
    return "PIX" if bridges <= 1 else "PXB"
