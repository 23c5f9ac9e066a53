"""The DRA driver's own health taints as events: `gpuops ingest dra` lists the cluster's
ResourceSlices (the official Kubernetes client, in-cluster or a kubeconfig; or a
`kubectl get resourceslices -o json` file) every interval and publishes one `dra_taint`
event per tainted device, about the inventory host whose node publishes it, with the GPU's
index and NVML UUID. A slice names its Kubernetes node; the host is the one whose
`k8s_node_name` (else its own name, as the playbooks read it) is that node. A slice of a
node no host is, is counted and skipped: its events would be refused anyway.

gpuops's own fences (key gpuops.dev/fenced) are DeviceTaintRules, not slice taints, so
they never come back here as the driver's word.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuops.bus.publish import Publisher
from gpuops.clock import Clock, rfc3339
from gpuops.errors import SourceError
from gpuops.fence.dra import TAINT_KEY, driver_taints
from gpuops.inventory.hosts import Inventory, k8s_nodes
from gpuops.models import EVENT_ADAPTER, subject_for

log = logging.getLogger(__name__)
SOURCE = "dra"
MAX_SLICES_BYTES = 64 << 20  # a file larger than this is refused
MAX_SLICES = 100_000  # slices read from the API at most (one a node and driver, in practice)


def taint_events(
    slices: Mapping[str, Any], hosts: Mapping[str, str], at: float
) -> tuple[list[dict[str, Any]], set[str]]:
    """The events of every driver taint on a known node's device, each about the inventory
    host that is the node (`hosts`: Kubernetes node name to host, k8s_nodes), and the
    Kubernetes nodes no host is."""
    out, unknown = [], set()
    for t in driver_taints(slices):
        if t.key == TAINT_KEY or t.ref.index is None or t.ref.index < 0:
            continue  # gpuops's own fence, or a device that is no indexed GPU
        host = hosts.get(t.ref.node)
        if host is None:
            unknown.add(t.ref.node or "(no node)")
            continue
        data: dict[str, Any] = {
            "gpu": t.ref.index,
            "uuid": t.ref.uuid,
            "driver": t.ref.driver,
            "pool": t.ref.pool,
            "device": t.ref.device,
            "key": t.key,
            "value": t.value,
            "effect": t.effect,
        }
        key = hashlib.sha256(f"{host}\0{t.ref.device}\0{t.key}".encode()).hexdigest()
        event = {
            "id": f"{SOURCE}-{key[:32]}-{int(at)}",
            "node": host,
            "ts": rfc3339(at),
            "source": f"{SOURCE}:{t.ref.driver}"[:200],
            "kind": "dra_taint",
            "data": data,
        }
        try:
            EVENT_ADAPTER.validate_python(event)
        except ValidationError as exc:  # one odd device costs its own event, not the poll's
            log.warning("DRA taint on %s %s not published: %s", t.ref.node, t.ref.device, exc)
            continue
        out.append(event)
    return out, unknown


def slices_from_file(path: Path) -> dict[str, Any]:
    """A ResourceSliceList dumped by `kubectl get resourceslices -o json`."""
    if path.stat().st_size > MAX_SLICES_BYTES:
        raise SourceError("too_large", f"{path}: over {MAX_SLICES_BYTES} bytes")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SourceError("garbage", f"{path}: {exc}") from None
    if not isinstance(doc, dict):
        raise SourceError("garbage", f"{path}: not a ResourceSliceList")
    return doc


def slices_from_api() -> dict[str, Any]:
    """Every ResourceSlice of the cluster (in-cluster credentials, else the kubeconfig)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    api, items, token = client.ResourceV1Api(), [], None
    while True:  # pages of 500, each within 30 s: a stuck API server costs one poll
        page = api.list_resource_slice(limit=500, _continue=token, _request_timeout=(5, 30))
        items += page.items or []
        token = page.metadata._continue if page.metadata is not None else None
        if not token or len(items) > MAX_SLICES:
            break
    listed = {"items": items[:MAX_SLICES]}
    out: dict[str, Any] = client.ApiClient().sanitize_for_serialization(listed)  # type: ignore[no-untyped-call]
    return out


class DraSource:
    """Lists the slices each interval; publishes their driver taints."""

    def __init__(
        self,
        inventory: Inventory,
        publisher: Publisher,
        clock: Clock,
        read: Callable[[], dict[str, Any]],
        interval_s: float = 30.0,
    ) -> None:
        self.inventory, self.publisher, self.clock = inventory, publisher, clock
        self.read, self.interval_s = read, interval_s
        self.hosts = k8s_nodes(inventory)  # once: a clash refuses the source at its start
        self.unknown: set[str] = set()

    async def poll_once(self) -> list[dict[str, Any]]:
        """One listing's events, published."""
        slices = await asyncio.to_thread(self.read)
        events, self.unknown = taint_events(slices, self.hosts, self.clock.now())
        if self.unknown:
            log.warning("DRA taints on nodes outside the inventory: %s", sorted(self.unknown))
        for e in events:
            payload = json.dumps(e, separators=(",", ":")).encode()
            await self.publisher.publish(subject_for("dra_taint", e["node"]), payload, e["id"])
        return events

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop`; the API or NATS away costs that poll, never the loop."""
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception as exc:  # the API server or the bus away: the next poll
                log.warning("DRA taints not read or not published: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
