"""`gpuops bench rules`: how many GPU samples per second the matcher evaluates.
`gpuops bench storm`: what a storm of one remediation costs, batched and one run per node.

Samples follow the real H200 recording (idle, burst at the power cap, idle) with a
per-GPU phase, so conditions see realistic values and windows keep realistic state.
The rule set is the shipped telemetry rules plus variants of them (other thresholds,
every temporal form) up to the requested count, all on `telemetry`: the worst case,
since rules are indexed by kind.
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuops.act.evidence import Evidence, new_run_id
from gpuops.act.playbooks import PlaybookVersion, resolve
from gpuops.act.runner import RunRequest, run_hosts_async
from gpuops.clock import SystemClock
from gpuops.match.loader import build_rule, load_rules
from gpuops.match.matcher import Matcher
from gpuops.match.rules import Rule, RuleSet
from gpuops.match.yamlsrc import LineDict
from gpuops.models import ActionSpec, Intent, RunOutcome, RunStatus
from gpuops.settings import checkout_root
from gpuops.sim.fleet import SimFleet, h200_trace

STORM_PLAYBOOK = "drain.yml"

_VARIANTS: list[dict[str, Any]] = [
    {"when": "temp_c >= temp_slowdown_c - {k}", "for": "60s"},
    {"when": "mem_temp_c >= temp_mem_max_c - {k}", "for": "2m"},
    {"when": "power_w > power_limit_w * 0.{k}9 and util_gpu < 5", "for": "30s"},
    {"when": "bit(clocks_event_reasons, 0x8 | 0x40) and temp_c > 7{k}", "count": 3, "within": "5m"},
    {"when": "ecc_dbe_volatile > {k}"},
    {"increase": {"field": "ecc_sbe_volatile", "by": 100, "within": "1h"}},
    {"when": "sm_clock_mhz < 10{k}0 and util_gpu > 90", "for": "5m"},
    {"when": "pcie_width < pcie_max_width or pcie_gen < pcie_max_gen - {k}", "for": "5m"},
]


def bench_ruleset(n: int) -> RuleSet:
    """The shipped telemetry rules, then variants, `n` rules in all."""
    shipped = [
        r for r in load_rules([checkout_root() / "rules"], None).rules if r.on == "telemetry"
    ]
    rules: list[Rule] = shipped[:n]
    i = 0
    while len(rules) < n:
        spec = _VARIANTS[i % len(_VARIANTS)]
        raw = LineDict(
            {
                "name": f"bench-{i}",
                "on": "telemetry",
                "group_by": ["node", "gpu"],
                **{
                    k: (v.format(k=i % 9 + 1) if isinstance(v, str) and k == "when" else v)
                    for k, v in spec.items()
                },
            }
        )
        raw.line, raw.key_lines = 0, {}
        rules.append(build_rule(raw, "<bench>", None))
        i += 1
    return RuleSet(rules=tuple(rules))


def _facts(gpus: int) -> list[dict[str, Any]]:
    per_node = 8
    out = []
    for g in range(gpus):
        node, index = f"node-{g // per_node:05d}", g % per_node
        out.append(
            {
                "node": node,
                "gpu": index,
                "index": index,
                "uuid": f"GPU-{g:08x}",
                "temp_slowdown_c": 89.0,
                "temp_shutdown_c": 95.0,
                "temp_gpu_max_c": 87.0,
                "temp_mem_max_c": 95.0,
                "power_limit_w": 700.0,
                "power_default_limit_w": 700.0,
                "mem_total_bytes": 150754820096,
                "ecc_sbe_volatile": 0,
                "ecc_dbe_volatile": 0,
                "pcie_gen": 5,
                "pcie_width": 16,
                "pcie_max_gen": 5,
                "pcie_max_width": 16,
                "remap_pending": False,
                "remap_failure": False,
            }
        )
    return out


def _step(facts: list[dict[str, Any]], tick: int, trace: tuple[dict[str, Any], ...]) -> None:
    """Move every GPU one recorded sample on (each with its own phase)."""
    n = len(trace)
    for i, f in enumerate(facts):
        rec = trace[(tick + i * 7) % n]
        f["temp_c"] = rec["temp_c"]
        f["mem_temp_c"] = rec["mem_temp_c"]
        f["power_w"] = rec["power_mw"] / 1000.0
        f["sm_clock_mhz"] = rec["sm_mhz"]
        f["util_gpu"] = rec["util"]["gpu"]
        f["clocks_event_reasons"] = rec["clocks_event_reasons"]


def bench_rules(n_rules: int, gpus: int, seconds: float) -> Iterator[str]:
    """Run the matcher for `seconds` of wall time; yield report lines, the last machine-readable."""
    rules = bench_ruleset(n_rules)
    matcher = Matcher(rules)
    facts = _facts(gpus)
    trace = h200_trace()
    forms: dict[str, int] = {}
    for r in rules.rules:
        forms[r.temporal] = forms.get(r.temporal, 0) + 1
    mix = ", ".join(f"{k}={v}" for k, v in sorted(forms.items()))
    yield f"rules={len(rules.rules)} ({mix}) gpus={gpus}"
    t, tick, samples, busy = 1_800_000_000.0, 0, 0, 0.0
    per_node: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _step(facts, tick, trace)
        start = time.perf_counter()
        for k in range(0, gpus, 8):  # one node's telemetry event = 8 GPU samples
            t0 = time.perf_counter_ns()
            matcher.match_facts("telemetry", facts[k : k + 8], t, "bench")
            if tick % 4 == 0:
                per_node.append((time.perf_counter_ns() - t0) / 1000.0)
        busy += time.perf_counter() - start
        matcher.take_cleared()  # no episodes here: what cleared is not kept
        samples += gpus
        tick += 1
        t += 1.0
        if tick % 10 == 0:
            matcher.sweep(t)
    rate = samples / busy if busy else 0.0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    qs = statistics.quantiles(per_node, n=100) if len(per_node) > 1 else [0.0] * 99
    yield f"simulated seconds={tick} samples={samples} matcher busy={busy:.2f}s"
    yield (
        f"per node event (8 GPUs) latency us: p50={qs[49]:.1f} p90={qs[89]:.1f} "
        f"p99={qs[98]:.1f} max={max(per_node, default=0):.1f}"
    )
    yield f"window state keys={matcher.state_size()}"
    yield f"samples_per_s={rate:.0f} rss_mb={rss_mb:.0f}"


# --- `gpuops bench storm` --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StormFigures:
    """Wall and CPU time of some hosts' runs (CPU of this process and its children)."""

    hosts: int
    runs: int
    ok: int
    wall_s: float
    cpu_s: float
    cores: int
    own_cpu_s: float  # of it, this process's (ansible-runner's event handling, asyncio)

    @property
    def cpu_per_host(self) -> float:
        """CPU-seconds one host cost."""
        return self.cpu_s / max(1, self.hosts)

    @property
    def floor_s(self) -> float:
        """The shortest wall time this CPU allows on these cores."""
        return self.cpu_s / self.cores

    def line(self, what: str) -> str:
        """The figures as one report line."""
        return (
            f"{what}: {self.hosts} hosts in {self.runs} runs, {self.ok} successful; "
            f"wall {self.wall_s:.1f}s, cpu {self.cpu_s:.1f}s (this process {self.own_cpu_s:.1f}s), "
            f"{self.cpu_per_host:.2f} cpu-s/host, "
            f"cpu floor {self.floor_s:.1f}s on {self.cores} cores, "
            f"wall/floor {self.wall_s / max(self.floor_s, 1e-9):.2f}"
        )


@dataclass(frozen=True, slots=True)
class StormSpec:
    """How a storm is run: the executor's settings."""

    batch_size: int
    forks: int
    parallel: int
    cores: int
    evidence: Evidence


def _cpu_s() -> tuple[float, float]:
    """CPU seconds of this process, and of its children that have ended (ansible-playbook,
    its forks and the modules they ran are waited for, so their time is in it)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _storm_intent(node: str) -> Intent:
    now = time.time()
    return Intent(
        key=f"bench-{node}-{uuid.uuid4().hex[:8]}",
        rule="bench-storm",
        node=node,
        action=ActionSpec(playbook=STORM_PLAYBOOK, vars={"reason": f"bench storm on {node}"}),
        event_id=f"bench-{node}",
        event_ts=now,
        decided_at=now,
    )


async def _run_storm(
    fleet: SimFleet, hosts: list[str], version: PlaybookVersion, spec: StormSpec
) -> StormFigures:
    """Drain `hosts` as the executor would: batches of `batch_size`, `parallel` at a time."""
    clock = SystemClock()
    slots = asyncio.Semaphore(spec.parallel)
    intents = [_storm_intent(h) for h in hosts]
    batches = [intents[i : i + spec.batch_size] for i in range(0, len(intents), spec.batch_size)]

    async def one(batch: list[Intent]) -> list[RunOutcome]:
        async with slots:
            request = RunRequest.for_intents(
                batch,
                version,
                fleet.root / "inventory",
                600.0,
                forks=spec.forks,
                run_id=new_run_id(clock.now()),
                evidence=spec.evidence,
            )
            result = await run_hosts_async(request, clock)
            return [result.outcome(t) for t in request.targets]

    wall0, (own0, kids0) = time.perf_counter(), _cpu_s()
    outcomes = [o for batch in await asyncio.gather(*map(one, batches)) for o in batch]
    wall, (own, kids) = time.perf_counter() - wall0, _cpu_s()
    return StormFigures(
        hosts=len(hosts),
        runs=len(batches),
        ok=sum(o.status is RunStatus.SUCCESSFUL for o in outcomes),
        wall_s=wall,
        cpu_s=own - own0 + kids - kids0,
        cores=spec.cores,
        own_cpu_s=own - own0,
    )


def bench_storm(
    nodes: int, batch_size: int, forks: int, parallel: int, compare_nodes: int
) -> Iterator[str]:
    """Drain `nodes` simulated nodes in batches, and some one run per node; yield report lines."""
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-storm-") as tmp:
        fleet = SimFleet.create(Path(tmp) / "sim", nodes=1 + nodes + compare_nodes, gpus=1)
        books = checkout_root() / "playbooks"
        version = resolve(books, STORM_PLAYBOOK, None, Path(tmp) / "refs")
        evidence = Evidence(Path(tmp) / "runs")
        batched = StormSpec(batch_size, forks, parallel, cores, evidence)
        single = StormSpec(1, 1, parallel, cores, evidence)
        first, storm, rest = fleet.nodes[:1], fleet.nodes[1 : 1 + nodes], fleet.nodes[1 + nodes :]
        yield f"{STORM_PLAYBOOK} on simulated nodes, {cores} cores, load {os.getloadavg()[0]:.1f}"
        one = asyncio.run(_run_storm(fleet, first, version, single))
        yield f"one node: wall {one.wall_s:.2f}s, cpu {one.cpu_s:.2f}s"
        how = f"batches of {batch_size}, forks {forks}, {parallel} runs in flight"
        big = asyncio.run(_run_storm(fleet, storm, version, batched))
        yield big.line(f"storm ({how})")
        if not rest:
            yield _verdict(big, None)
            return
        old = asyncio.run(_run_storm(fleet, rest, version, single))
        yield old.line(f"one run per node ({parallel} in flight)")
        yield f"load after: {os.getloadavg()[0]:.1f}"
        yield _verdict(big, old)


def _verdict(big: StormFigures, old: StormFigures | None) -> str:
    """The machine-readable last line; the goals: >= 2x fewer cpu-s/host, wall <= 1.3x floor."""
    ratio = old.cpu_per_host / big.cpu_per_host if old and big.cpu_per_host else 0.0
    return (
        f"storm_cpu_s_per_host={big.cpu_per_host:.3f} "
        f"single_cpu_s_per_host={old.cpu_per_host if old else 0.0:.3f} "
        f"cpu_ratio={ratio:.2f} storm_wall_over_floor={big.wall_s / max(big.floor_s, 1e-9):.2f}"
    )
