"""The kubectl shim answers as kubectl does, as far as the playbooks read it: jsonpath's
empty string for an unset field, tables unless `-o json`, "No resources found" where
kubectl prints it, `configured` for any change applied, an error for what it cannot
answer; DeviceTaintRules are the cluster's, not one node's."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from gpuops.fence.dra import find_device, taint_rule
from gpuops.sim.dra_shims import resource_slice
from gpuops.sim.fleet import SimFleet
from gpuops.sim.wlm_shims import kubectl

Run = tuple[int, str, str]
UNSCHEDULABLE = ("-o", "jsonpath={.spec.unschedulable}")


class Kubectl:
    """The shim as a node's bin/kubectl runs it: exit status, stdout, stderr."""

    def __init__(self, fleet: SimFleet, capsys: pytest.CaptureFixture[str]) -> None:
        self.fleet, self.capsys = fleet, capsys

    def __call__(self, node: str, *argv: str) -> Run:
        rc = kubectl(self.fleet.node_dir(node), list(argv))
        out = self.capsys.readouterr()
        return rc, out.out, out.err

    def apply(self, monkeypatch: pytest.MonkeyPatch, node: str, reason: str) -> str:
        """fence_gpu.yml's `kubectl apply -f -` of GPU 1's NoSchedule fence: what it says."""
        s = self.fleet.state(node)
        slices = {"items": [resource_slice(s)]}
        ref = find_device(slices, str(s.get("k8s_node", node)), s["gpus"][1]["uuid"])
        rule = json.dumps(taint_rule(ref, "NoSchedule", reason))
        monkeypatch.setattr("sys.stdin", io.StringIO(rule))
        return self(node, "apply", "-f", "-")[1]


@pytest.fixture
def k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Kubectl:
    names = {"node-002": "node-002.cluster.local"}
    fleet = SimFleet.create(
        tmp_path / "sim", nodes=2, gpus=2, workload_manager="kubernetes", k8s_names=names
    )
    return Kubectl(fleet, capsys)


def test_a_schedulable_node_reads_as_an_empty_string(k: Kubectl) -> None:
    assert k("node-001", "get", "node", "node-001", *UNSCHEDULABLE) == (0, "", "")
    assert k("node-001", "cordon", "node-001")[:2] == (0, "node/node-001 cordoned\n")
    assert k("node-001", "get", "node", "node-001", *UNSCHEDULABLE) == (0, "true", "")
    missing = 'Error from server (NotFound): nodes "node-002" not found\n'
    assert k("node-002", "get", "node", "node-002", *UNSCHEDULABLE) == (1, "", missing)
    assert k("node-002", "get", "node", "node-002.cluster.local", *UNSCHEDULABLE)[0] == 0


@pytest.mark.parametrize(
    "argv",
    [
        ("get", "node", "node-001"),
        ("get", "node", "node-001", "-o", "yaml"),
        ("get", "nodes"),
        ("get", "devicetaintrules", "-o", "yaml"),
        ("get", "pods"),
        ("delete", "devicetaintrule", "x"),
        ("label", "node", "node-001", "a=b"),
        (),
    ],
)
def test_what_it_cannot_answer_fails_with_an_error_not_another_answer(
    k: Kubectl, argv: tuple[str, ...]
) -> None:
    rc, out, err = k("node-001", *argv)
    assert (rc, out) == (1, "") and err.startswith("error: "), err


def test_rules_are_a_table_unless_json_and_none_found_is_said_where_kubectl_says_it(
    k: Kubectl, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert k("node-001", "get", "devicetaintrules") == (0, "", "No resources found\n")
    k.apply(monkeypatch, "node-001", "xid 79")
    k.apply(monkeypatch, "node-002", "xid 79")
    rc, out, _ = k("node-001", "get", "devicetaintrules")
    header, *rows = out.splitlines()
    assert rc == 0 and re.fullmatch(r"NAME {3,}AGE", header), out
    assert [r.split()[0] for r in rows] == sorted(k.fleet.taint_rules()), "every node's rules"
    assert all(re.fullmatch(r"\S+ {3,}\d+s", r) for r in rows), out
    rc, out, _ = k("node-001", "get", "devicetaintrules", "-o", "json")
    assert rc == 0 and len(json.loads(out)["items"]) == 2
    delete = ("delete", "devicetaintrules", "-l", "gpuops.dev/node=node-001")
    deleted = 'devicetaintrule.resource.k8s.io "gpuops-fence-node-001-gpu-1" deleted\n'
    assert k("node-001", *delete) == (0, deleted, "")
    assert k("node-001", *delete) == (0, "No resources found\n", ""), "on stdout, as kubectl"
    assert len(k.fleet.taint_rules()) == 1, "node-002's rule stays"


def test_apply_says_configured_when_anything_applied_changed(
    k: Kubectl, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = [k.apply(monkeypatch, "node-001", reason) for reason in ("a", "a", "b")]
    name = "devicetaintrule.resource.k8s.io/gpuops-fence-node-001-gpu-1"
    assert said == [f"{name} created\n", f"{name} unchanged\n", f"{name} configured\n"]
    [rule] = k.fleet.taint_rules().values()
    assert rule["metadata"]["annotations"]["gpuops.dev/reason"] == "b"
