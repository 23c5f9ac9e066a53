"""N nodes x G GPUs whose telemetry follows a real H200 recording, with faults on demand.

Each node has a state directory (state.json, calls.jsonl, bin/ with its tool shims);
the Ansible inventory of the fleet points each host's tool variables at its shims,
with `ansible_connection: local`, so playbooks run for real against simulated nodes.
"""

from __future__ import annotations

import json
import random
import stat
import sys
import time
import zlib
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

import gpuops
from gpuops.diagnose import skus
from gpuops.match.durations import parse_duration
from gpuops.models import new_event
from gpuops.sim import interconnect, work
from gpuops.sim import state as node_state
from gpuops.sim.power_model import POWER_CAP, h200_model
from gpuops.sim.shims import TOOLS
from gpuops.sim.state import H200, SIM_PCI_BUSES

SHIPPED_SKU = "h200-8gpu"  # the recordings' node: gpuops/diagnose/skus.yml


@cache
def h200_trace() -> tuple[dict[str, Any], ...]:
    """The recorded H200 load-burst trace: idle, a bf16 matmul burst, idle (10 Hz)."""
    text = resources.files("gpuops.sim").joinpath("data/h200_trace_load_burst.jsonl").read_text()
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


@cache
def h200_snapshot() -> dict[str, Any]:
    """The recorded full NVML snapshot of one H200."""
    text = resources.files("gpuops.sim").joinpath("data/h200_snapshot.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return data


def stable_hash(*parts: object) -> int:
    """The same number for the same parts in every process (unlike hash())."""
    return zlib.crc32(repr(parts).encode())


def node_name(i: int) -> str:
    """The name of the i-th simulated node (1-based)."""
    return f"node-{i:03d}"


# NVIDIA's DRA driver's taint for a GPU that fell off the bus, unless the fault says else.
DRA_TAINT = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}
RACK_SIZE = 4  # nodes per rack in the simulated inventory (groups rack-a1, rack-a2, ...)


def racks(nodes: list[str]) -> dict[str, list[str]]:
    """The fleet's racks: `rack-a1` holds the first RACK_SIZE nodes, and so on."""
    return {
        f"rack-a{i // RACK_SIZE + 1}": nodes[i : i + RACK_SIZE]
        for i in range(0, len(nodes), RACK_SIZE)
    }


@dataclass
class SimFleet:
    """A simulated fleet under `root`: nodes/ holds node state, inventory/ the hosts file."""

    root: Path
    nodes: list[str]
    gpus: int
    seed: int = 7
    _cache: dict[str, tuple[tuple[int, int], dict[str, Any]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def create(
        cls,
        root: Path,
        nodes: int,
        gpus: int = 8,
        workload_manager: str = "slurm",
        seed: int = 7,
        k8s_names: dict[str, str] | None = None,
    ) -> SimFleet:
        """Make the node state dirs, their shims and the inventory; `k8s_names` gives nodes
        another name in Kubernetes (the inventory's `k8s_node_name`)."""
        fleet = cls(root=root, nodes=[node_name(i + 1) for i in range(nodes)], gpus=gpus, seed=seed)
        node_state.write_new(root / "k8s", {"taint_rules": {}})  # the cluster's own objects
        for name in fleet.nodes:
            node_dir = fleet.node_dir(name)
            new = node_state.new_node(name, gpus, workload_manager)
            if k8s_names and name in k8s_names:
                new["k8s_node"] = k8s_names[name]
            node_state.write_new(node_dir, new)
            _write_shims(node_dir)
            for index in range(gpus):  # half the board on each socket, as on an HGX
                _write_numa(node_dir, index, index * 2 // max(gpus, 1))
        fleet.write_inventory(root / "inventory")
        return fleet

    def sku(self) -> str:
        """The SKU the gate holds these nodes to: an H200 HGX, with this fleet's GPU count."""
        return SHIPPED_SKU if self.gpus == 8 else f"{SHIPPED_SKU}-sim{self.gpus}"

    def write_skus(self, target: Path) -> Path | None:
        """A site skus file for a fleet of other than 8 GPUs a node: the shipped H200's
        numbers with this fleet's GPU count, so the gate judges what the nodes have."""
        if self.gpus == 8:
            return None
        entry = skus.load().get(SHIPPED_SKU).model_dump(mode="json")
        entry["description"] = f"simulated H200 node of {self.gpus} GPUs ({SHIPPED_SKU}'s numbers)"
        entry["gpu_count"] = {
            "value": self.gpus,
            "sources": [f"gpuops.sim.fleet: SimFleet.create(gpus={self.gpus})"],
        }
        path = target / "skus.yml"
        path.write_text(yaml.safe_dump({"skus": {self.sku(): entry}}, sort_keys=False))
        return path

    def node_dir(self, node: str) -> Path:
        """The state directory of one node."""
        return self.root / "nodes" / node

    def write_inventory(self, target: Path, group_vars: dict[str, Any] | None = None) -> Path:
        """An Ansible inventory (hosts.yml) for this fleet: local connection, shims as tools;
        `group_vars` add to or override the fleet-wide variables (e.g. drain_timeout_s), the
        per-node ones too (`scontrol_bin: /usr/bin/scontrol`: a real Slurm's tools)."""
        given = group_vars or {}
        target.mkdir(parents=True, exist_ok=True)
        skus_file = self.write_skus(target)
        hosts = {}
        rack_of = {n: r for r, ns in racks(self.nodes).items() for n in ns}
        for name in self.nodes:
            bin_dir, state = self.node_dir(name) / "bin", node_state.read(self.node_dir(name))
            own = {
                "rack": rack_of[name],  # a failure domain (grade 4 picks peers outside it)
                "sim_node_dir": str(self.node_dir(name)),
                "sysfs_root": str(self.node_dir(name) / "sys"),  # the GPUs' NUMA nodes
                "gpuops_marker_dir": str(self.node_dir(name) / "done"),
                "workload_manager": state["workload_manager"],
                **({"k8s_node_name": state["k8s_node"]} if "k8s_node" in state else {}),
                **{f"{tool.replace('-', '_')}_bin": str(bin_dir / tool) for tool in TOOLS},
            }
            hosts[name] = {k: v for k, v in own.items() if k not in given}
        doc = {
            "all": {
                "vars": {
                    "ansible_connection": "local",
                    "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                    "workload_manager": "slurm",
                    "gpu_power_policy_w": H200["power_default_limit_w"],
                    "bmc_address": "127.0.0.1",
                    "bmc_user": "sim",
                    "bmc_password": "sim",
                    # Simulated work ends in seconds: look often, give up after two minutes.
                    "drain_poll_s": 1,
                    "drain_timeout_s": 120,
                    "gpu_sku": self.sku(),
                    **({"diagnostics_skus_file": str(skus_file)} if skus_file else {}),
                    **given,
                },
                "children": {
                    "sim": {"hosts": hosts},
                    "h200": {"hosts": dict.fromkeys(hosts)},
                    **{r: {"hosts": dict.fromkeys(ns)} for r, ns in racks(self.nodes).items()},
                },
            }
        }
        path = target / "hosts.yml"
        path.write_text(
            "# Written by the gpuops simulated fleet; do not edit.\n" + yaml.safe_dump(doc)
        )
        return path

    # --- faults -------------------------------------------------------------------

    def inject(
        self, node: str, fault: str, gpu: int | None = None, at: float = 0.0, **params: Any
    ) -> None:
        """Put a fault on a node or GPU (the kinds in gpuops.sim.scenario.FAULTS, and lost)."""
        with node_state.locked(self.node_dir(node)) as s:
            g = s["gpus"][gpu or 0]
            if fault == "silent":
                s["agent_silent"] = True
            elif fault == "power_limit":
                g["power_limit_w"] = float(params.get("watts", 400))
            elif fault == "drift":
                g[params.get("setting", "persistence_mode")] = params.get("value", False)
            elif fault == "xid":
                xid = int(params.get("xid", 79))
                g["faults"]["lost" if xid == 79 else "xid"] = {"since": at, "xid": xid}
                if "comes_back_at_gbs" in params:  # a reboot brings it back, its links slow
                    g["faults"]["slow_d2d"] = {"gbs": float(params["comes_back_at_gbs"])}
                _pending(
                    s, "xid", {"gpu": g["index"], "xid": xid, "message": params.get("message", "")}
                )
            elif fault == "drained":  # taken out of service earlier (Slurm and Kubernetes)
                s["drained"], s["cordoned"] = True, True
                # gpuops's own drain unless told whose: a person's reason is left alone.
                s["drain_reason"] = str(params.get("reason", "gpuops earlier: remediation"))
            elif fault == "slow_d2d":  # the GPU's NVLink links at `gbs` (nvbandwidth, NCCL)
                g["faults"]["slow_d2d"] = {"gbs": float(params.get("gbs", 120.0))}
            elif fault == "dcgm_fail":  # a DCGM diagnostic plugin fails on the GPU
                plugin = str(params.get("plugin", "pcie"))
                message = str(params.get("message", f"simulated {plugin} failure"))
                g["faults"]["dcgm_fail"] = {"plugin": plugin, "message": message}
            elif fault == "bad_hca":  # one HCA of the node runs at `gbps` (ib_write_bw)
                device = str(params.get("device", "mlx5_0"))
                s.setdefault("bad_hcas", {})[device] = float(params.get("gbps", 90.0))
            elif fault == "dra_taint":  # the DRA driver taints the GPU's device (a reset clears)
                taint = {k: str(params.get(k, d)) for k, d in DRA_TAINT.items()}
                g["faults"]["dra_taint"] = {"taints": [taint]}
            elif fault == "pcie_narrow":  # the GPU's PCIe link trained below x16
                g["faults"]["pcie_narrow"] = {"width": int(params.get("width", 8))}
            elif fault == "pcie_slow":  # the GPU's link stays below Gen5 under load too
                g["faults"]["pcie_slow"] = {"gen": int(params.get("gen", 3))}
            elif fault == "numa":  # the GPU shows on another NUMA node (a BIOS setting)
                _write_numa(self.node_dir(node), g["index"], int(params.get("to", 1)))
            elif fault == "busy":  # a job holds the GPU (for MIG and reset refusals)
                g["processes"] = [int(params.get("pid", 4242))]
            elif fault == "load":  # steady work on the GPU(s), on the power model
                name = str(params.get("workload", "training"))
                h200_model().workload(name)  # an unknown name fails here, not in telemetry
                for target in s["gpus"] if params.get("all_gpus", True) else [g]:
                    target["load"] = name
            elif fault in ("job", "pod"):
                _add_work(s, fault, params)
            elif fault == "nvlink_down":
                s["nvlink"] = True  # the node has links from now on, after resets too
                g["faults"][fault] = {"since": at, **params}
            elif fault in ("ib_down", "ib_errors"):
                interconnect.ib_fault(self.node_dir(node), fault, params)
            elif fault == "ecc":
                g["faults"]["ecc"] = {"since": at, "sbe": int(params.get("sbe", 0))}
                if params.get("type", "dbe") == "dbe":
                    _pending(s, "ecc", {"gpu": g["index"], "type": "dbe", "count": 1})
            else:
                g["faults"][fault] = {"since": at, **params}

    def state(self, node: str) -> dict[str, Any]:
        """A node's state as it is now (re-read only when its file changed)."""
        info = (self.node_dir(node) / "state.json").stat()
        stamp = (info.st_ino, info.st_mtime_ns)  # os.replace gives every write a new inode
        cached = self._cache.get(node)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        data = node_state.read(self.node_dir(node))
        self._cache[node] = (stamp, data)
        return data

    def taint_rules(self) -> dict[str, Any]:
        """The cluster's DeviceTaintRules by name (cluster-scoped: every node's)."""
        if not (self.root / "k8s" / "state.json").exists():
            return {}  # a fleet written before the cluster had a store; no kubectl ran since
        rules: dict[str, Any] = node_state.read(self.root / "k8s").get("taint_rules", {})
        return rules

    def take_events(self, node: str) -> list[dict[str, Any]]:
        """Health events the node's agent would have sent since last asked (XID, ECC)."""
        if not self.state(node).get("pending_events"):
            return []
        with node_state.locked(self.node_dir(node)) as s:
            pending: list[dict[str, Any]] = s.pop("pending_events", [])
        return pending

    def probe(self, node: str) -> dict[str, Any]:
        """The known-answer probe as this node answers it: a zombie GPU fails it."""
        sick = [g["index"] for g in self.state(node)["gpus"] if "zombie" in g["faults"]]
        if sick:
            return {
                "gpu": sick[0],
                "ok": False,
                "outcome": "fail",
                "error": "max abs error 2.7e+01 > 1e-06",
                "duration_s": 0.31,
            }
        return {"gpu": None, "ok": True, "outcome": "pass", "duration_s": 0.28}

    # --- what the agents would publish ---------------------------------------------

    def telemetry(self, node: str, t: float) -> dict[str, Any] | None:
        """One telemetry event for `node` at time `t`, or None when its agent is silent."""
        s = self.state(node)
        if s["agent_silent"]:
            return None
        rng = random.Random(stable_hash(self.seed, node, int(t)))
        gpus = [
            _gpu_sample(g, s, t, self._offset(node, g["index"]), rng)
            for g in s["gpus"]
            if not g["faults"].get("lost")
        ]
        return envelope("telemetry", node, t, {"gpus": gpus})

    def ib(self, node: str, t: float) -> dict[str, Any] | None:
        """The node's `ib` event, when a scenario gave it InfiniBand ports and it speaks."""
        data = interconnect.read_node_ib(self.node_dir(node))
        if data is None or self.state(node)["agent_silent"]:
            return None
        return envelope("ib", node, t, data)

    def heartbeat(self, node: str, t: float, seq: int) -> dict[str, Any] | None:
        """The agent's heartbeat, unless it went silent."""
        if self.state(node)["agent_silent"]:
            return None
        return envelope("heartbeat", node, t, {"seq": seq, "agent_version": "sim"})

    def _offset(self, node: str, gpu: int) -> int:
        return stable_hash(self.seed, node, gpu) % len(h200_trace())


def _add_work(state: dict[str, Any], kind: str, params: dict[str, Any]) -> None:
    """A Slurm job (`duration`) or a Kubernetes pod (`grace`, `pdb`, optional `duration`).

    Work lives on the wall clock (the tools and the playbooks' waits do), so it starts
    now, whatever simulated time the fault was given.
    """
    now, params = time.time(), dict(params)
    for key in ("duration", "grace"):
        if key in params:
            params[f"{key}_s"] = parse_duration(params.pop(key))
    if kind == "job":
        work.add_job(state, now, params.pop("duration_s", 3600.0), **params)
    else:
        work.add_pod(state, now, **params)


def _pending(state: dict[str, Any], kind: str, data: dict[str, Any]) -> None:
    state.setdefault("pending_events", []).append({"kind": kind, "data": data})


def envelope(
    kind: str, node: str, t: float, data: dict[str, Any], source: str = "sim"
) -> dict[str, Any]:
    """An event in format v1 from the simulated fleet."""
    return new_event(kind, node, t, data, source)


def _gpu_sample(
    g: dict[str, Any], s: dict[str, Any], t: float, offset: int, rng: random.Random
) -> dict[str, Any]:
    trace = h200_trace()
    # One recorded sample per simulated second: a four-minute idle/burst/idle cycle.
    rec = trace[(int(t) + offset) % len(trace)]
    idle = trace[0]
    if s["drained"] or s["power"] != "on":
        rec = idle
    limit = float(g["power_limit_w"])
    power = min(rec["power_mw"] / 1000.0, limit - 2.0) + rng.uniform(-1.5, 1.5)
    reasons = int(rec["clocks_event_reasons"])
    temp = float(rec["temp_c"]) + (offset % 4) + rng.uniform(-0.4, 0.4)
    mem_temp = float(rec["mem_temp_c"]) + (offset % 3) + rng.uniform(-0.4, 0.4)
    loaded = rec["util"]["gpu"] > 50
    if loaded and limit < rec["power_mw"] / 1000.0:
        reasons |= 0x4  # capped below what the load wants
    hot = g["faults"].get("overheat")
    if hot is not None:
        ramp = min(1.0, max(0.0, (t - hot["since"]) / 30.0))
        heat = (58.0 if not s["drained"] else 6.0) * ramp
        temp = min(93.0, 34.0 + heat + rng.uniform(-0.4, 0.4))
        mem_temp = min(96.0, mem_temp + heat * 0.8)
        if temp >= H200["temp_slowdown_c"] - 2:
            reasons |= 0x20
    load = g.get("load")
    clock, util = rec["sm_mhz"], rec["util"]["gpu"]
    if load is not None and not s["drained"] and s["power"] == "on":
        point = h200_model().at(h200_model().workload(load), limit)
        power = point.power_w + rng.uniform(-1.5, 1.5)
        clock, util = round(point.clock_mhz), point.util
        reasons = (reasons & ~POWER_CAP) | (POWER_CAP if point.limited else 0)
    sbe = g["faults"].get("ecc", {}).get("sbe", 0)
    sample = {
        "index": g["index"],
        "uuid": g["uuid"],
        "name": H200["name"],
        "temp_c": round(temp, 1),
        "mem_temp_c": round(mem_temp, 1),
        "temp_slowdown_c": H200["temp_slowdown_c"],
        "temp_shutdown_c": H200["temp_shutdown_c"],
        "temp_gpu_max_c": H200["temp_gpu_max_c"],
        "temp_mem_max_c": H200["temp_mem_max_c"],
        "power_w": round(power, 1),
        "power_limit_w": limit,
        "power_default_limit_w": H200["power_default_limit_w"],
        "power_min_limit_w": H200["power_min_limit_w"],
        "power_max_limit_w": H200["power_max_limit_w"],
        "energy_j": rec["energy_mj"] / 1000.0,
        "sm_clock_mhz": clock,
        "mem_clock_mhz": rec["mem_mhz"],
        "app_clock_sm_mhz": g["app_clock_sm_mhz"],
        "max_clock_sm_mhz": 1980,
        "util_gpu": util,
        "util_mem": rec["util"]["memory"],
        "mem_used_bytes": rec["mem"]["used"],
        "mem_total_bytes": rec["mem"]["total"],
        "clocks_event_reasons": reasons,
        "ecc_sbe_volatile": sbe,
        "ecc_dbe_volatile": 0,
        "ecc_sbe_aggregate": sbe,
        "ecc_dbe_aggregate": 0,
        "remapped_rows_corrected": 0,
        "remapped_rows_uncorrected": 0,
        "remap_pending": False,
        "remap_failure": False,
        "recovery_action": g["faults"].get("recovery_action", {}).get("action", 0),
        # An idle GPU trains its link down to Gen1 (GPU_FAULTS.md); a busy one runs Gen5.
        "pcie_gen": g["faults"].get("pcie_slow", {}).get("gen", 5) if util else 1,
        "pcie_width": g["faults"].get("pcie_narrow", {}).get("width", 16),
        "pcie_max_gen": 5,
        "pcie_max_width": 16,
        "pcie_replay": 1,
        "pstate": rec["pstate"],
        "persistence_mode": g["persistence_mode"],
        "ecc_mode": g["ecc_mode"],
        "mig_mode": g["mig_mode"],
        "compute_mode": g["compute_mode"],
    }
    sample.update(interconnect.gpm_fields(g, s, rec, rng))
    sample.update(interconnect.nvlink_fields(g, s))
    return sample


def gpu_sysfs(node_dir: Path, index: int) -> Path:
    """A simulated GPU's sysfs device directory (the agent's --sys-root is node_dir/sys)."""
    return node_dir / "sys" / "bus" / "pci" / "devices" / f"0000:{SIM_PCI_BUSES[index]:02x}:00.0"


def _write_numa(node_dir: Path, index: int, numa: int) -> None:
    device = gpu_sysfs(node_dir, index)
    device.mkdir(parents=True, exist_ok=True)
    (device / "numa_node").write_text(f"{numa}\n")


def _write_shims(node_dir: Path) -> None:
    bin_dir = node_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    # The gpuops that wrote the shims answers in them: a run's environment has no
    # PYTHONPATH (gpuops.act.runenv), and a checkout beside an installed one is its own.
    source = Path(gpuops.__file__).resolve().parent.parent
    for tool in TOOLS:
        script = bin_dir / tool
        script.write_text(
            f'#!/bin/sh\nPYTHONPATH="{source}" exec "{sys.executable}" -m gpuops.sim.shims '
            f'{tool} "{node_dir}" "$@"\n'
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
