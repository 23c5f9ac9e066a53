"""`gpuops test-rules`: rule tests as YAML, run through the shadow pipeline.

A test file:

    cases:
      - name: sustained heat drains the node
        events:
          - {at: 0s, kind: telemetry, node: node-001, gpus: [{index: 3, temp_c: 88}],
             repeat: {every: 5s, until: 70s}}
          - {at: 100s, kind: xid, node: node-001, data: {gpu: 1, xid: 79}}
          - {at: 300s, tick: true}          # let silence (absent rules) count
        expect:
          - {rule: gpu-overheat, node: node-001, gpu: 3, action: drain.yml}
        forbid:
          - {rule: power-limit-below-policy}

Telemetry GPUs are laid over a healthy idle H200 sample, so a case names only what
differs. `expect` items may carry `count` (exact number of would-be actions).

A day of samples stays short: a repeated step may `cycle` fields through a list, the
n-th event taking the n-th value (wrapping), e.g. one busy sample in 24:
`repeat: {every: 5m, until: 25h}, cycle: {util_gpu: [60, 2, 3, ...]}`. A case may give
`hosts: {node: {var: value}}`, the inventory variables rules grouped by a host variable
(`group_by: [rack]`) or reading one (`budget_w`) see.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuops.clock import rfc3339
from gpuops.errors import RuleError
from gpuops.inventory.hosts import Inventory
from gpuops.match.durations import parse_duration
from gpuops.match.rules import RuleSet
from gpuops.models import EVENT_ADAPTER
from gpuops.settings import Settings
from gpuops.spine.shadow import Shadow, WouldRun, would_run

T0 = 1_800_000_000.0


@dataclass
class CaseResult:
    """The outcome of one case."""

    file: str
    name: str
    failures: list[str] = field(default_factory=list)
    actions: list[WouldRun] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every expectation held."""
        return not self.failures


def healthy_gpu(index: int) -> dict[str, Any]:
    """An idle H200 as the recording shows it, to lay a case's fields over."""
    from gpuops.sim.fleet import h200_snapshot

    dev = h200_snapshot()["devices"][0]
    th = dev["temp_thresholds"]
    return {
        "index": index,
        "uuid": f"{dev['uuid']}-{index}",
        "temp_c": dev["temperature_gpu"],
        "mem_temp_c": 37,
        "temp_slowdown_c": th["gpu_slowdown"],
        "temp_shutdown_c": th["gpu_shutdown"],
        "temp_gpu_max_c": th["gpu_max"],
        "temp_mem_max_c": th["mem_max"],
        "power_w": dev["power_usage_mw"] / 1000,
        "power_limit_w": dev["power_limit_mw"] / 1000,
        "power_default_limit_w": dev["power_limit_default_mw"] / 1000,
        "power_min_limit_w": dev["power_limit_constraints_mw"][0] / 1000,
        "power_max_limit_w": dev["power_limit_constraints_mw"][1] / 1000,
        "sm_clock_mhz": dev["clock_sm"],
        "util_gpu": 0,
        "util_mem": 0,
        "mem_used_bytes": dev["memory"]["used"],
        "mem_total_bytes": dev["memory"]["total"],
        "clocks_event_reasons": dev["clocks_event_reasons"],
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "pcie_gen": dev["pcie_gen"],
        "pcie_width": dev["pcie_width"],
        "pcie_max_gen": dev["pcie_max_gen"],
        "pcie_max_width": dev["pcie_max_width"],
        "remap_pending": False,
        "remap_failure": False,
        "persistence_mode": True,
    }


def _expand(step: dict[str, Any]) -> list[tuple[float, dict[str, Any] | None]]:
    """One step of a case as (offset, event or None for a tick), repeats unrolled."""
    at = parse_duration(step.get("at", 0))
    if step.get("tick"):
        return [(at, None)]
    times = [at]
    if "repeat" in step:
        every = parse_duration(step["repeat"]["every"])
        until = parse_duration(step["repeat"]["until"])
        n = int((until - at) / every)
        times = [at + i * every for i in range(n + 1)]
    cycle = step.get("cycle") or {}
    return [(t, case_event(step, t, _cycled(cycle, i))) for i, t in enumerate(times)]


def _cycled(cycle: dict[str, list[Any]], i: int) -> dict[str, Any]:
    """The `i`-th event's values of the cycled fields."""
    return {name: values[i % len(values)] for name, values in cycle.items()}


def case_event(
    step: dict[str, Any], offset: float, cycled: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The event a rule-test step describes, `offset` seconds after T0; `cycled` values
    go over every GPU (telemetry) or into the data (other kinds)."""
    kind = step["kind"]
    data = {**step.get("data", {}), **(cycled or {})}
    if kind == "telemetry":
        gpus = step.get("gpus", [{"index": 0}])
        data = {"gpus": [{**healthy_gpu(g["index"]), **g, **(cycled or {})} for g in gpus]}
    return {
        "id": str(uuid.uuid4()),
        "kind": kind,
        "node": step["node"],
        "ts": rfc3339(T0 + offset),
        "source": "test-rules",
        "data": data,
    }


def _matches(action: WouldRun, want: dict[str, Any]) -> bool:
    def same(key: str, value: Any) -> bool:
        got = getattr(action, key)
        return tuple(got) == tuple(value) if isinstance(value, list) else bool(got == value)

    return all(same(k, v) for k, v in want.items() if k != "count")


async def run_case(
    file: str,
    case: dict[str, Any],
    rules: RuleSet,
    settings: Settings | None = None,
    inventory: Inventory | None = None,
) -> CaseResult:
    """Feed a case's events through the shadow pipeline, under the site's settings (its
    breaker, cooldowns' stores, attempt cap, stale cutoff) and over its `inventory` (the
    fleet the breaker counts, its racks and power groups, with the case's `hosts:`
    variables laid on), and check its expectations. A case's `nodes:` is a made-up fleet
    of its own, the inventory left out."""
    result = CaseResult(file=file, name=str(case.get("name", "unnamed")))
    steps = sorted((p for s in case.get("events", []) for p in _expand(s)), key=lambda p: p[0])
    hosts = case.get("hosts") or {}
    named = {e["node"] for _, e in steps if e is not None} | set(hosts)
    if case.get("nodes") or inventory is None:
        shadow = Shadow(rules, case.get("nodes") or sorted(named), settings, hostvars=hosts)
    else:
        hostvars = {**inventory.hostvars}
        for host, more in hosts.items():
            hostvars[host] = {**hostvars.get(host, {}), **more}
        shadow = Shadow(
            rules, inventory.hosts | named, settings, hostvars=hostvars, groups=inventory.groups
        )
    for offset, raw in steps:
        if raw is None:
            decisions = await shadow.advance(T0 + offset)
        else:
            decisions = await shadow.feed(EVENT_ADAPTER.validate_python(raw))
        result.actions += [a for d in decisions for a in would_run(d)]
    for want in case.get("expect", []):
        found = [a for a in result.actions if _matches(a, want)]
        if not found or ("count" in want and len(found) != want["count"]):
            seen = sorted({f"{a.rule}:{a.action}" for a in result.actions}) or ["nothing"]
            result.failures.append(
                f"expected {want}, got {len(found)} matching (would run: {', '.join(seen)})"
            )
    for bad in case.get("forbid", []):
        found = [a for a in result.actions if _matches(a, bad)]
        if found:
            first = found[0]
            result.failures.append(
                f"forbidden {bad} happened {len(found)}x (first: {first.rule} {first.action} "
                f"on {first.node} at +{first.ts - T0:.0f}s)"
            )
    return result


def load_cases(path: Path) -> list[dict[str, Any]]:
    """The cases of one rule test file."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise RuleError(f"cannot read rule test: {exc}", file=str(path)) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        raise RuleError("a rule test file has a 'cases' list", file=str(path), line=1)
    return list(doc["cases"])


async def run_cases(
    file: str,
    cases: list[dict[str, Any]],
    rules: RuleSet,
    settings: Settings | None = None,
    inventory: Inventory | None = None,
) -> list[CaseResult]:
    """Every case of one test file; a malformed case fails with what is wrong."""
    results = []
    for case in cases:
        try:
            results.append(await run_case(file, case, rules, settings, inventory))
        except (KeyError, ValueError, TypeError) as exc:
            results.append(CaseResult(file, str(case.get("name", "?")), [f"bad case: {exc}"]))
    return results
