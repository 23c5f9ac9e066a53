"""The workload managers' tools on a simulated node: scontrol, squeue and kubectl.

They answer as the real tools do as far as the playbooks read them: `scontrol show
node` says whether jobs are still allocated (ALLOCATED/MIXED) or the node is idle,
with +DRAIN once drained; `squeue -w` names the jobs on the node; `kubectl drain`
cordons, evicts pods honouring their PodDisruptionBudgets, waits out their grace
periods, and exits non-zero at its --timeout with kubectl's own messages.
"""

from __future__ import annotations

import getpass
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from gpuops.sim import work
from gpuops.sim.dra_shims import cannot, dra_kubectl, k8s_name, not_found, output_of
from gpuops.sim.state import locked, read

PDB_REFUSAL = "Cannot evict pod as it would violate the pod's disruption budget."
RETRY_S = 5.0  # kubectl drain retries a refused eviction this often
POLL_S = 0.2  # how often the simulated drain looks at its pods again


def _slurm_state(s: dict[str, Any], now: float) -> str:
    jobs = work.running_jobs(s, now)
    held = {i for j in jobs for i in j["gpus"]}
    base = "IDLE" if not jobs else "ALLOCATED" if len(held) >= len(s["gpus"]) else "MIXED"
    return base + ("+DRAIN" if s["drained"] else "")


def scontrol(node_dir: Path, argv: list[str]) -> int:
    """`scontrol update nodename=N state=drain|resume reason=...`, `scontrol show node [-o] N`."""
    if argv[:2] == ["show", "node"]:
        s = read(node_dir)
        print(_show_node(s, _slurm_state(s, time.time()), one_line="-o" in argv))
        return 0
    if argv[:1] == ["reboot"]:  # what Slurm says where no RebootProgram is configured
        print("scontrol: error: RebootProgram isn't defined", file=sys.stderr)
        return 1
    if argv and argv[0] == "update":
        opts = {k.lower(): v for k, v in (a.split("=", 1) for a in argv[1:] if "=" in a)}
        with locked(node_dir) as s:
            return _update(s, opts)
    print(f"scontrol: invalid command {argv}", file=sys.stderr)
    return 1


def _show_node(s: dict[str, Any], state: str, one_line: bool) -> str:
    """`scontrol show node [-o]` as Slurm 22.05 prints it (captured from Debian's slurmctld
    on loopback, tests/peers/slurm.py), with the fields the playbooks read: State, and the
    Reason last, "TEXT [USER@TIME]", only while one is set."""
    fields = [
        f"NodeName={s['node']} Arch=x86_64 CoresPerSocket=1",
        f"CPUAlloc=0 CPUTot={max(1, len(s['gpus']))}",
        f"State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A",
        "Partitions=gpu",
    ]
    if s["drain_reason"]:
        by, at = s.get("drain_by") or "root", s.get("drain_at", "")
        fields.append(f"Reason={s['drain_reason']} [{by}@{at}]")
    return " ".join(fields) if one_line else "\n   ".join(fields) + "\n"


def _update(s: dict[str, Any], opts: dict[str, str]) -> int:
    if opts.get("nodename") != s["node"]:
        print(f"slurm_update error: Invalid node name specified {opts.get('nodename')}")
        return 1
    target = opts.get("state", "").lower()
    if target == "drain":
        if not opts.get("reason"):
            print("You must specify a reason when DOWNING or DRAINING a node. Request denied")
            return 1
        s["drained"], s["drain_reason"] = True, opts["reason"]
        s["drain_by"] = getpass.getuser()
        s["drain_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    elif target in ("resume", "idle"):
        s["drained"], s["drain_reason"] = False, ""
    return 0


_SQUEUE_FIELDS = {"%i": "id", "%j": "name", "%T": "state", "%e": "end"}
_SQUEUE_HEADERS = {"%i": "JOBID", "%j": "NAME", "%T": "STATE", "%e": "END_TIME"}


def squeue(node_dir: Path, argv: list[str]) -> int:
    """`squeue -w NODE [-h] [-o FORMAT]`: the jobs running on the node (%i %j %T %e)."""
    s, now = read(node_dir), time.time()
    node = argv[argv.index("-w") + 1] if "-w" in argv else s["node"]
    fmt = argv[argv.index("-o") + 1] if "-o" in argv else "%i %j %T"
    if "-h" not in argv:
        print(re.sub(r"%[ijTe]", lambda m: _SQUEUE_HEADERS[m.group()], fmt))
    for job in work.running_jobs(s, now) if node == s["node"] else []:
        row = {
            "id": job["id"],
            "name": job["name"],
            "state": "RUNNING",
            "end": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(job["ends_at"])),
        }
        print(_squeue_row(fmt, row))
    return 0


def _squeue_row(fmt: str, row: dict[str, Any]) -> str:
    return re.sub(r"%[ijTe]", lambda m: str(row[_SQUEUE_FIELDS[m.group()]]), fmt)


def kubectl(node_dir: Path, argv: list[str]) -> int:
    """`kubectl cordon|uncordon|drain NODE`, `get node NODE -o jsonpath={.spec.unschedulable}`,
    `get pods --field-selector ... -o json`; DRA's verbs in gpuops.sim.dra_shims. Anything
    else fails as kubectl fails, never with an answer to another question."""
    verb, what = [*argv, "", ""][:2]
    if verb == "get" and what == "pods" and output_of(argv) == "json":
        return _get_pods(node_dir, argv)
    if what in ("resourceslices", "devicetaintrule", "devicetaintrules") or verb == "apply":
        return dra_kubectl(node_dir, argv)
    if verb == "drain":
        return _drain(node_dir, argv)
    if verb == "get" and what in ("node", "nodes") and len(argv) > 2:
        return _get_node(node_dir, argv)
    if verb in ("cordon", "uncordon") and len(argv) == 2:
        return _cordon(node_dir, verb, what)
    return cannot(argv)


def _get_node(node_dir: Path, argv: list[str]) -> int:
    """`get node NODE -o jsonpath={.spec.unschedulable}`: `true`, or nothing at all where
    the node is schedulable (the field is unset then, and jsonpath prints an unset field as
    an empty string, with no newline)."""
    s = read(node_dir)
    if argv[2] != k8s_name(s):
        return not_found("nodes", argv[2])
    if output_of(argv) != "jsonpath={.spec.unschedulable}":
        return cannot(argv)
    print("true" if s["cordoned"] else "", end="")
    return 0


def _cordon(node_dir: Path, verb: str, name: str) -> int:
    with locked(node_dir) as s:
        if name != k8s_name(s):
            return not_found("nodes", name)
        was = s["cordoned"]
        if verb == "cordon":
            print(f"node/{name} {'already cordoned' if was else 'cordoned'}")
            s["cordoned"] = True
        else:
            s["cordoned"], s["drained"] = False, False
            print(f"node/{name} {'uncordoned' if was else 'already uncordoned'}")
    return 0


def _get_pods(node_dir: Path, argv: list[str]) -> int:
    """Pods as `-o json` lists them; only the current namespace unless -A."""
    s, now = read(node_dir), time.time()
    selector = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--field-selector"), "")
    everywhere = "-A" in argv or "--all-namespaces" in argv
    namespace = argv[argv.index("-n") + 1] if "-n" in argv else "default"
    on_node = selector in ("", f"spec.nodeName={k8s_name(s)}")
    items = [
        _pod_json(p, k8s_name(s))
        for p in work.running_pods(s, now)
        if on_node and (everywhere or p["namespace"] == namespace)
    ]
    print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
    return 0


def _pod_json(pod: work.Work, node: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": pod["name"], "namespace": pod["namespace"]}
    if pod["evicted_at"] is not None:
        meta["deletionTimestamp"] = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(pod["evicted_at"])
        )
    return {
        "metadata": meta,
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": pod["grace_s"]},
        "status": {"phase": "Running"},
    }


def _timeout_s(argv: list[str]) -> float:
    """--timeout=90s (or 5m, 1h); 0 or none waits for ever, as kubectl does."""
    raw = next((a.split("=", 1)[1] for a in argv if a.startswith("--timeout=")), "0s")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h)?", raw)
    if match is None:
        raise SystemExit(f'error: invalid argument "{raw}" for "--timeout" flag')
    seconds = float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2) or "s"]
    return seconds or float("inf")


def _drain(node_dir: Path, argv: list[str]) -> int:
    """Cordon, then evict and wait until the node's pods are gone or --timeout runs out."""
    timeout = _timeout_s(argv)
    with locked(node_dir) as s:
        name = argv[1] if len(argv) > 1 else ""
        if name != k8s_name(s):
            return not_found("nodes", name)
        print(f"node/{name} {'already cordoned' if s['cordoned'] else 'cordoned'}")
        s["cordoned"] = True
    started, refused_at = time.time(), dict[str, float]()
    while True:
        with locked(node_dir) as s:
            now = time.time()
            left = _evict(s, now, refused_at)
            if not left:
                s["drained"] = True
                print(f"node/{name} drained")
                return 0
        if now - started >= timeout:
            return _timed_out(name, left, timeout)
        time.sleep(min(POLL_S, max(0.0, started + timeout - now)))


def _evict(s: dict[str, Any], now: float, refused_at: dict[str, float]) -> list[work.Work]:
    """One eviction round; the pods still on the node after it."""
    work.settle(s, now)
    for pod in work.running_pods(s, now):
        key = f"{pod['namespace']}/{pod['name']}"
        if pod["evicted_at"] is not None:
            continue
        if not pod["pdb"]:
            print(f"evicting pod {key}")
            pod["evicted_at"] = now
        elif now - refused_at.get(key, float("-inf")) >= RETRY_S:
            refused_at[key] = now
            print(f"evicting pod {key}")
            print(
                f'error when evicting pods/"{pod["name"]}" -n "{pod["namespace"]}" '
                f"(will retry after {RETRY_S:.0f}s): {PDB_REFUSAL}",
                file=sys.stderr,
            )
    work.settle(s, now)
    return work.running_pods(s, now)


def _timed_out(node: str, left: list[work.Work], timeout: float) -> int:
    why = "[" + ", ".join(_pending(p, timeout) for p in left) + "]"
    print(f'There are pending pods in node "{node}" when an error occurred: {why}', file=sys.stderr)
    print(
        f'error: unable to drain node "{node}" due to error: {why}, continuing command...',
        file=sys.stderr,
    )
    print(f"There are pending nodes to be drained:\n {node}")
    print(f"error: {why}", file=sys.stderr)
    return 1


def _pending(pod: work.Work, timeout: float) -> str:
    name, ns = pod["name"], pod["namespace"]
    if pod["evicted_at"] is None:
        what = f'error when evicting pods/"{name}" -n "{ns}"'
    else:
        what = f'error when waiting for pod "{name}" in namespace "{ns}" to terminate'
    return f"{what}: global timeout reached: {timeout:.0f}s"
