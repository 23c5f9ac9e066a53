"""A simulated node's state: one JSON file, changed under a lock by the shims and the fleet."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Where the GPUs of an 8-GPU HGX board sit on the PCI bus (bus numbers; domain 0,
# device 0): the agent's backend, nvidia-smi's shim, the GPUs' sysfs entries (NUMA
# node) and the manifests.
SIM_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB, 0x1B, 0x2B, 0x3B, 0x5E)

H200: dict[str, Any] = {
    "name": "NVIDIA H200",
    "power_default_limit_w": 700.0,
    "power_min_limit_w": 200.0,
    "power_max_limit_w": 700.0,
    "temp_slowdown_c": 89.0,
    "temp_shutdown_c": 95.0,
    "temp_gpu_max_c": 87.0,
    "temp_mem_max_c": 95.0,
    "driver_version": "580.159.04",
}


def new_node(name: str, gpus: int, workload_manager: str = "slurm") -> dict[str, Any]:
    """A healthy node as it boots."""
    return {
        "node": name,
        "workload_manager": workload_manager,
        "drained": False,
        "drain_reason": "",
        "cordoned": False,
        "boots": 0,
        "power": "on",
        "bootdev": "disk",
        "driver_version": H200["driver_version"],
        "agent_silent": False,
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{zlib.crc32(name.encode()):08x}-sim0-{i:04x}",
                "power_limit_w": H200["power_default_limit_w"],
                "persistence_mode": True,
                "ecc_mode": True,
                "mig_mode": False,
                "compute_mode": 0,
                "app_clock_sm_mhz": 1980,
                "resets": 0,
                "faults": {},
            }
            for i in range(gpus)
        ],
    }


@contextlib.contextmanager
def locked(node_dir: Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write the node's state under an exclusive lock; written atomically."""
    path = node_dir / "state.json"
    with open(node_dir / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state: dict[str, Any] = json.loads(path.read_text())
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def read(node_dir: Path) -> dict[str, Any]:
    """The node's state as it is now."""
    with open(node_dir / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        data: dict[str, Any] = json.loads((node_dir / "state.json").read_text())
        return data


def write_new(node_dir: Path, state: dict[str, Any]) -> None:
    """Create a node's state directory."""
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "state.json").write_text(json.dumps(state, indent=1))
