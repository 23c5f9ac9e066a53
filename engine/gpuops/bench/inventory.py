"""`gpuops bench inventory`: seconds and peak RSS to read a fleet-sized inventory.

Each load runs in a fresh interpreter (`python -m gpuops.bench.inventory FILE WHICH`), so
the figures are what an engine pays at start: imports, parsing and the variables.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

RACK = 32  # hosts per rack group


def write_inventory(root: Path, hosts: int, ini: bool = False) -> Path:
    """A production-shaped inventory of `hosts` hosts under `root`: racks as child groups
    of `h200`, a workload-manager group, vars per host and group, group_vars/, host_vars/."""
    names = [f"gpu-{i:05d}" for i in range(1, hosts + 1)]
    racks = {f"rack_{r:04d}": names[r * RACK : (r + 1) * RACK] for r in range(-(-hosts // RACK))}
    _write_group_vars(root, list(racks), names)
    path = root / ("hosts.ini" if ini else "hosts.yml")
    path.write_text(_ini(racks, names) if ini else _yaml(racks, names))
    return path


def _host_vars(name: str, rack: str) -> dict[str, Any]:
    n = int(name.rsplit("-", 1)[1])
    return {
        "bmc_address": f"10.{n // 65536}.{n // 256 % 256}.{n % 256}",
        "rack": rack,
        "gpu_serials": f"1650{n:08d}",
        "nvidia_smi_bin": "/usr/bin/nvidia-smi",
    }


def _group_vars(rack: str) -> dict[str, Any]:
    return {"rack_power_budget_w": 40_000 + int(rack[-4:]) % 7 * 1000, "pdu": f"pdu-{rack}"}


def _yaml(racks: dict[str, list[str]], names: list[str]) -> str:
    doc = {
        "all": {
            "vars": {"ansible_user": "gpuops", "workload_manager": "none"},
            "children": {
                "h200": {
                    "vars": {"gpu_power_policy_w": 700},
                    "children": {
                        rack: {
                            "hosts": {h: _host_vars(h, rack) for h in hosts},
                            "vars": _group_vars(rack),
                        }
                        for rack, hosts in racks.items()
                    },
                },
                "slurm_nodes": {
                    "hosts": dict.fromkeys(names[: len(names) * 3 // 4]),
                    "vars": {"workload_manager": "slurm"},
                },
            },
        }
    }
    return "# Written by gpuops bench inventory.\n" + yaml.safe_dump(doc, sort_keys=False)


def _ini(racks: dict[str, list[str]], names: list[str]) -> str:
    lines = ["[all:vars]", "ansible_user=gpuops", "workload_manager=none", "", "[h200:children]"]
    lines += [*racks, "", "[h200:vars]", "gpu_power_policy_w=700", ""]
    for rack, hosts in racks.items():
        lines.append(f"[{rack}]")
        for h in hosts:
            lines.append(h + "".join(f" {k}={v}" for k, v in _host_vars(h, rack).items()))
        lines += [f"[{rack}:vars]", *(f"{k}={v}" for k, v in _group_vars(rack).items()), ""]
    lines += ["[slurm_nodes]", *names[: len(names) * 3 // 4], "", "[slurm_nodes:vars]"]
    return "\n".join([*lines, "workload_manager=slurm", ""])


def _write_group_vars(root: Path, racks: list[str], names: list[str]) -> None:
    group_vars, host_vars = root / "group_vars", root / "host_vars"
    (group_vars / "slurm_nodes").mkdir(parents=True, exist_ok=True)
    host_vars.mkdir(exist_ok=True)
    (group_vars / "all.yml").write_text("drain_timeout_s: 300\nworkload_manager: none\n")
    (group_vars / "h200.yml").write_text("gpu_power_policy_w: 650\nbmc_user: admin\n")
    (group_vars / "slurm_nodes" / "10-drain.yml").write_text("drain_timeout_s: 480\n")
    (group_vars / "slurm_nodes" / "20-poll.yaml").write_text("drain_poll_s: 15\n")
    for rack in racks[::10]:  # some racks have their own budget file
        (group_vars / f"{rack}.yml").write_text("rack_power_budget_w: 30000\n")
    for name in names[::250]:  # a few hosts are special
        (host_vars / f"{name}.yml").write_text("gpu_power_policy_w: 500\nrack: quarantine\n")


def bench_inventory(hosts: int, compare: int | None) -> Iterator[str]:
    """Write inventories and load each in a fresh process; one line of figures per load."""
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-inv-") as tmp:
        runs = [(hosts, "fast", False), (hosts, "fast", True)]
        if compare:
            runs += [(compare, "fast", False), (compare, "ansible", False)]
        for n, which, ini in runs:
            root = Path(tmp) / f"{n}-{'ini' if ini else 'yaml'}"
            path = root / ("hosts.ini" if ini else "hosts.yml")
            if not path.exists():
                root.mkdir()
                write_inventory(root, n, ini=ini)
            yield _line(n, path, _measure(path, which))


def _measure(path: Path, which: str) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gpuops.bench.inventory", str(path), which],
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    figures["process_s"] = time.perf_counter() - start
    return figures


def _line(n: int, path: Path, f: dict[str, Any]) -> str:
    label = "fast reader" if f["path"] == "fast" else "Ansible's loader"
    return (
        f"{n:>6} hosts {path.suffix[1:]:<4} {label:<16} ready {f['load_s']:6.2f} s "
        f"(CPU {f['cpu_s']:5.2f} s, process {f['process_s']:5.2f} s)  "
        f"peak RSS {f['peak_rss_mb']:6.1f} MB (python alone {f['base_rss_mb']:.1f} MB)  "
        f"{f['bytes'] / 1e6:.1f} MB of files"
    )


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(path: Path, which: str) -> None:
    """Load once and print the figures as JSON (runs in the fresh interpreter)."""
    import logging

    base = _peak_rss_mb()
    from gpuops.inventory import hosts as inventory

    taken: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: taken.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gpuops.inventory").addHandler(handler)
    logging.getLogger("gpuops.inventory").setLevel(logging.INFO)
    start, cpu = time.perf_counter(), time.process_time()
    load = inventory.load_inventory if which == "fast" else inventory.load_inventory_ansible
    inv = load(path)
    took, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _peak_rss_mb()
    fast = any("fast reader in" in m for m in taken)
    size = sum(p.stat().st_size for p in path.parent.rglob("*") if p.is_file())
    figures = {"hosts": len(inv.hosts), "load_s": took, "cpu_s": cpu, "peak_rss_mb": peak}
    figures["base_rss_mb"] = base
    print(json.dumps({**figures, "path": "fast" if fast else "ansible", "bytes": size}))


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2])
