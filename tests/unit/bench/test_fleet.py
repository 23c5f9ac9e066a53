"""What `gpuops bench fleet` reads of a replica's /metrics, and the options it refuses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from gpuops.bench.fleet import BenchError, FleetSpec
from gpuops.bench.fleet.figures import RoundFigures
from gpuops.bench.fleet.procs import Replica, parse_metrics
from gpuops.cli import main

BEFORE_PARTITIONS = """\
# TYPE gpuops_events_total counter
gpuops_events_total{kind="telemetry"} 1500.0
gpuops_events_total{kind="probe"} 7.0
# TYPE gpuops_consumer_pending gauge
gpuops_consumer_pending{consumer="gpuops-engine-telemetry"} 42.0
gpuops_consumer_pending{consumer="gpuops-engine"} 3.0
"""

PARTITIONED = (
    BEFORE_PARTITIONS
    + """\
# TYPE gpuops_partition_lag gauge
gpuops_partition_lag{partition="0",stream="GPUOPS_TELEMETRY"} 10.0
gpuops_partition_lag{partition="5",stream="GPUOPS_TELEMETRY"} 15.0
gpuops_partition_lag{partition="0",stream="GPUOPS_EVENTS"} 99.0
# TYPE gpuops_partitions_held gauge
gpuops_partitions_held 2.0
"""
)


def test_telemetry_handled_and_the_consumers_pending_before_partitions() -> None:
    got = parse_metrics(BEFORE_PARTITIONS, at=3.0)
    assert (got.telemetry, got.lag, got.at, got.partitions) == (1500.0, 42.0, 3.0, None)


def test_the_lag_of_a_partitioned_replica_is_its_telemetry_partitions_summed() -> None:
    got = parse_metrics(PARTITIONED, at=0.0)
    assert (got.lag, got.partitions) == (25.0, 2)


def test_no_lag_figure_when_the_replica_exports_none() -> None:
    assert parse_metrics('gpuops_events_total{kind="telemetry"} 1.0\n', at=0.0).lag is None


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (FleetSpec(nodes=0), "--nodes"),
        (FleetSpec(replicas=(1, 0)), "--replicas"),
        (FleetSpec(replicas=()), "--replicas"),
        (FleetSpec(health=-1), "--health"),
    ],
)
def test_options_that_cannot_make_a_round_are_refused(spec: FleetSpec, says: str) -> None:
    with pytest.raises(BenchError, match=says):
        spec.check()


def test_a_replica_list_that_is_not_numbers_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["bench", "fleet", "--replicas", "1,two"])
    assert result.exit_code == 2
    assert "not a list of counts like 1,2,4" in result.output


def test_publishers_default_to_one_per_5000_nodes_and_at_most_one_per_core() -> None:
    assert FleetSpec(nodes=12_500).publisher_count(cores=2) == 2
    assert FleetSpec(nodes=12_500).publisher_count(cores=16) == 3
    assert FleetSpec(nodes=20).publisher_count(cores=2) == 1
    assert FleetSpec(nodes=3, publishers=8).publisher_count(cores=2) == 3


def test_latency_percentiles_and_what_the_stream_lost() -> None:
    f = RoundFigures(
        replicas=1, cores=2, gpus=8, window_s=10.0, offered=100, published=90, missed=10,
        published_total=120, stored=120, handled_total=100, pending_end=5,
        handled_per_s=[720.0], cpu_cores=[0.5], rss_mb=[100.0], ready_s=[1.0],
        max_lag=[0.0], publisher_cores=0.1, nats_cores=0.1, machine_cores=1.0,
        load=(1.0, 1.0), health_sent=100, latencies_ms=[float(i) for i in range(1, 101)],
    )  # fmt: skip
    assert f.lost == 15
    assert f.quantile(50) == pytest.approx(50.5)
    assert f.quantile(99) == pytest.approx(99.01)
    assert f.published_per_s == 72.0


def test_a_replica_that_exits_says_why_in_its_last_words(tmp_path: Path) -> None:
    # A real process that fails as a replica starting under load could: the bench's work
    # directory is deleted when it ends, so the words must travel in the error.
    said = "; ".join(f"line {i}" for i in range(3))
    argv = [sys.executable, "-c", f"print({said!r}); print('nats: no servers'); exit(1)"]
    replica = Replica(0, argv, dict(os.environ), tmp_path, 0)
    replica.start()
    assert replica.proc is not None
    replica.proc.wait(30)
    replica.stop()
    assert replica.exited() == 1
    assert replica.last_words().splitlines() == [said, "nats: no servers"]
    assert replica.last_words(lines=1) == "nats: no servers"


def test_a_replica_with_no_log_says_so(tmp_path: Path) -> None:
    replica = Replica(0, ["true"], {}, tmp_path / "gone", 0)
    assert "cannot be read" in replica.last_words()
