"""`gpuops bench rulebook`: gpuops replay and ansible-rulebook 1.3.2 side by side, on the
same GPU samples and the same 1 and N rules, CPU per sample of each and the ratio.

The samples are a recording of the simulated H200 fleet (`bench replay`'s). gpuops
replays it as `gpuops replay` does (the live engine's code, the site's default
settings), once as v2 JSON lines and once as v1; ansible-rulebook reads the same
samples as one JSON event per GPU sample from a file source (a source plugin this bench
writes), with `match_multiple_rules` on. The rules are threshold conditions both can
say the same way (`temp_c > 92` and `event.temp_c > 92`), rarely true, so both sides
spend their time evaluating, not acting (gpuops decides each match through its safety
stages; ansible-rulebook's action is `none`).

ansible-rulebook is installed once into its own virtual environment (`--venv`, by
default under ~/.cache/gpuops), with ansible-core for its collection lookups; it needs
Java 17 on PATH. Its CPU is the child process's (the JVM runs in it, through jpy), net
of a run with no samples (JVM start, rulebook compile); both figures are printed. A
short run with `print_event` first checks that it matches what gpuops matches.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuops.bench.replay import record
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import from_rfc3339
from gpuops.errors import ConfigError
from gpuops.match.loader import build_rule
from gpuops.match.rules import RuleSet
from gpuops.match.yamlsrc import LineDict
from gpuops.settings import Settings
from gpuops.spine.heap import settle_heap
from gpuops.spine.replay import replay

VERSION = "1.3.2"
DEFAULT_VENV = Path.home() / ".cache" / "gpuops" / f"bench-rulebook-{VERSION}"
CHECK_SAMPLES = 2000

# (field, thresholds): conditions both engines say alike, on readings every simulated
# GPU reports; the thresholds sit above what the recording reaches, but the first.
_CONDITIONS: list[tuple[str, tuple[float, float]]] = [
    ("temp_c", (57, 80)),  # the first rule fires on about 1% of the samples (bursts)
    ("mem_temp_c", (85, 95)),
    ("power_w", (700, 720)),
    ("util_gpu", (100, 101)),
    ("util_mem", (95, 99)),
    ("sm_clock_mhz", (1980, 2000)),
    ("mem_clock_mhz", (3300, 3400)),
    ("ecc_dbe_volatile", (0, 1)),
    ("pcie_replay", (100, 1000)),
    ("remapped_rows_uncorrected", (0, 1)),
]

_SOURCE = '''"""One JSON event per line of a file, then an end marker."""
import asyncio
import json


async def main(queue, args):
    with open(args["path"], "rb") as lines:
        for n, line in enumerate(lines):
            await queue.put(json.loads(line))
            if n % 1000 == 999:
                await asyncio.sleep(0)
    await queue.put({"bench_end": True})
'''


@dataclass(frozen=True, slots=True)
class Condition:
    """One rule as both engines write it."""

    name: str
    field: str
    threshold: float

    def gpuops(self) -> str:
        return f"{self.field} > {self.threshold:g}"

    def rulebook(self) -> str:
        return f"event.{self.field} > {self.threshold:g}"


def conditions(n: int) -> list[Condition]:
    """The first `n` rules (at most twice the table)."""
    table = [(f, t) for i in range(2) for f, pair in _CONDITIONS for t in (pair[i],)]
    if n > len(table):
        raise ConfigError(f"--rules {n}: this bench has {len(table)} rules both engines share")
    return [Condition(f"bench-{i}", f, t) for i, (f, t) in enumerate(table[:n])]


def gpuops_rules(conds: list[Condition]) -> RuleSet:
    """The conditions as gpuops rules (one fact per GPU, no window: as the rulebook's)."""
    rules = []
    for c in conds:
        raw = LineDict({"name": c.name, "on": "telemetry", "when": c.gpuops()})
        raw.line, raw.key_lines = 0, {}
        rules.append(build_rule(raw, "<bench>", None))
    return RuleSet(rules=tuple(rules))


def rulebook_yaml(conds: list[Condition], events: Path, action: str = "none") -> str:
    """An ansible-rulebook rulebook of the conditions on a file of events."""
    doc = [
        {
            "name": "bench",
            "hosts": "all",
            "match_multiple_rules": True,
            "sources": [{"jsonl": {"path": str(events)}}],
            "rules": [
                *(
                    {"name": c.name, "condition": c.rulebook(), "action": {action: {}}}
                    for c in conds
                ),
                {
                    "name": "bench-end",
                    "condition": "event.bench_end == true",
                    "action": {"shutdown": {"delay": 0}},
                },
            ],
        }
    ]
    return json.dumps(doc, indent=1)  # JSON is YAML


# --- ansible-rulebook ----------------------------------------------------------------


def ensure_rulebook(venv: Path) -> Path:
    """The ansible-rulebook executable of `venv`, installed there the first time."""
    exe = venv / "bin" / "ansible-rulebook"
    if exe.exists():
        return exe
    if shutil.which("java") is None:
        raise ConfigError("ansible-rulebook needs Java 17 on PATH (its rule engine is Drools)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    done = subprocess.run(
        [*pip, f"ansible-rulebook=={VERSION}", "ansible-core>=2.17,<2.20"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        shutil.rmtree(venv, ignore_errors=True)
        raise ConfigError(f"installing ansible-rulebook {VERSION} failed:\n{done.stderr[-2000:]}")
    return exe


@dataclass(frozen=True, slots=True)
class Rulebook:
    """How to run ansible-rulebook on one work directory."""

    exe: Path
    work: Path

    def run(self, conds: list[Condition], events: Path, action: str = "none") -> tuple[float, str]:
        """CPU seconds of one run (the child's user + system) and what it printed."""
        book = self.work / f"rulebook-{len(conds)}-{action}.yml"
        book.write_text(rulebook_yaml(conds, events, action))
        env = {**os.environ, "PATH": f"{self.exe.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        argv = [
            str(self.exe),
            "-r",
            str(book),
            "-i",
            str(self._inventory()),
            "-S",
            str(self._src()),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise ConfigError(
                f"ansible-rulebook failed ({done.returncode}):\n{done.stderr[-2000:]}"
            )
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return cpu, done.stdout

    def _src(self) -> Path:
        src = self.work / "sources"
        src.mkdir(exist_ok=True)
        (src / "jsonl.py").write_text(_SOURCE)
        return src

    def _inventory(self) -> Path:
        path = self.work / "inventory.yml"
        path.write_text("all:\n  hosts:\n    localhost: {}\n")
        return path


# --- the samples ---------------------------------------------------------------------


def samples(recording: Path, out_v2: Path, out_events: Path | None = None) -> int:
    """Write the recording as v2 JSON lines and (given `out_events`) as one rulebook event
    per GPU sample; how many GPU samples it holds."""
    writer = TelemetryWriter("sim", json=True)
    n = 0
    with out_v2.open("wb") as v2, contextlib.ExitStack() as held:
        flat = None if out_events is None else held.enter_context(out_events.open("w"))
        for line in recording.open("rb"):
            event = json.loads(line)
            t = from_rfc3339(event["ts"])
            gpus = event["data"]["gpus"]
            v2.write(writer.encode(event["node"], t, gpus, event["id"]) + b"\n")
            n += len(gpus)
            if flat is None:
                continue
            for gpu in gpus:
                fact = {k: v for k, v in gpu.items() if v is not None}
                flat.write(json.dumps({"node": event["node"], "gpu": gpu["index"], **fact}) + "\n")
    return n


def _replay_cpu(path: Path, rules: RuleSet) -> tuple[float, int]:
    """CPU seconds of one `gpuops replay` and the matches it made."""
    settings = Settings(safety={"stale_after_s": float("inf")})  # type: ignore[arg-type]
    settle_heap()  # as `gpuops replay` does before its replay
    cpu = time.process_time()
    _, report = asyncio.run(replay(path, rules, None, settings))
    return time.process_time() - cpu, sum(report.by_reason.values())


def bench_rulebook(gpus: int, rule_counts: list[int], repeat: int, venv: Path) -> Iterator[str]:
    """Figures, one line each."""
    exe = ensure_rulebook(venv)
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-rulebook-") as held:
        work = Path(held)
        recording, _, _ = record(work, gpus)
        v2, flat = work / "v2.jsonl", work / "events.jsonl"
        n = samples(recording, v2, flat)
        yield (
            f"samples: {n:,} GPU samples ({recording.stat().st_size / n:.0f} bytes each as v1, "
            f"{v2.stat().st_size / n:.0f} as v2 JSON lines); ansible-rulebook {VERSION} from {venv}"
        )
        rb = Rulebook(exe, work)
        yield from _check(rb, work, flat, v2, max(rule_counts))
        empty = work / "empty.jsonl"
        empty.write_text("")
        runs: dict[tuple[str, int], list[float]] = {}
        for _ in range(repeat):
            for k in rule_counts:
                conds = conditions(k)
                rules = gpuops_rules(conds)
                runs.setdefault(("v2", k), []).append(_replay_cpu(v2, rules)[0])
                runs.setdefault(("v1", k), []).append(_replay_cpu(recording, rules)[0])
                runs.setdefault(("rb", k), []).append(rb.run(conds, flat)[0])
                runs.setdefault(("rb0", k), []).append(rb.run(conds, empty)[0])
        for k in rule_counts:
            med = {side: statistics.median(runs[(side, k)]) for side in ("v2", "v1", "rb", "rb0")}
            net = max(med["rb"] - med["rb0"], 1e-9)
            yield (
                f"{k} rule{'s' if k > 1 else ''}: gpuops replay {med['v2'] / n * 1e6:.1f} us a "
                f"sample as v2 ({n / med['v2']:,.0f}/CPU-s), {med['v1'] / n * 1e6:.1f} us as v1; "
                f"ansible-rulebook {net / n * 1e6:.1f} us net ({n / net:,.0f}/CPU-s; "
                f"{med['rb'] / n * 1e6:.1f} us with its {med['rb0']:.1f} s start) "
                f"-> gpuops {net / med['v2']:.1f}x per CPU-second (v1 {net / med['v1']:.1f}x); "
                f"median of {repeat}"
            )


def _expected(lines: list[str], conds: list[Condition]) -> int:
    """Matches the conditions make on these samples, counted directly."""
    out = 0
    for line in lines:
        fact: dict[str, Any] = json.loads(line)
        out += sum(1 for c in conds if fact.get(c.field, float("-inf")) > c.threshold)
    return out


def _check(rb: Rulebook, work: Path, flat: Path, v2: Path, k: int) -> Iterator[str]:
    """Both engines match what the conditions say (else the figures compare nothing):
    gpuops on the whole recording, ansible-rulebook on its first samples."""
    conds = conditions(k)
    lines = flat.read_text().splitlines(keepends=True)
    everything = _expected(lines, conds)
    _, decided = _replay_cpu(v2, gpuops_rules(conds))
    head = work / "check.jsonl"
    head.write_text("".join(lines[:CHECK_SAMPLES]))
    expected = _expected(lines[:CHECK_SAMPLES], conds)
    _, printed = rb.run(conds, head, "print_event")
    got = sum(1 for line in printed.splitlines() if "'node'" in line or '"node"' in line)
    if got != expected or decided != everything:
        raise ConfigError(
            f"the conditions match {everything} times ({expected} on the first "
            f"{CHECK_SAMPLES}); gpuops decided {decided}, ansible-rulebook matched {got}: "
            "the comparison would not be like for like"
        )
    yield (
        f"check: gpuops decides each of the {everything} matches; ansible-rulebook matches "
        f"{got} of the first {CHECK_SAMPLES:,} samples as the conditions say ({k} rules)"
    )
