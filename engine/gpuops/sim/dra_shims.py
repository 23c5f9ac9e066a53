"""kubectl on the simulated cluster: its DRA objects, and what every kubectl verb of the
shims shares (the node's name in Kubernetes, `-o`, kubectl's own errors).

A ResourceSlice is the node's (NVIDIA's driver publishes one a node); DeviceTaintRules are
cluster-scoped, as in Kubernetes: one store beside the nodes (`ROOT/k8s/state.json`), so
`kubectl delete devicetaintrules -l ...` run for one node reaches every node's rules, and a
selector that picks too much is seen doing so. Output follows kubectl 1.3x: a table unless
`-o json`, "No resources found" where nothing matched (on stderr for `get`, on stdout for
`delete`, as kubectl prints them), `configured` for an `apply` that changed anything in
the applied configuration, and an error on stderr with exit 1 for what it cannot answer.
"""

from __future__ import annotations

import calendar
import json
import sys
import time
from pathlib import Path
from typing import Any

from gpuops.sim import work
from gpuops.sim.state import locked, read, write_new

DRA_DRIVER = "gpu.nvidia.com"
RULES = "devicetaintrule.resource.k8s.io"  # how kubectl names the kind in what it prints
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def k8s_name(s: dict[str, Any]) -> str:
    """The node's name in Kubernetes (the inventory's `k8s_node_name` where it differs)."""
    return str(s.get("k8s_node") or s["node"])


def output_of(argv: list[str]) -> str:
    """What `-o`/`--output` asks for (`-o json`, `-o=json`, `--output json`); "" for none."""
    for i, arg in enumerate(argv):
        for flag in ("-o", "--output"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return ""


def cannot(argv: list[str]) -> int:
    """What kubectl does with what it cannot do: an error on stderr, exit 1 (a shim that
    answered anyway would let a playbook rely on an answer no cluster gives)."""
    said = " ".join(argv)
    print(f"error: the simulated kubectl cannot answer: kubectl {said}", file=sys.stderr)
    return 1


def not_found(kind: str, name: str) -> int:
    """kubectl's word for an object the API server does not have."""
    print(f'Error from server (NotFound): {kind} "{name}" not found', file=sys.stderr)
    return 1


def cluster_dir(node_dir: Path) -> Path:
    """The simulated cluster's own objects, beside the fleet's nodes (made on first use by
    a fleet written before there was one)."""
    where = node_dir.parent.parent / "k8s"
    if not (where / "state.json").exists():
        write_new(where, {"taint_rules": {}})
    return where


def resource_slice(s: dict[str, Any]) -> dict[str, Any]:
    """The node's ResourceSlice as NVIDIA's DRA driver publishes it: one device per GPU
    (`gpu-N`) with its `uuid` and `index`, and the driver's health taints (fault `dra_taint`)."""
    node = k8s_name(s)
    devices = []
    for g in s["gpus"]:
        taints = [dict(t) for t in g["faults"].get("dra_taint", {}).get("taints", [])]
        device: dict[str, Any] = {
            "name": f"gpu-{g['index']}",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": g["uuid"]},
                "index": {"int": g["index"]},
                "productName": {"string": "NVIDIA H200"},
            },
            "capacity": {"memory": {"value": "141Gi"}},
        }
        if taints:
            device["taints"] = taints
        devices.append(device)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRA_DRIVER}-sim"},
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def dra_kubectl(node_dir: Path, argv: list[str]) -> int:
    """The DRA verbs of kubectl the fence playbooks use: `get resourceslices -o json`,
    `apply -f -`, `get devicetaintrule(s) [NAME] [-l SEL] [-o json]`, `delete
    devicetaintrules -l SEL`."""
    verb, what = argv[0], argv[1] if len(argv) > 1 else ""
    if verb == "get" and what == "resourceslices" and output_of(argv) == "json":
        return _get_slices(node_dir, argv)
    if verb == "apply" and argv[1:3] == ["-f", "-"]:
        return _apply_taint_rule(node_dir, sys.stdin.read())
    if verb == "get" and what in ("devicetaintrule", "devicetaintrules"):
        rules = read(cluster_dir(node_dir)).get("taint_rules", {})
        return _get_taint_rules(rules, argv)
    if verb == "delete" and what == "devicetaintrules" and "-l" in argv:
        return _delete_taint_rules(node_dir, argv)
    return cannot(argv)


def _get_slices(node_dir: Path, argv: list[str]) -> int:
    """The node's slice; none for a field selector naming another node."""
    s = read(node_dir)
    wanted = _flag(argv, "--field-selector")
    items = [resource_slice(s)] if wanted in ("", f"spec.nodeName={k8s_name(s)}") else []
    print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
    return 0


def _flag(argv: list[str], flag: str) -> str:
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag), "")


def _selected(rules: dict[str, Any], selector: str) -> list[str]:
    """The rules a `key=value` label selector picks ("": all of them)."""
    if not selector:
        return list(rules)
    key, _, value = selector.partition("=")
    return [n for n, r in rules.items() if r["metadata"].get("labels", {}).get(key) == value]


def _get_taint_rules(rules: dict[str, Any], argv: list[str]) -> int:
    """`get devicetaintrule NAME` or `get devicetaintrules [-l SEL]`: a table, or `-o json`."""
    output, named = output_of(argv), argv[2] if len(argv) > 2 and argv[2][:1] != "-" else ""
    if output not in ("", "json"):
        return cannot(argv)
    if named and named not in rules:
        return not_found("devicetaintrules.resource.k8s.io", named)
    names = [named] if named else _selected(rules, _flag(argv, "-l"))
    if output == "json":
        items = [rules[n] for n in names]
        listed = {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {}}
        print(json.dumps(items[0] if named else listed, indent=4))
        return 0
    if not names:
        print("No resources found", file=sys.stderr)  # cluster-scoped: no namespace named
        return 0
    print(_table(["NAME", "AGE"], [[n, _age(rules[n])] for n in sorted(names)]), end="")
    return 0


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Columns as kubectl's tabwriter pads them: three spaces after the widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _age(obj: dict[str, Any]) -> str:
    """The AGE column as kubectl's HumanDuration writes it (`45s`, `7m12s`, `3h`, `2d`)."""
    stamp = obj["metadata"].get("creationTimestamp")
    if not stamp:
        return "<unknown>"
    s = max(0, int(time.time() - calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))))
    if s < 120:
        return f"{s}s"
    m, h, d = s // 60, s // 3600, s // 86400
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    return f"{d}d{h % 24}h" if h < 192 and h % 24 else f"{d}d"


def _delete_taint_rules(node_dir: Path, argv: list[str]) -> int:
    """`delete devicetaintrules -l SEL`: every rule of the cluster the selector picks."""
    with locked(cluster_dir(node_dir)) as c:
        rules: dict[str, Any] = c.setdefault("taint_rules", {})
        names = _selected(rules, _flag(argv, "-l"))
        for name in names:
            del rules[name]
            print(f'{RULES} "{name}" deleted')
    if not names:
        print("No resources found")  # kubectl delete prints it on stdout, not stderr
    return 0


def _apply_taint_rule(node_dir: Path, text: str) -> int:
    """`kubectl apply` of a DeviceTaintRule: `created`, `configured` where anything in the
    applied configuration changed (an annotation too), else `unchanged`; stored with the
    status the API server keeps (for None: what NoExecute would evict; for NoExecute: the
    pods it evicted)."""
    rule = json.loads(text)
    if rule.get("kind") != "DeviceTaintRule" or rule.get("apiVersion") != "resource.k8s.io/v1":
        print(
            f"error: the simulated kubectl applies DeviceTaintRules only: {rule.get('kind')}",
            file=sys.stderr,
        )
        return 1
    name, applied = rule["metadata"]["name"], json.dumps(rule, sort_keys=True)
    with locked(cluster_dir(node_dir)) as c:
        rules: dict[str, Any] = c.setdefault("taint_rules", {})
        old = rules.get(name)
        if old is not None and old["metadata"]["annotations"].get(LAST_APPLIED) == applied:
            print(f"{RULES}/{name} unchanged")
            return 0
        rule["metadata"].setdefault("annotations", {})[LAST_APPLIED] = applied
        rules[name] = _stored(node_dir, rule, old)
    print(f"{RULES}/{name} {'configured' if old else 'created'}")
    return 0


def _stored(node_dir: Path, rule: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """The rule as the API server keeps it: an unchanged taint keeps its time and status
    (only the metadata changed); a new or changed one takes effect now."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    rule["metadata"]["creationTimestamp"] = old["metadata"]["creationTimestamp"] if old else stamp
    if old is not None and _without_time(old["spec"]) == _without_time(rule["spec"]):
        rule["spec"], rule["status"] = old["spec"], old.get("status", {})
        return rule
    rule["spec"]["taint"].setdefault("timeAdded", stamp)
    effect = rule["spec"]["taint"]["effect"]
    evicted = _evict_for(node_dir, rule["spec"]["deviceSelector"], effect == "NoExecute", now)
    message = (
        f"{evicted} pods evicted"
        if effect == "NoExecute"
        else f"{evicted} pods would be evicted by NoExecute"
    )
    rule["status"] = {
        "conditions": [
            {
                "type": "EvictionInProgress",
                "status": "False",
                "reason": "Completed" if effect == "NoExecute" else "NoEffect",
                "message": message,
                "lastTransitionTime": stamp,
            }
        ]
    }
    return rule


def _evict_for(node_dir: Path, selector: dict[str, Any], evict: bool, now: float) -> int:
    """The pods on the selected device (the pool is the node), evicted where `evict`."""
    index = int(str(selector["device"]).rsplit("-", 1)[-1])
    where = _node_dir_of(node_dir, str(selector.get("pool", "")))
    if where is None:
        return 0
    with locked(where) as s:
        pods = [
            p for p in work.running_pods(s, now) if index in p["gpus"] and p["evicted_at"] is None
        ]
        for pod in pods if evict else []:
            pod["evicted_at"] = now
    return len(pods)


def _node_dir_of(node_dir: Path, k8s_node: str) -> Path | None:
    """The simulated node Kubernetes knows as `k8s_node` (most often the caller's own)."""
    if k8s_name(read(node_dir)) == k8s_node:
        return node_dir
    others = (d for d in sorted(node_dir.parent.iterdir()) if (d / "state.json").exists())
    return next((d for d in others if k8s_name(read(d)) == k8s_node), None)


def _without_time(spec: dict[str, Any]) -> dict[str, Any]:
    """A rule's spec without the taint's timeAdded, which the API server sets itself."""
    taint = {k: v for k, v in spec.get("taint", {}).items() if k != "timeAdded"}
    return {**spec, "taint": taint}
