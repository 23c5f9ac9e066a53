"""`gpuops bench fleet` at a tiny size, for real: a 3-server NATS cluster, one engine
replica as a process, a publisher process. Its figures must add up: every sample the
publisher sent was stored and handled, and every injected probe failure has an intent
whose latency was measured. The replicas' logs outlive the work directory when asked."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.bench.fleet import FleetSpec, bench_fleet

pytestmark = pytest.mark.integration


@pytest.mark.slow  # a fleet round: servers, replicas, an executor: `make test-slow`
def test_a_tiny_round_counts_every_published_sample_and_times_every_probe_failure(
    tmp_path: Path,
) -> None:
    spec = FleetSpec(nodes=20, gpus=8, replicas=(1,), seconds=5, warmup=2, health=5, every=2.0)
    lines: list[str] = []
    kept, work = tmp_path / "logs", tmp_path / "work"
    work.mkdir()
    [f] = bench_fleet(spec, lines.append, workdir=work, keep_logs=kept)

    assert f.published + f.missed == f.offered == 20 * 5
    assert f.published_total > 0
    assert f.stored == f.published_total, "the stream took every sample sent"
    assert f.handled_total == f.published_total, "the replica handled every sample sent"
    assert (f.pending_end, f.lost) == (0, 0)
    assert f.samples_per_s > 0 and f.rss_mb[0] > 0 and f.cpu_cores[0] > 0
    assert f.health_sent == 5
    assert len(f.latencies_ms) == 5, "every probe failure became an intent"
    assert all(0 < ms < 60_000 for ms in f.latencies_ms)
    assert any(line.startswith("replicas=1 cores=") for line in lines)
    assert any("stream lag" in line for line in lines), "lag lines during the run"
    # The work directory is gone; the replica's log was kept, and it says it ran.
    assert not any(work.iterdir())
    assert "engine running" in (kept / "round-1" / "engine-r0.log").read_text()
