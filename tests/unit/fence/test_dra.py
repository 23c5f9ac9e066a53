"""One GPU fenced through DRA: the DeviceTaintRule gpuops renders, validated against the
Kubernetes 1.37 schema; the device chosen from fixture ResourceSlices by NVML UUID; the
selector and toleration rules; the driver's own taints as events for the right node and GPU."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from gpuops.errors import ConfigError
from gpuops.fence.dra import (
    DeviceRef,
    FenceError,
    find_device,
    label_value,
    rule_name,
    selects,
    taint_rule,
    tolerates,
)
from gpuops.inventory.hosts import Inventory, k8s_nodes
from gpuops.models import EVENT_ADAPTER, DraTaintEvent
from gpuops.sources.dra import taint_events

SLICES = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "dra" / "resourceslices.json").read_text()
)
UUID_3 = "GPU-001a1b2c3-0000-4000-8000-000000000003"
NODES = frozenset({"node-001", "node-002"})
INVENTORY = Inventory(Path("inv"), NODES, {}, {n: {} for n in NODES})


@pytest.mark.parametrize("effect", ["None", "NoSchedule", "NoExecute"])
def test_the_rendered_rule_validates_against_kubernetes_1_37(effect: str) -> None:
    rule = taint_rule(find_device(SLICES, "node-001", UUID_3), effect, "XID 79 on GPU 3")
    kubernetes_validate.validate(rule, "1.37.0", strict=True)
    assert rule["apiVersion"] == "resource.k8s.io/v1" and rule["kind"] == "DeviceTaintRule"
    assert rule["metadata"]["name"] == "gpuops-fence-node-001-gpu-3"
    assert rule["metadata"]["labels"] == {"gpuops.dev/node": "node-001"}
    assert rule["spec"]["deviceSelector"] == {
        "driver": "gpu.nvidia.com",
        "pool": "node-001",
        "device": "gpu-3",
    }
    assert rule["spec"]["taint"] == {"key": "gpuops.dev/fenced", "value": "true", "effect": effect}


def test_the_device_is_the_one_whose_uuid_is_the_gpu_s_on_that_node() -> None:
    ref = find_device(SLICES, "node-001", UUID_3)
    assert (ref.device, ref.index, ref.pool) == ("gpu-3", 3, "node-001")
    with pytest.raises(FenceError, match="no ResourceSlice of node-002"):
        find_device(SLICES, "node-002", UUID_3)  # the UUID is node-001's
    with pytest.raises(FenceError, match="effect 'Evict'"):
        taint_rule(ref, "Evict", "")


def test_a_name_is_a_dns_subdomain_whatever_the_node_is_called_and_never_shared() -> None:
    assert rule_name("node-001", "gpu-3") == "gpuops-fence-node-001-gpu-3"
    changed = rule_name("GPU_Node.07", "gpu-0")
    assert re.fullmatch(r"gpuops-fence-gpu-node-07-gpu-0-[0-9a-f]{8}", changed), changed
    assert rule_name("gpu.node-07", "gpu-0") != rule_name("gpu-node.07", "gpu-0")
    long = rule_name("n" * 300, "gpu-0")
    assert len(long) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", long)


# The API server's own check of a label value.
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
FQDN = "dgx-h200-superpod-2-scalable-unit-04-rack-07.cluster-east.corp.example"


def test_two_long_node_names_alike_in_63_characters_get_labels_of_their_own() -> None:
    a, b = f"{FQDN}.node-011", f"{FQDN}.node-012"
    assert len(a) > 70 and a[:63] == b[:63]
    assert label_value(a) != label_value(b), "returning one would delete the other's fences"
    for name in (a, b, "n" * 300, "." * 70, "GPU_Node.07 (old)"):
        label = label_value(name)
        assert len(label) <= 63 and LABEL_VALUE.fullmatch(label), label
    rule = taint_rule(DeviceRef("gpu.nvidia.com", a, "gpu-3", a), "NoExecute", "")
    assert rule["metadata"]["labels"] == {"gpuops.dev/node": label_value(a)}


def test_a_name_that_is_a_label_value_is_its_own_label_as_before() -> None:
    """Fences labelled before the hash came still match the return to service's selector."""
    for name in ("node-001", "gpu01.cluster.local", "x" * 63):
        assert label_value(name) == name


@pytest.mark.parametrize(
    ("selector", "picked"),
    [
        ({"driver": "gpu.nvidia.com", "pool": "node-001", "device": "gpu-3"}, True),
        ({"driver": "gpu.nvidia.com", "pool": "node-001", "device": "gpu-2"}, False),
        ({"driver": "gpu.amd.com", "device": "gpu-3"}, False),
        ({"pool": "node-001"}, True),
        ({}, True),
    ],
)
def test_a_selector_needs_every_field_it_sets(selector: dict[str, str], picked: bool) -> None:
    ref = DeviceRef("gpu.nvidia.com", "node-001", "gpu-3", "node-001")
    assert selects(selector, ref) is picked


FENCE = {"key": "gpuops.dev/fenced", "value": "true", "effect": "NoExecute"}


@pytest.mark.parametrize(
    ("tolerations", "tolerated"),
    [
        ([], False),
        ([{"key": "gpuops.dev/fenced", "operator": "Exists"}], True),
        ([{"key": "gpuops.dev/fenced", "operator": "Equal", "value": "true"}], True),
        ([{"key": "gpuops.dev/fenced", "value": "false"}], False),
        ([{"key": "gpuops.dev/fenced", "operator": "Exists", "effect": "NoSchedule"}], False),
        ([{"operator": "Exists"}], True),  # an empty key with Exists tolerates everything
        ([{"key": "gpu.nvidia.com/xid", "operator": "Exists"}], False),
    ],
)
def test_a_claim_tolerates_the_fence_as_dra_says(
    tolerations: list[dict[str, Any]], tolerated: bool
) -> None:
    assert tolerates(tolerations, FENCE) is tolerated


def test_a_driver_taint_becomes_an_event_for_its_node_and_gpu() -> None:
    events, unknown = taint_events(SLICES, k8s_nodes(INVENTORY), 1_900_000_000.0)
    assert unknown == {"node-099"}, "a node outside the inventory is skipped, said once"
    [event] = events
    parsed = EVENT_ADAPTER.validate_python(event)
    assert isinstance(parsed, DraTaintEvent)
    assert parsed.node == "node-001"
    assert (parsed.data.gpu, parsed.data.uuid, parsed.data.device) == (3, UUID_3, "gpu-3")
    assert (parsed.data.key, parsed.data.value, parsed.data.effect) == (
        "gpu.nvidia.com/xid",
        "79",
        "NoSchedule",
    )


def test_gpuops_s_own_fence_is_not_read_back_as_the_driver_s_word() -> None:
    ours = json.loads(json.dumps(SLICES))
    device = ours["items"][1]["spec"]["devices"][0]
    device["taints"] = [{"key": "gpuops.dev/fenced", "value": "true", "effect": "NoSchedule"}]
    events, _ = taint_events(ours, k8s_nodes(INVENTORY), 1_900_000_000.0)
    assert [e["node"] for e in events] == ["node-001"]


def test_gpuops_ingest_dra_once_prints_the_driver_taints_of_known_nodes(tmp_path: Path) -> None:
    import subprocess

    from tests.support import gpuops_argv

    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  hosts:\n    node-001: {}\n    node-002: {}\n")
    slices = Path(__file__).parents[2] / "fixtures" / "dra" / "resourceslices.json"
    done = subprocess.run(
        gpuops_argv(
            *("ingest", "dra", "--once", "--slices", str(slices), "--inventory", str(inventory)),
            state_dir=tmp_path / "state",
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    [event] = [json.loads(line) for line in done.stdout.splitlines()]
    assert (event["node"], event["kind"], event["data"]["gpu"]) == ("node-001", "dra_taint", 3)
    assert "node-099: not in the inventory" in done.stderr


GPU01 = {"k8s_node_name": "gpu01.cluster.local", "workload_manager": "kubernetes"}


def _tainted(node: str) -> dict[str, Any]:
    """A ResourceSlice of `node` whose GPU 3 the driver tainted (XID 79)."""
    device = {
        "name": "gpu-3",
        "attributes": {"uuid": {"string": "GPU-abc"}, "index": {"int": 3}},
        "taints": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}],
    }
    spec = {"driver": "gpu.nvidia.com", "nodeName": node, "pool": {"name": node}}
    return {"spec": {**spec, "devices": [device]}}


def test_a_taint_on_a_node_named_otherwise_in_kubernetes_is_its_host_s() -> None:
    inventory = Inventory(Path("inv"), frozenset({"gpu01", "gpu02"}), {}, {"gpu01": GPU01})
    slices = {"items": [_tainted("gpu01.cluster.local"), _tainted("gpu09")]}
    events, unknown = taint_events(slices, k8s_nodes(inventory), 1_900_000_000.0)
    assert [(e["node"], e["data"]["gpu"]) for e in events] == [("gpu01", 3)]
    assert unknown == {"gpu09"}, "a node no host is stays unknown, never acted upon"
    events, unknown = taint_events({"items": [_tainted("gpu01")]}, k8s_nodes(inventory), 0.0)
    assert (events, unknown) == ([], {"gpu01"}), "gpu01 is gpu01.cluster.local in Kubernetes"


def test_two_hosts_that_are_one_kubernetes_node_are_refused_naming_both() -> None:
    hostvars = {"gpu01": GPU01, "gpu01-new": GPU01}
    inventory = Inventory(Path("inv"), frozenset(hostvars), {}, hostvars)
    with pytest.raises(ConfigError, match="'gpu01' and 'gpu01-new' are both the Kubernetes node"):
        k8s_nodes(inventory)
    templated = {"gpu01": {"k8s_node_name": "{{ inventory_hostname }}.cluster.local"}}
    with pytest.raises(ConfigError, match="without Ansible's templating"):
        k8s_nodes(Inventory(Path("inv"), frozenset(templated), {}, templated))
