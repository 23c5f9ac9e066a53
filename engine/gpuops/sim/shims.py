"""The tools a playbook calls on a simulated node: nvidia-smi, ipmitool, reboot, and the
workload managers' scontrol, squeue and kubectl (gpuops/sim/wlm_shims.py; kubectl's DRA
verbs and the cluster's objects in gpuops/sim/dra_shims.py).

Each reads and changes the node's state file and appends its argv to `calls.jsonl`,
so a playbook really changes what the node reports next, and tests can see exactly
what was called. Run as `python -m gpuops.sim.shims TOOL NODE_DIR ARGS...`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuops.record import mig
from gpuops.sim import work
from gpuops.sim.diag_shims import (
    all_reduce_perf,
    dcgmi,
    dmesg,
    ib_write_bw,
    nvbandwidth,
    nvidia_bug_report,
)
from gpuops.sim.state import H200, SIM_PCI_BUSES, locked, read
from gpuops.sim.wlm_shims import kubectl, scontrol, squeue

Tool = Callable[[Path, list[str]], int]
# Faults a reboot keeps (broken cooling, a degraded link); a reprovisioning clears them.
HARDWARE_FAULTS = frozenset({"overheat", "slow_d2d", "dcgm_fail", "pcie_narrow", "pcie_slow"})


def _gpus(state: dict[str, Any], argv: list[str]) -> list[dict[str, Any]]:
    if "-i" in argv:
        wanted = {int(x) for x in argv[argv.index("-i") + 1].split(",")}
        return [g for g in state["gpus"] if g["index"] in wanted]
    return list(state["gpus"])


def _busy(state: dict[str, Any], g: dict[str, Any]) -> bool:
    """A GPU with work on it (a simulated load), on a node powered and not drained."""
    return bool(g.get("load")) and state["power"] == "on" and not state["drained"]


def _opt(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


_QUERY: dict[str, Callable[[dict[str, Any], dict[str, Any]], object]] = {
    "index": lambda s, g: g["index"],
    "uuid": lambda s, g: g["uuid"],
    "name": lambda s, g: H200["name"],
    "power.limit": lambda s, g: f"{g['power_limit_w']:.2f}",
    "power.default_limit": lambda s, g: f"{H200['power_default_limit_w']:.2f}",
    "power.min_limit": lambda s, g: f"{H200['power_min_limit_w']:.2f}",
    "power.max_limit": lambda s, g: f"{H200['power_max_limit_w']:.2f}",
    "persistence_mode": lambda s, g: "Enabled" if g["persistence_mode"] else "Disabled",
    "ecc.mode.current": lambda s, g: "Enabled" if g["ecc_mode"] else "Disabled",
    "mig.mode.current": lambda s, g: "Enabled" if g["mig_mode"] else "Disabled",
    "compute_mode": lambda s, g: ["Default", "Exclusive_Thread", "Prohibited", "Exclusive_Process"][
        g["compute_mode"]
    ],
    "clocks.applications.graphics": lambda s, g: g["app_clock_sm_mhz"],
    "driver_version": lambda s, g: s["driver_version"],
    "reset_count": lambda s, g: g["resets"],
    "gpu_state": lambda s, g: "lost" if g["faults"].get("lost") else "ok",
    "pci.bus_id": lambda s, g: f"00000000:{SIM_PCI_BUSES[g['index']]:02X}:00.0",
    "utilization.gpu": lambda s, g: 100 if _busy(s, g) else 0,
    # An idle GPU trains its link down to Gen1 (GPU_FAULTS.md), as the simulated agent sees.
    "pcie.link.gen.current": lambda s, g: (
        g["faults"].get("pcie_slow", {}).get("gen", 5) if _busy(s, g) else 1
    ),
    "pcie.link.width.current": lambda s, g: g["faults"].get("pcie_narrow", {}).get("width", 16),
    "pcie.link.width.max": lambda s, g: 16,
}


def nvidia_smi(node_dir: Path, argv: list[str]) -> int:
    """A subset of nvidia-smi with its real flags and messages."""
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    if query is not None:
        state = read(node_dir)
        for g in _gpus(state, argv):
            if g["faults"].get("lost"):
                print(f"Unable to determine the device handle for GPU{g['index']}: GPU is lost.")
                return 15
        for g in _gpus(state, argv):
            print(", ".join(str(_QUERY[f.strip()](state, g)) for f in query.split(",")))
        return 0
    if any(a.startswith("--query-compute-apps=") for a in argv):
        state = read(node_dir)
        for g in _gpus(state, argv):
            for pid in work.pids(state, g["index"], time.time()):
                print(pid)
        return 0
    if argv[:1] == ["mig"]:
        return _mig(node_dir, argv[1:])
    with locked(node_dir) as state:
        gpus = _gpus(state, argv)
        if "-pl" in argv or "--power-limit" in argv:
            return _power_limit(gpus, _opt(argv, "-pl") or _opt(argv, "--power-limit") or "")
        if "-r" in argv or "--gpu-reset" in argv:
            return _reset(gpus, work.pids(state, gpus[0]["index"], time.time()) if gpus else [])
        if "-pm" in argv:
            for g in gpus:
                g["persistence_mode"] = _opt(argv, "-pm") in ("1", "ENABLED")
            print(f"Persistence mode set for {len(gpus)} GPU(s).")
            return 0
        if "-c" in argv:
            for g in gpus:
                g["compute_mode"] = int(_opt(argv, "-c") or 0)
            return 0
        if "-e" in argv:  # real GPUs apply this at the next reset; the simulation at once
            for g in gpus:
                g["ecc_mode"] = _opt(argv, "-e") in ("1", "ENABLED")
            print(f"Enabled ECC support for {len(gpus)} GPU(s). All done.")
            return 0
        if "-mig" in argv:
            for g in gpus:
                g["mig_mode"] = _opt(argv, "-mig") in ("1", "ENABLED")
            return 0
        if "-ac" in argv:
            for g in gpus:
                g["app_clock_sm_mhz"] = int((_opt(argv, "-ac") or "0,0").split(",")[1])
            return 0
    print("NVIDIA-SMI (simulated) " + H200["driver_version"])
    return 0


def _mig(node_dir: Path, argv: list[str]) -> int:
    """`nvidia-smi mig -i N -lgi | -dci | -dgi | -cgi PROFILES [-C]`, printing what the
    real tool prints (the table of `-lgi`, its "No GPU instances found" and exit 6)."""
    with locked(node_dir) as state:
        gpus = _gpus(state, argv)
        for g in gpus:
            if not g["mig_mode"]:
                print(
                    f"MIG mode is disabled on GPU {g['index']}. Enable it with -mig 1.",
                    file=sys.stderr,
                )
                return 6
        if "-lgi" in argv:
            return _list_instances(gpus)
        for g in gpus:
            if "-dgi" in argv or "-dci" in argv:
                g["mig_instances"] = []
            elif "-cgi" in argv:
                code = _create_instances(g, [p for p in (_opt(argv, "-cgi") or "").split(",") if p])
                if code:
                    return code
    return 0


def _list_instances(gpus: list[dict[str, Any]]) -> int:
    rows = []
    for g in gpus:
        start = 0
        for n, profile in enumerate(g.get("mig_instances", [])):
            p = mig.BY_ID[int(profile)]
            where = f"{start}:{p.memory_slices}"
            rows.append(
                f"|  {g['index']:>2}  MIG {p.name:<12} {p.id:>3}  {n + 1:>8}  {where:>10} |"
            )
            start += p.memory_slices
    if not rows:
        print("No GPU instances found: Not Found")
        return 6
    rule = "+" + "-" * 52 + "+"
    print(rule)
    print("| GPU instances:" + " " * 37 + "|")
    print("| GPU   Name            Profile  Instance   Placement |")
    print("|                         ID       ID       Start:Size|")
    print("|" + "=" * 52 + "|")
    for row in rows:
        print(row)
        print(rule)
    return 0


def _create_instances(g: dict[str, Any], profiles: list[str]) -> int:
    if g.get("processes"):
        print(f"GPU {g['index']} is in use by processes {g['processes']}", file=sys.stderr)
        return 6
    have = [int(p) for p in g.get("mig_instances", [])]
    for profile in profiles:
        if not profile.isdigit() or int(profile) not in mig.BY_ID:
            print(
                f"Unable to create a GPU instance on GPU {g['index']} using profile {profile}: "
                "Invalid Argument",
                file=sys.stderr,
            )
            return 2
        have.append(int(profile))
        if not mig.fits(have):
            print(
                f"Unable to create a GPU instance on GPU {g['index']} using profile {profile}: "
                "Insufficient Resources",
                file=sys.stderr,
            )
            return 6
        g["mig_instances"] = [*g.get("mig_instances", []), profile]
    made = ",".join(profiles)
    print(f"Successfully created GPU instances with profiles {made} on GPU {g['index']}")
    return 0


def _power_limit(gpus: list[dict[str, Any]], value: str) -> int:
    try:
        watts = float(value)
    except ValueError:
        print(f"Invalid power limit {value!r}.", file=sys.stderr)
        return 2
    lo, hi = H200["power_min_limit_w"], H200["power_max_limit_w"]
    if not lo <= watts <= hi:
        print(
            f"Provided power limit {watts:.2f} W is not a valid power limit which should be "
            f"between {lo:.2f} W and {hi:.2f} W for GPU",
            file=sys.stderr,
        )
        return 4
    for g in gpus:
        old = g["power_limit_w"]
        g["power_limit_w"] = watts
        print(f"Power limit for GPU {g['index']} was set to {watts:.2f} W from {old:.2f} W.")
    return 0


def _reset(gpus: list[dict[str, Any]], pids: list[int]) -> int:
    if len(gpus) != 1:
        print("Reset requires -i with exactly one GPU.", file=sys.stderr)
        return 2
    g = gpus[0]
    if pids:
        print(
            f"GPU {g['index']} is currently in use by another process.\n\n"
            "1 device is currently being used by one or more other processes. Please first "
            "kill all processes using this device and all compute applications running in "
            "the system.",
            file=sys.stderr,
        )
        return 255
    if g["faults"].get("lost"):
        print(f"Unable to reset GPU {g['index']}: GPU is lost. Reboot the system.", file=sys.stderr)
        return 15
    # A reset clears what lives in the GPU (stuck kernels, ECC state, NVLink training),
    # not broken cooling.
    for fault in ("zombie", "xid", "ecc", "nvlink_down", "dra_taint"):
        g["faults"].pop(fault, None)
    g["resets"] += 1
    print(f"GPU {g['index']} was successfully reset.")
    return 0


def _boot(s: dict[str, Any]) -> None:
    work.kill_all(s, time.time())  # what still ran on the node dies with it
    s["boots"] += 1
    s["power"] = "on"
    for g in s["gpus"]:  # what the hardware has stays; what the driver had is gone
        g["faults"] = {k: v for k, v in g["faults"].items() if k in HARDWARE_FAULTS}


def reboot(node_dir: Path, argv: list[str]) -> int:
    """A reboot: every GPU comes back, lost ones included; broken cooling stays broken."""
    with locked(node_dir) as s:
        _boot(s)
    return 0


def _bmc_password(options: list[str]) -> str | None:
    """The password as ipmitool takes it: `-f FILE` its first line (the playbooks give
    /dev/stdin), `-E` IPMI_PASSWORD, `-P` as argv."""
    path = _opt(options, "-f")
    if path is not None:
        with open(path) as f:
            return f.readline().rstrip("\n") or None
    if "-E" in options:
        return os.environ.get("IPMI_PASSWORD") or None
    return _opt(options, "-P")


# What the real ipmitool prints, as ipmitool 1.8.19 printed it against OpenIPMI's ipmi_sim
# (tests/integration/test_bmc_ipmi.py runs both): `chassis power` from lib/ipmi_chassis.c's
# "Chassis Power Control: %s" over ipmi_chassis_power_control_vals, `power status`'s
# "Chassis Power is on|off", `bootdev`'s "Set Boot Device to pxe", and `sel elist`'s rows
# "   1 | date | time | sensor | event | Asserted" (lib/ipmi_sel.c).
_POWER_CONTROL = {"off": "Down/Off", "on": "Up/On", "cycle": "Cycle", "reset": "Reset"}
_SEL = "   1 | 01/01/2026 | 00:00:00 | Memory #0x01 | Uncorrectable ECC | Asserted"


def _chassis(s: dict[str, Any], rest: list[str]) -> int:
    if rest[:1] == ["bootdev"] and len(rest) > 1:
        s["bootdev"] = rest[1]  # options=... (efiboot, persistent) change nothing here
        print(f"Set Boot Device to {rest[1]}")
        return 0
    if rest == ["power", "status"]:
        print(f"Chassis Power is {s['power']}")
        return 0
    if rest[:1] == ["power"] and rest[1:2] and rest[1] in _POWER_CONTROL:
        if rest[1] == "off":
            s["power"] = "off"
        else:
            _power_on(s)
        print(f"Chassis Power Control: {_POWER_CONTROL[rest[1]]}")
        return 0
    print(f"ipmitool: chassis {' '.join(rest)} is not simulated", file=sys.stderr)
    return 1


def _power_on(s: dict[str, Any]) -> None:
    if s["bootdev"] == "pxe":  # reprovisioned: a fresh image, all faults gone
        s["bootdev"] = "disk"
        for g in s["gpus"]:
            g["faults"] = {}
    _boot(s)


def ipmitool(node_dir: Path, argv: list[str]) -> int:
    """`ipmitool [-f FILE | -E | -P PASS] ... chassis power off|on|cycle|status`,
    `chassis bootdev pxe [options=...]` and `sel elist`: power changes, `on` boots the node."""
    command = next((i for i, a in enumerate(argv) if a in ("chassis", "sel")), None)
    if command is None:
        print("ipmitool: only chassis and sel commands are simulated", file=sys.stderr)
        return 1
    options, rest = argv[:command], argv[command:]
    if "-E" in options and not os.environ.get("IPMI_PASSWORD"):
        print("Unable to read password from environment", file=sys.stderr)
        return 1
    if _bmc_password(options) is None:  # the real one would prompt; a playbook cannot answer
        print("ipmitool: no password given (-E with IPMI_PASSWORD, or -P)", file=sys.stderr)
        return 1
    if rest[0] == "sel":
        if rest != ["sel", "elist"]:
            print(f"ipmitool: {' '.join(rest)} is not simulated", file=sys.stderr)
            return 1
        print(_SEL)
        return 0
    with locked(node_dir) as s:
        return _chassis(s, rest[1:])


TOOLS: dict[str, Tool] = {
    "nvidia-smi": nvidia_smi,
    "scontrol": scontrol,
    "squeue": squeue,
    "kubectl": kubectl,
    "ipmitool": ipmitool,
    "reboot": reboot,
    "dcgmi": dcgmi,
    "nvbandwidth": nvbandwidth,
    "all_reduce_perf": all_reduce_perf,
    "ib_write_bw": ib_write_bw,
    "nvidia-bug-report": nvidia_bug_report,
    "dmesg": dmesg,
}


def main(argv: list[str]) -> int:
    """Entry point of the per-node wrapper scripts."""
    tool, node_dir, args = argv[0], Path(argv[1]), argv[2:]
    with open(node_dir / "calls.jsonl", "a") as calls:
        calls.write(json.dumps({"tool": tool, "argv": args, "at": time.time()}) + "\n")
    return TOOLS[tool](node_dir, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
