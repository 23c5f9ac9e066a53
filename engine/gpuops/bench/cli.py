"""`gpuops bench ...`: every benchmark and soak, one command group the CLI plugs in.

The group is found through the `gpuops.commands` entry point (pyproject.toml), not
imported by the CLI: without this folder the product runs and its CLI has no `bench`.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from gpuops.cli.terminal import telemetry_format_option

PROGRESS_EVERY_S = 5.0


@click.group()
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmarks that print figures (never timed tests)."""
    # A bench prints its figures at the end: until then, a line on stderr every few
    # seconds says it still runs (stdout stays the figures only).
    done = threading.Event()
    name = ctx.invoked_subcommand or "bench"
    threading.Thread(target=_progress, args=(name, done), daemon=True).start()
    ctx.call_on_close(done.set)


def _progress(name: str, done: threading.Event) -> None:
    started = time.monotonic()
    while not done.wait(PROGRESS_EVERY_S):
        click.echo(f"bench {name}: running, {time.monotonic() - started:.0f} s", err=True)


def _counts(text: str) -> list[int]:
    """`--rules 1,20` as counts, each once, in order."""
    try:
        return sorted({int(c) for c in text.split(",")})
    except ValueError as exc:
        raise click.BadParameter(f"{text!r} is not a list of counts like 1,20") from exc


@bench.command("windows")
@click.option("--gpus", type=int, default=10_000, show_default=True)
@click.option("--window", default="24h", show_default=True, help="the aggregate window")
def bench_windows(gpus: int, window: str) -> None:
    """Per-GPU state, RSS and samples/s of a p95 and an avg over a long window."""
    from gpuops.bench.windows import bench_windows as run_bench

    for line in run_bench(gpus=gpus, window=window):
        click.echo(line)


@bench.command("rules")
@click.option("--rules", "n_rules", type=int, default=50, show_default=True)
@click.option("--gpus", type=int, default=10_000, show_default=True)
@click.option("--seconds", type=float, default=20.0, show_default=True, help="wall seconds to run")
def bench_rules(n_rules: int, gpus: int, seconds: float) -> None:
    """Matcher throughput on samples built from the H200 recording."""
    from gpuops.bench.rules import bench_rules as run_bench

    for line in run_bench(n_rules=n_rules, gpus=gpus, seconds=seconds):
        click.echo(line)


@bench.command("rulebook")
@click.option("--gpus", type=int, default=90_000, show_default=True, help="GPU samples")
@click.option("--rules", "rule_counts", default="1,20", show_default=True, help="rule counts")
@click.option("--repeat", type=int, default=3, show_default=True, help="interleaved rounds")
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    help="ansible-rulebook's own virtual environment [default: ~/.cache/gpuops/...]",
)
def bench_rulebook(gpus: int, rule_counts: str, repeat: int, venv: Path | None) -> None:
    """gpuops replay vs ansible-rulebook 1.3.2: CPU per GPU sample on the same samples and rules."""
    from gpuops.bench.rulebook import DEFAULT_VENV
    from gpuops.bench.rulebook import bench_rulebook as run_bench

    counts = _counts(rule_counts)
    for line in run_bench(gpus, counts, max(1, repeat), venv or DEFAULT_VENV):
        click.echo(line)


@bench.command("instructions")
@click.option("--gpus", type=int, default=18_000, show_default=True, help="GPU samples recorded")
@click.option("--samples", "first", type=int, help="the first of them, measured  [default: all]")
@click.option("--rules", "rule_counts", default="1,20", show_default=True, help="rule counts")
@click.option(
    "--base",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="another checkout's source root (its engine folder), measured alike",
)
@click.option(
    "--live",
    is_flag=True,
    help="the live engine against replay on the same 1 Hz samples (shipped rules, inventory)",
)
@click.option("--seconds", type=int, default=60, show_default=True, help="--live: a node's samples")
@click.option("--partitions", type=int, default=8, show_default=True, help="--live: partitions")
@click.option("--batch", type=int, default=6, show_default=True, help="--live: messages a pull")
def bench_instructions(
    gpus: int,
    first: int | None,
    rule_counts: str,
    base: Path | None,
    live: bool,
    seconds: int,
    partitions: int,
    batch: int,
) -> None:
    """Instructions a GPU sample of `gpuops replay` under callgrind (steady, unlike CPU
    time, when nothing else runs: beside a test run, unchanged code read 1-5% more);
    with --live, of the live engine reading the same samples from a real nats-server
    beside replay's, and their ratio."""
    if live:
        from gpuops.bench.live_instructions import bench_live_instructions

        if first is not None or base is not None:
            raise click.UsageError(
                "--live measures this tree's whole recording: no --samples, --base"
            )

        for line in bench_live_instructions(gpus, seconds, partitions, batch):
            click.echo(line)
        return
    from gpuops.bench.instructions import bench_instructions as run_bench

    counts = _counts(rule_counts)
    for line in run_bench(gpus, first, counts, base):
        click.echo(line)


@bench.command("replay")
@click.option("--gpus", type=int, default=90_000, show_default=True, help="GPU samples recorded")
@click.option("--rules", "n_rules", type=int, default=20, show_default=True, help="beside 1 rule")
@click.option("--repeat", type=int, default=3, show_default=True, help="rounds, interleaved")
@click.option(
    "--inventory/--no-inventory",
    default=False,
    show_default=True,
    help="replay with the fleet's inventory, or let the recording name the nodes",
)
def bench_replay(gpus: int, n_rules: int, repeat: int, inventory: bool) -> None:
    """CPU per GPU sample of `gpuops replay` with 1 and N rules, and of decoding alone."""
    from gpuops.bench.replay import bench_replay as run_bench

    for line in run_bench(gpus=gpus, rules=n_rules, repeat=repeat, with_inventory=inventory):
        click.echo(line)


@bench.command("decide")
@click.option("--nodes", type=int, default=300, show_default=True, help="one match per node")
@click.option("--rule", default="xid-48-dbe", show_default=True, help="a shipped xid rule")
def bench_decide(nodes: int, rule: str) -> None:
    """KV/JetStream round trips and latency of accepted and dropped decisions (real NATS)."""
    from gpuops.bench.decide import bench_decide as run_bench

    if nodes < 1:
        raise click.BadParameter("--nodes at least 1")
    for line in run_bench(nodes=nodes, rule=rule):
        click.echo(line)


@bench.command("inventory")
@click.option("--hosts", type=int, default=12_500, show_default=True)
@click.option("--compare", is_flag=True, help="also load --compare-hosts with Ansible's loader")
@click.option("--compare-hosts", type=int, default=2_000, show_default=True)
def bench_inventory(hosts: int, compare: bool, compare_hosts: int) -> None:
    """Seconds to ready and peak RSS of loading a fleet inventory, each in a fresh process."""
    from gpuops.bench.inventory import bench_inventory as run_bench

    for line in run_bench(hosts=hosts, compare=compare_hosts if compare else None):
        click.echo(line)


@bench.command("intake")
@click.option("--gpus", type=int, default=50_000, show_default=True, help="GPUs at 1 Hz")
@click.option("--seconds", type=float, default=20.0, show_default=True, help="seconds measured")
@click.option("--health", type=int, default=200, show_default=True, help="XID events injected")
@click.option(
    "--warmup",
    type=click.FloatRange(0, 3600),
    default=5.0,
    show_default=True,
    help="seconds of telemetry before the measured ones (65 or more: every GPU's state "
    "past its first minute, the steady state)",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="partitions of the streams (nats.partitions), all owned by this one engine",
)
@click.option(
    "--linger-ms",
    type=click.FloatRange(0, 1000),
    help="pause after a batch that was not full (intake_linger_ms; default: the settings')",
)
@telemetry_format_option("what the publisher sends")
def bench_intake(
    gpus: int,
    seconds: float,
    health: int,
    warmup: float,
    partitions: int,
    linger_ms: float | None,
    telemetry_format: int,
) -> None:
    """Engine CPU per GPU sample and health event -> intent latency under telemetry."""
    from gpuops.bench.intake import IntakeBench
    from gpuops.bench.intake import bench_intake as run_bench

    if min(gpus, health) < 1 or seconds <= 0:
        raise click.BadParameter("--gpus and --health must be at least 1, --seconds above 0")
    spec = IntakeBench(
        gpus=gpus,
        seconds=seconds,
        health=health,
        partitions=partitions,
        warmup_s=warmup,
        linger_ms=linger_ms,
        telemetry_format=telemetry_format,
    )
    for line in run_bench(spec):
        click.echo(line)


@bench.command("storm")
@click.option("--nodes", type=int, default=200, show_default=True, help="simulated nodes drained")
@click.option("--batch-size", type=int, help="hosts per run (default: executor.batch_size)")
@click.option("--forks", type=int, help="forks per run (default: executor.forks)")
@click.option("--parallel", type=int, help="runs in flight (default: max_parallel_runs)")
@click.option(
    "--compare-nodes",
    type=int,
    default=20,
    show_default=True,
    help="more nodes drained one run per node, for comparison (0: none)",
)
def bench_storm(
    nodes: int,
    batch_size: int | None,
    forks: int | None,
    parallel: int | None,
    compare_nodes: int,
) -> None:
    """The same drain on N simulated nodes: wall and CPU time, batched and one run per node."""
    from gpuops.bench.rules import bench_storm as run_bench
    from gpuops.settings import Settings

    defaults = Settings()
    if min(nodes, batch_size or 1, forks or 1, parallel or 1) < 1 or compare_nodes < 0:
        raise click.BadParameter("counts must be at least 1 (--compare-nodes at least 0)")
    for line in run_bench(
        nodes=nodes,
        batch_size=batch_size or defaults.executor.batch_size,
        forks=forks or defaults.executor.forks,
        parallel=parallel or defaults.max_parallel_runs,
        compare_nodes=compare_nodes,
    ):
        click.echo(line)


@bench.command("power")
@click.option("--nodes", type=int, default=100, show_default=True)
@click.option("--budget", type=float, default=0.7, show_default=True, help="share of nameplate")
@click.option("--window", default="1h", show_default=True, help="length of the peak window")
@click.option("--seed", type=int, default=7, show_default=True)
def bench_power(nodes: int, budget: float, window: str, seed: int) -> None:
    """A mixed fleet through a peak window under a budget: uniform cap vs the controller.

    Exits 1 when the controller is over budget after its first interval or keeps less
    throughput than the uniform cap.
    """
    from gpuops.bench.power import BenchSpec
    from gpuops.bench.power import bench_power as run_bench
    from gpuops.match.durations import parse_duration

    if nodes < 1 or not 0 < budget <= 1:
        raise click.BadParameter("--nodes at least 1, --budget in (0, 1]")
    try:
        window_s = parse_duration(window)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--window") from exc
    last = ""
    for last in run_bench(BenchSpec(nodes=nodes, share=budget, window_s=window_s, seed=seed)):
        click.echo(last)
    sys.exit(0 if last.endswith("ok=true") else 1)


@bench.command("fleet")
@click.option("--nodes", type=int, default=12_500, show_default=True)
@click.option("--gpus", type=int, default=8, show_default=True, help="GPUs per node")
@click.option(
    "--replicas", default="1,2,4", show_default=True, help="engine replicas, one round each"
)
@click.option("--seconds", type=int, default=60, show_default=True, help="the measured window")
@click.option("--warmup", type=int, default=15, show_default=True, help="seconds before it")
@click.option("--health", type=int, default=100, show_default=True, help="probe failures injected")
@click.option(
    "--publishers", type=int, default=0, help="publisher processes (default: 1 per 5,000 nodes)"
)
@click.option(
    "--stream-replicas",
    "nats_replicas",
    type=click.IntRange(1, 3),
    default=3,
    show_default=True,
    help="copies of each stream and bucket on the 3-server cluster",
)
@telemetry_format_option("what the publishers send")
@click.option(
    "--telemetry-storage",
    type=click.Choice(["file", "memory"]),
    default="file",
    show_default=True,
    help="the telemetry stream's storage (nats.telemetry_storage)",
)
@click.option(
    "--telemetry-replicas",
    type=click.IntRange(0, 3),
    default=0,
    help="copies of the telemetry stream (default: --stream-replicas)",
)
@click.option(
    "--keep-logs",
    type=click.Path(file_okay=False, path_type=Path),
    help="copy each round's replica logs here (the bench's work directory is deleted)",
)
def bench_fleet(replicas: str, keep_logs: Path | None, **options: Any) -> None:
    """A 1 Hz simulated fleet against engine replicas on a local 3-server NATS cluster."""
    from gpuops.bench.fleet import FleetSpec
    from gpuops.bench.fleet import bench_fleet as run_bench

    try:
        counts = tuple(int(c) for c in replicas.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"{replicas!r} is not a list of counts like 1,2,4") from exc
    run_bench(FleetSpec(replicas=counts, **options), click.echo, keep_logs=keep_logs)


@bench.command("soak", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_soak(args: tuple[str, ...]) -> None:
    """NATS outages and engine kill -9s against a simulated fleet; exit 1 on a broken invariant.

    Options (see `python -m gpuops.bench.soak --help`): --nodes, --gpus, --minutes, --nats-every,
    --outage-min, --outage-max, --engine-kill-every, --seed, --json.
    """
    from gpuops.bench.soak import main as soak_main

    sys.exit(soak_main(list(args)))
