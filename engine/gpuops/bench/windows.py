"""`gpuops bench windows`: what long aggregate windows cost per key, in bytes and time.

One per-GPU rule with a quantile and an average over the window (the density family's
shape) runs over `gpus` GPUs; samples are spaced so the run crosses every time bucket
of the window and wraps, which is the most state a key ever holds (the arrays are
allocated whole when the key is first seen, so a full day costs what this measures).
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

from gpuops.match.aggregates import BUCKETS
from gpuops.match.durations import format_duration, parse_duration
from gpuops.match.loader import build_rule
from gpuops.match.matcher import Matcher
from gpuops.match.rules import RuleSet
from gpuops.match.yamlsrc import LineDict


def _rss_bytes() -> int:
    """Resident memory now (not the peak), from /proc."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rule(window: str) -> RuleSet:
    raw = LineDict(
        {
            "name": "bench-underused",
            "on": "telemetry",
            "group_by": ["node", "gpu"],
            "when": f"p95(util_gpu, {window}) < 10 and avg(util_gpu, {window}) < 5",
            "for": window,
            "max_gap": "1h",
        }
    )
    raw.line, raw.key_lines = 0, {}
    return RuleSet(rules=(build_rule(raw, "<bench>", None),))


def bench_windows(gpus: int, window: str, rounds: int = 2 * BUCKETS + 1) -> Iterator[str]:
    """Feed `rounds` samples per GPU across the window; yield report lines, the last parseable."""
    span = parse_duration(window)
    step = span / (rounds - 1)
    gc.collect()
    before = _rss_bytes()
    matcher = Matcher(_rule(window))
    facts: list[dict[str, Any]] = [
        {"node": f"node-{g // 8:05d}", "gpu": g % 8, "util_gpu": 0} for g in range(gpus)
    ]
    yield f"gpus={gpus} window={format_duration(span)} rounds={rounds} step={format_duration(step)}"
    t, samples, busy = 1_800_000_000.0, 0, 0.0
    for r in range(rounds):
        for g, f in enumerate(facts):
            f["util_gpu"] = (g * 7 + r * 13) % 23  # mostly low, a spread to bin
        start = time.perf_counter()
        for k in range(0, gpus, 8):
            matcher.match_facts("telemetry", facts[k : k + 8], t, "bench")
        busy += time.perf_counter() - start
        samples += gpus
        t += step
    gc.collect()
    grown = _rss_bytes() - before
    keys = max(1, matcher.state_size())
    arrays = matcher.aggregate_bytes()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    yield f"keys={keys} (windows and `for` runs) samples={samples} busy={busy:.2f}s"
    yield f"window arrays: {arrays / gpus:.0f} bytes per GPU ({arrays / 2**20:.1f} MiB in all)"
    yield f"RSS grew {grown / 2**20:.1f} MiB: {grown / gpus:.0f} bytes per GPU (objects included)"
    yield (
        f"state_bytes_per_gpu={grown / gpus:.0f} rss_mb={_rss_bytes() / 2**20:.0f} "
        f"peak_rss_mb={peak_mb:.0f} samples_per_s={samples / busy if busy else 0:.0f}"
    )
