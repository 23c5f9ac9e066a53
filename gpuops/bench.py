"""`gpuops bench rules`: how many GPU samples per second the matcher evaluates.

Samples follow the real H200 recording (idle, burst at the power cap, idle) with a
per-GPU phase, so conditions see realistic values and windows keep realistic state.
The rule set is the shipped telemetry rules plus variants of them (other thresholds,
every temporal form) up to the requested count, all on `telemetry`: the worst case,
since rules are indexed by kind.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Iterator
from typing import Any

from gpuops.match.loader import build_rule, load_rules
from gpuops.match.matcher import Matcher
from gpuops.match.rules import Rule, RuleSet
from gpuops.match.yamlsrc import LineDict
from gpuops.settings import checkout_root
from gpuops.sim.fleet import h200_trace

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
