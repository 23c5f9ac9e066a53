"""DeviceTaintRules for one GPU, and the DRA driver's device taints, in resource.k8s.io/v1
(GA in Kubernetes 1.37).

A DRA driver (NVIDIA's: `gpu.nvidia.com`) publishes each node's GPUs in ResourceSlices:
`spec.driver`, `spec.pool.name`, `spec.nodeName`, and per device its `name` and
`attributes` (`uuid`, the NVML UUID; `index`). gpuops fences the GPU whose `uuid` is the
one NVML names: a DeviceTaintRule selecting that driver, pool and device, named for the
node and the device (`gpuops-fence-node-001-gpu-3`), labelled with the node so the return
to service removes every fence of it at once (a node name over 63 characters, too long for
a label value, is cut and given a hash of the whole: the label is that node's alone). The
taint's effect climbs the ladder: `None` (report only: the rule's status says what
NoExecute would evict, the evidence), `NoSchedule` (no new claims), `NoExecute` (its pods
evicted; after the breaker and a person's approval). The manifests are built with the
official client's models.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

API_VERSION = "resource.k8s.io/v1"
K8S_DOMAIN = "gpuops.dev"  # the prefix of gpuops's own keys, labels and annotations
TAINT_KEY = f"{K8S_DOMAIN}/fenced"
NODE_LABEL = f"{K8S_DOMAIN}/node"
EFFECTS = ("None", "NoSchedule", "NoExecute")
_DNS = re.compile(r"[^a-z0-9-]+")
LABEL_MAX = 63  # characters in a Kubernetes label value
_LABEL = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # the API's own pattern
_NOT_LABEL = re.compile(r"[^A-Za-z0-9._-]+")
_LABEL_HASH = 12  # hex digits of sha256: 48 bits, no clash in any fleet


class FenceError(ValueError):
    """The GPU cannot be fenced as asked (no slice publishes it, a bad effect)."""


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """Where a DRA driver publishes one device: what a DeviceTaintSelector names."""

    driver: str
    pool: str
    device: str
    node: str
    uuid: str = ""
    index: int | None = None


def _attribute(device: Mapping[str, Any], name: str) -> Any:
    """A device attribute's value (`{"string": ...}`, `{"int": ...}`), by bare or qualified
    name (`uuid` or `gpu.nvidia.com/uuid`)."""
    attributes = device.get("attributes") or {}
    for key, value in attributes.items():
        if (key == name or key.endswith("/" + name)) and isinstance(value, Mapping):
            for kind in ("string", "int", "bool", "version"):
                if kind in value:
                    return value[kind]
    return None


def devices(slices: Mapping[str, Any]) -> Iterable[tuple[DeviceRef, Mapping[str, Any]]]:
    """Every device of a ResourceSliceList (as `kubectl get resourceslices -o json` or the
    API lists it), with where it is published."""
    for item in slices.get("items") or []:
        spec = item.get("spec") or {}
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        node = str(spec.get("nodeName") or "")
        for device in spec.get("devices") or []:
            index = _attribute(device, "index")
            ref = DeviceRef(
                driver=driver,
                pool=pool,
                device=str(device.get("name", "")),
                node=node,
                uuid=str(_attribute(device, "uuid") or ""),
                index=int(index)
                if isinstance(index, int) and not isinstance(index, bool)
                else None,
            )
            yield ref, device


def find_device(slices: Mapping[str, Any], node: str, uuid: str) -> DeviceRef:
    """The device on `node` whose `uuid` attribute is the GPU's NVML UUID."""
    found = [ref for ref, _ in devices(slices) if ref.node == node and ref.uuid == uuid]
    if len(found) != 1:
        where = "no ResourceSlice" if not found else f"{len(found)} ResourceSlices"
        raise FenceError(f"{where} of {node} publish a device with uuid {uuid}")
    return found[0]


def rule_name(node: str, device: str) -> str:
    """The DeviceTaintRule's name: `gpuops-fence-<node>-<device>`, a DNS subdomain; where
    the node's name had to change to be one (case, dots, length), a short hash of the
    node and device keeps two nodes' fences apart."""
    plain = f"gpuops-fence-{node}-{device}"
    name = _DNS.sub("-", plain.lower()).strip("-")
    if name != plain or len(name) > 253:
        digest = hashlib.sha256(f"{node}\0{device}".encode()).hexdigest()[:8]
        name = f"{name[:240].rstrip('-')}-{digest}"
    return name


def taint_rule(ref: DeviceRef, effect: str, reason: str) -> dict[str, Any]:
    """The DeviceTaintRule fencing `ref` with `effect`, as the API takes it."""
    if effect not in EFFECTS:
        raise FenceError(f"effect {effect!r}: one of {', '.join(EFFECTS)}")
    from kubernetes import client  # the official client's models (heavy: imported here)

    rule = client.V1DeviceTaintRule(
        api_version=API_VERSION,
        kind="DeviceTaintRule",
        metadata=client.V1ObjectMeta(
            name=rule_name(ref.node, ref.device),
            labels={NODE_LABEL: label_value(ref.node)},
            annotations={f"{K8S_DOMAIN}/reason": reason[:1024], f"{K8S_DOMAIN}/uuid": ref.uuid},
        ),
        spec=client.V1DeviceTaintRuleSpec(
            device_selector=client.V1DeviceTaintSelector(
                driver=ref.driver, pool=ref.pool, device=ref.device
            ),
            taint=client.V1DeviceTaint(key=TAINT_KEY, value="true", effect=effect),
        ),
    )
    out: dict[str, Any] = client.ApiClient().sanitize_for_serialization(rule)  # type: ignore[no-untyped-call]
    return out


def label_value(text: str) -> str:
    """`text` as a Kubernetes label value, one of its own: the return to service deletes a
    node's fences by this label, so two nodes must never share one."""
    if len(text) <= LABEL_MAX and _LABEL.fullmatch(text):
        return text  # every Kubernetes node name of 63 characters or fewer: as it always was
    # Cut or changed, the name could equal another's (FQDNs share long prefixes): a hash of
    # the whole of it keeps them apart, as rule_name's does.
    digest = hashlib.sha256(text.encode()).hexdigest()[:_LABEL_HASH]
    prefix = _NOT_LABEL.sub("-", text)[: LABEL_MAX - _LABEL_HASH - 1].strip("-._")
    return f"{prefix}-{digest}" if prefix else digest


def selects(selector: Mapping[str, Any], ref: DeviceRef) -> bool:
    """Whether a DeviceTaintSelector picks the device (every field set must match; an
    empty selector matches all)."""
    wanted = {"driver": ref.driver, "pool": ref.pool, "device": ref.device}
    return all(selector.get(k) in (None, v) for k, v in wanted.items())


def tolerates(tolerations: Iterable[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether a claim's tolerations tolerate a device taint (DRA's rules, as for node
    taints): `Exists` matches any value of the key (an empty key: every taint), `Equal`
    (the default) the value too; an empty effect matches every effect."""
    for t in tolerations:
        key, op = t.get("key") or "", t.get("operator") or "Equal"
        if key and key != taint.get("key"):
            continue
        if op == "Equal" and (not key or t.get("value", "") != taint.get("value", "")):
            continue
        if op not in ("Equal", "Exists"):
            continue
        if t.get("effect") in (None, "", taint.get("effect")):
            return True
    return False


def evidence(rule: Mapping[str, Any]) -> str:
    """What the rule's status says (for `None`: what NoExecute would evict)."""
    conditions = ((rule.get("status") or {}).get("conditions")) or []
    said = [
        f"{c.get('type')}={c.get('status')}: {c.get('message', '')}".strip()
        for c in conditions
        if isinstance(c, Mapping)
    ]
    return "; ".join(said) or "no status yet"


@dataclass(frozen=True, slots=True)
class DriverTaint:
    """A taint the DRA driver put on one of its devices (`gpu.nvidia.com/xid=79`)."""

    ref: DeviceRef
    key: str
    value: str
    effect: str


def driver_taints(slices: Mapping[str, Any]) -> list[DriverTaint]:
    """Every taint published on a device of the slices (the driver's health taints)."""
    out = []
    for ref, device in devices(slices):
        for taint in device.get("taints") or []:
            if isinstance(taint, Mapping) and taint.get("key"):
                out.append(
                    DriverTaint(
                        ref,
                        str(taint["key"])[:253],
                        str(taint.get("value", ""))[:63],
                        str(taint.get("effect", "None")),
                    )
                )
    return out
