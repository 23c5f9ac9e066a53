"""The simulated fleet's memory bandwidth, NVLink and InfiniBand, and their faults.

Baseline from the H200 recording: GPM answers there (bandwidth and activity follow the
recorded utilisation: the bf16 matmul burst is compute-bound, about 23% of DRAM
bandwidth), and the board has no NVLink (fields null) and no InfiniBand (no `ib`
events). A scenario's faults add what they need:

    bw_collapse (GPU)   the node runs a memory-bound data-parallel job (every GPU busy,
                        about 70% of DRAM bandwidth); this GPU's falls to under 20%
    nvlink_down (GPU)   the node's GPUs report 18 NVLink links; `links` of this GPU's
                        are down (default 1)
    ib_down (node)      port `port` (default 1) of `device` (default mlx5_0) goes DOWN
    ib_errors (node)    `count` symbol errors (default 50) on `device`, at once

InfiniBand lives as a sysfs tree under the node's directory (sys/class/infiniband),
written when the first InfiniBand fault arrives, so the agent's own reader reads it
(`gpuops agent --backend sim`) and the driver publishes what that reader returns.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from gpuops.agent.infiniband import read_ib

NVLINKS = 18  # NVLink 4 links per H100/H200 SXM GPU
IB_DEVICES = 8  # one ConnectX-7 per GPU, as on an HGX node
IB_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors")


def gpm_fields(
    g: dict[str, Any], s: dict[str, Any], rec: dict[str, Any], rng: random.Random
) -> dict[str, Any]:
    """GPM readings for one GPU: from the recording, or the bandwidth-collapse job."""
    if any("bw_collapse" in x["faults"] for x in s["gpus"]) and not s["drained"]:
        slow = "bw_collapse" in g["faults"]
        return {
            "util_gpu": 100,
            "sm_active": round(97.5 + rng.uniform(-1, 1), 1),
            "sm_occupancy": round(41.0 + rng.uniform(-2, 2), 1),
            "tensor_active": round((12.0 if slow else 38.0) + rng.uniform(-2, 2), 1),
            "dram_bw_util": round((17.0 if slow else 70.0) + rng.uniform(-2, 2), 1),
        }
    util = float(rec["util"]["gpu"])
    return {
        "sm_active": round(util * 0.97, 1),
        "sm_occupancy": round(util * 0.25, 1),
        "tensor_active": round(util * 0.66, 1),
        "dram_bw_util": float(rec["util"]["memory"]),
    }


def nvlink_fields(g: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """NVLink fields once a scenario gave the node links (the recorded board has none)."""
    if not s.get("nvlink"):
        return {}
    down = int(g["faults"].get("nvlink_down", {}).get("links", 0))
    return {
        "nvlink_links_active": NVLINKS - down,
        "nvlink_links_down": down,
        "nvlink_crc_errors": 0,
        "nvlink_replay_errors": 0,
        "nvlink_recovery_errors": 3 * down,
    }


def ib_root(node_dir: Path) -> Path:
    """Where a simulated node's InfiniBand sysfs tree is (the agent's --ib-root)."""
    return node_dir / "sys" / "class" / "infiniband"


def read_node_ib(node_dir: Path) -> dict[str, Any] | None:
    """The node's `ib` event data, read by the agent's own reader; None without ports."""
    root = ib_root(node_dir)
    return read_ib(root) if root.is_dir() else None


def ib_fault(node_dir: Path, fault: str, params: dict[str, Any]) -> None:
    """Apply an InfiniBand fault to the node's sysfs tree (created healthy first)."""
    root = ib_root(node_dir)
    if not root.is_dir():
        write_tree(root)
    port = root / str(params.get("device", "mlx5_0")) / "ports" / str(params.get("port", 1))
    if fault == "ib_down":
        (port / "state").write_text("1: DOWN\n")
        (port / "phys_state").write_text("2: Polling\n")
        _add(port / "counters" / "link_downed", 1)
    elif fault == "ib_errors":
        _add(port / "counters" / "symbol_error", int(params.get("count", 50)))


def write_tree(root: Path) -> None:
    """Eight healthy NDR ports, one per ConnectX-7, as mlx5 lays them out."""
    for i in range(IB_DEVICES):
        port = root / f"mlx5_{i}" / "ports" / "1"
        (port / "counters").mkdir(parents=True, exist_ok=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "phys_state").write_text("5: LinkUp\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
        for name in IB_COUNTERS:
            (port / "counters" / name).write_text("0\n")


def _add(path: Path, n: int) -> None:
    path.write_text(f"{int(path.read_text().strip() or 0) + n}\n")
