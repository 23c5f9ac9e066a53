"""Drift checks: `baseline.yml` in check and diff mode over a group, in batches, with forks.

The playbook reports what differs in task results that carry `gpuops_drift` (a list
of {setting, expected, actual, gpu}); task names are for people and are not read. Each
difference becomes a `drift` event; an unreachable host becomes an `unreachable` event;
a host with no drift gets a clean record, so "last checked" is known for every host.

The same run reads where each GPU sits and how its PCIe link trained (`gpuops_topology`);
with the site's manifests (gpuops.diagnose.topology.Manifests, `drift.topology_dir`) each
host is held to its SKU's, by the agent's own comparison, and each difference is a
`topology` event the topology rules act on: a node whose agent is down or was never
given its manifest is checked all the same.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuops.act.playbooks import resolve
from gpuops.act.runenv import RunEnv
from gpuops.act.runner import RunRequest, run_async
from gpuops.bus.publish import Publisher
from gpuops.catalog import Role, load_catalog
from gpuops.clock import Clock
from gpuops.diagnose.topology import Manifests, Topology, differences, from_readings
from gpuops.inventory.hosts import Inventory
from gpuops.models import RunStatus, new_event, subject_for

log = logging.getLogger(__name__)

# The key under which baseline.yml's report tasks put what differs.
DRIFT_KEY = "gpuops_drift"
TOPOLOGY_KEY = "gpuops_topology"  # and where each GPU sits (raw readings)
MAX_READINGS = 64  # rows of each reading kept per host: a node's GPUs, not a runaway tool


@dataclass
class HostDrift:
    """What one host's check found."""

    host: str
    drifts: list[dict[str, Any]] = field(default_factory=list)
    unreachable: str | None = None
    failed: str | None = None
    readings: dict[str, list[str]] | None = None  # `gpuops_topology`: links, numa
    topology: list[dict[str, Any]] = field(default_factory=list)  # its manifest's differences


@dataclass
class DriftReport:
    """One drift check over a group."""

    group: str
    started: float
    ended: float = 0.0
    hosts: dict[str, HostDrift] = field(default_factory=dict)

    @property
    def drifted(self) -> list[str]:
        """Hosts with at least one drifted setting or topology difference."""
        return sorted(h for h, d in self.hosts.items() if d.drifts or d.topology)

    @property
    def unreachable(self) -> list[str]:
        """Hosts the check could not reach."""
        return sorted(h for h, d in self.hosts.items() if d.unreachable)

    def state_of(self, host: str) -> str:
        """clean, drift, unreachable or failed: every checked host gets one."""
        r = self.hosts[host]
        return (
            "unreachable"
            if r.unreachable
            else "failed"
            if r.failed
            else "drift"
            if r.drifts or r.topology
            else "clean"
        )

    def summary(self) -> dict[str, Any]:
        """The audit record's body: counts, and each host's result (its 'last checked')."""
        return {
            "group": self.group,
            "hosts_checked": len(self.hosts),
            "drifted": self.drifted,
            "unreachable": self.unreachable,
            "duration_s": round(self.ended - self.started, 2),
            "checked_at": self.ended,
            "hosts": {h: self.state_of(h) for h in sorted(self.hosts)},
            "settings": {
                h: sorted({d["setting"] for d in r.drifts})
                for h, r in self.hosts.items()
                if r.drifts
            },
            "topology": {
                h: sorted({d["check"] for d in r.topology})
                for h, r in self.hosts.items()
                if r.topology
            },
        }

    def line(self) -> str:
        """One line for the audit trail and replies."""
        return (
            f"drift check of {self.group}: {len(self.hosts)} hosts, {len(self.drifted)} drifted, "
            f"{len(self.unreachable)} unreachable"
        )

    def events(self, source: str = "drift-check") -> list[dict[str, Any]]:
        """The drift and unreachable events this check produced."""
        out = []
        for host, result in sorted(self.hosts.items()):
            out += [new_event("drift", host, self.ended, drift, source) for drift in result.drifts]
            out += [new_event("topology", host, self.ended, d, source) for d in result.topology]
            if result.unreachable:
                error = {"error": result.unreachable, "check": "drift"}
                out.append(new_event("unreachable", host, self.ended, error, source))
        return out


def _collector(report: DriftReport) -> Callable[[dict[str, Any]], None]:
    def on_event(event: dict[str, Any]) -> None:
        data = event.get("event_data", {})
        host = data.get("host")
        if not host:
            return
        result = report.hosts.setdefault(host, HostDrift(host))
        kind = event.get("event")
        if kind == "runner_on_unreachable":
            result.unreachable = str(data.get("res", {}).get("msg", "unreachable"))[:300]
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            result.failed = str(data.get("res", {}).get("msg", "failed"))[:300]
        elif kind in ("runner_on_ok", "runner_item_on_ok"):
            for found in drift_records(data.get("res")):
                if found not in result.drifts:
                    result.drifts.append(found)
            readings = topology_readings(data.get("res"))
            if readings is not None:
                result.readings = readings

    return on_event


def drift_records(res: Any) -> list[dict[str, Any]]:
    """The differences a task result reports under `msg.gpuops_drift`; none for any other."""
    msg = res.get("msg") if isinstance(res, dict) else None
    found = msg.get(DRIFT_KEY) if isinstance(msg, dict) else None
    if not isinstance(found, list):
        return []
    out = []
    for item in found:
        if isinstance(item, dict) and item.get("setting"):
            gpu = item.get("gpu")
            out.append(
                {
                    "setting": str(item["setting"]),
                    "expected": item.get("expected"),
                    "actual": item.get("actual"),
                    "gpu": int(gpu) if gpu not in (None, "") else None,
                }
            )
    return out


def topology_readings(res: Any) -> dict[str, list[str]] | None:
    """The raw readings a task result reports under `msg.gpuops_topology` (None for any
    other result), each list cut to MAX_READINGS lines of text."""
    msg = res.get("msg") if isinstance(res, dict) else None
    found = msg.get(TOPOLOGY_KEY) if isinstance(msg, dict) else None
    if not isinstance(found, dict):
        return None
    out = {}
    for name in ("links", "numa"):
        lines = found.get(name)
        out[name] = [str(x)[:300] for x in lines[:MAX_READINGS]] if isinstance(lines, list) else []
    return out


def compare_topology(report: DriftReport, inventory: Inventory, manifests: Manifests) -> None:
    """Each host that reported its GPUs' places, held to its SKU's manifest."""
    for host, result in report.hosts.items():
        sku = str(inventory.hostvars.get(host, {}).get("gpu_sku") or "")
        want = manifests.for_host(host, sku)
        if want is None or result.readings is None:
            continue
        seen, util = from_readings(result.readings["links"], result.readings["numa"])
        # GPUs only: the check reads no HCA, so the manifest's HCAs are the agent's to judge.
        gpus = Topology(gpus=want.gpus)
        result.topology = [d.model_dump(mode="json") for d in differences(gpus, seen, util)]


async def drift_check(
    inventory: Inventory,
    playbooks_dir: Path,
    clock: Clock,
    *,
    group: str = "all",
    batch_size: int = 50,
    forks: int = 10,
    timeout_s: float = 900.0,
    progress: Callable[[int, int], None] | None = None,
    env: RunEnv | None = None,
    manifests: Manifests | None = None,
) -> DriftReport:
    """Run the check over `group` batch by batch; every host of the group gets a result,
    held to its topology manifest too when `manifests` has its SKU's."""
    hosts = sorted(inventory.group_hosts(group))
    report = DriftReport(group=group, started=clock.now())
    playbook = load_catalog(playbooks_dir).for_role(Role.BASELINE)
    version = resolve(playbooks_dir, playbook, None, playbooks_dir)
    for i in range(0, len(hosts), batch_size):
        batch = hosts[i : i + batch_size]
        for host in batch:
            report.hosts[host] = HostDrift(host)
        request = RunRequest(
            key=f"drift-check-{uuid.uuid4().hex[:12]}",
            rule="drift-check",
            node=",".join(batch),
            playbook=version,
            playbook_name=playbook,
            inventory=inventory.path,
            timeout_s=timeout_s,
            limit=",".join(batch),
            check_mode=True,
            forks=forks,
            on_event=_collector(report),
            env=env or RunEnv(),
        )
        outcome = await run_async(request, clock)
        if outcome.status in (RunStatus.ERROR, RunStatus.TIMEOUT, RunStatus.CANCELED):
            for host in batch:
                report.hosts[host].failed = (
                    report.hosts[host].failed or f"check {outcome.status.value}"
                )
        if progress is not None:
            progress(min(i + batch_size, len(hosts)), len(hosts))
    if manifests is not None:
        compare_topology(report, inventory, manifests)
    report.ended = clock.now()
    return report


async def publish_report(publisher: Publisher, report: DriftReport) -> int:
    """Put the check's drift and unreachable events on the bus (deduplicated by id);
    `publisher` is the engine's, whose signature says they are its own."""
    events = report.events()
    for event in events:
        subject = subject_for(event["kind"], event["node"])
        await publisher.publish(subject, json.dumps(event).encode(), event["id"])
    return len(events)


def render_report(report: DriftReport) -> str:
    """A table of hosts x drifted settings, as text."""
    lines = [
        f"drift check of {report.group}: {len(report.hosts)} hosts, {len(report.drifted)} drifted, "
        f"{len(report.unreachable)} unreachable, {report.ended - report.started:.1f}s"
    ]
    for host in report.drifted:
        settings = ", ".join(
            f"{d['setting']}"
            + (f"[gpu {d['gpu']}]" if d.get("gpu") is not None else "")
            + f" {d['actual']}!={d['expected']}"
            for d in report.hosts[host].drifts
        )
        places = ", ".join(
            f"topology {d['check']}"
            + (f"[gpu {d['gpu']}]" if d.get("gpu") is not None else "")
            + (f"[{d['device']}]" if d.get("device") else "")
            + f" {d['actual']}!={d['expected']}"
            for d in report.hosts[host].topology
        )
        lines.append(f"  {host}: {', '.join(p for p in (settings, places) if p)}")
    for host in report.unreachable:
        lines.append(f"  {host}: unreachable ({report.hosts[host].unreachable})")
    return "\n".join(lines)
