"""`gpuops` commands about the engine itself: run it, check rules, try them on events
(test-rules, replay), print schemas, benchmark the matcher."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from gpuops.cli.terminal import cells, err, out, run_async, settings_from
from gpuops.errors import EngineError, RuleError

if TYPE_CHECKING:
    from gpuops.clock import Clock
    from gpuops.match.rules import RuleSet
    from gpuops.settings import Settings


@click.command()
@click.option("--nats", help="NATS URL; without one an embedded nats-server is started")
@click.option("--rules", "rules_dir", type=click.Path(path_type=Path), help="rules directory")
@click.option("--playbooks", "playbooks_dir", type=click.Path(path_type=Path))
@click.option("--inventory", type=click.Path(path_type=Path), help="Ansible inventory")
@click.option("--dry-run/--no-dry-run", default=None, help="decide and record, never execute")
@click.option("--role", type=click.Choice(["all", "engine", "executor"]), help="which loops to run")
@click.option("--http", help="host:port for ChatOps, /metrics and /healthz (e.g. 127.0.0.1:8080)")
@click.option(
    "--replicas",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="engine replicas to run from this command, one process each (they share the "
    "partitions; see docs/operations.md)",
)
@click.pass_context
def run(ctx: click.Context, /, replicas: int, **flags: Any) -> None:
    """Run the engine (intake, match, decide, intents) and the executor."""
    settings = settings_from(ctx, **flags)
    logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
    if replicas > 1:
        sys.exit(run_async(run_replicas(settings, replicas)))
    run_async(run_engine(settings))


async def run_replicas(settings: Settings, replicas: int) -> int:
    """This command's engine as `replicas` processes that share the partitions."""
    from gpuops.scale.leases import default_replica_id
    from gpuops.scale.supervisor import Supervisor, replica_children, strip_option

    if settings.http and replicas > 1:
        raise click.UsageError(
            "--http with --replicas: each replica needs its own port; run them one by one "
            "with GPUOPS_HTTP set for each, or leave --http out"
        )
    base = settings.replica_id or default_replica_id(str(settings.state_dir))
    args = strip_option(sys.argv[1:], "--replicas", "--role")
    children = replica_children(args, replicas, base, settings.role)
    supervisor = Supervisor(children, settings.state_dir, embedded=not settings.nats.url)
    return await supervisor.run()


async def run_engine(settings: Settings, clock: Clock | None = None) -> None:
    """Load rules and inventory (failing fast), connect, and run until stopped."""
    from gpuops.app import App, load_world
    from gpuops.bus.conn import open_bus
    from gpuops.clock import SystemClock
    from gpuops.heap import settle_heap

    rules, inventory = load_world(settings)
    settle_heap()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    async with open_bus(
        settings.nats,
        settings.state_dir,
        name="gpuops-engine",
        role="executor" if settings.role == "executor" else "engine",
    ) as bus:
        app = App(
            settings=settings,
            bus=bus,
            clock=clock or SystemClock(),
            rules=rules,
            inventory=inventory,
        )
        await app.run()


@click.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--playbooks",
    "playbooks_dir",
    type=click.Path(path_type=Path),
    help="check playbooks exist here",
)
@click.option(
    "--source",
    type=click.Choice(["dcgm"]),
    help="also warn which rules cannot fire when this source feeds the engine (exit 0)",
)
@click.option(
    "--inventory",
    type=click.Path(path_type=Path),
    help="check group keys and inventory variables (group_by: [rack]) against it",
)
def validate(
    paths: tuple[Path, ...],
    playbooks_dir: Path | None,
    source: str | None,
    inventory: Path | None,
) -> None:
    """Check rule files (default: the site's rules/, else the shipped ones); print
    `file:line: rule NAME: message` per error, exit 1 on any."""
    from gpuops.inventory import load_inventory
    from gpuops.match.loader import load_rules
    from gpuops.shipped import locate

    if not paths:
        click.echo(f"checking {locate('rules').describe()}")
    targets = list(paths) or [locate("rules").path]
    books = playbooks_dir or locate("playbooks").path
    try:
        inv = load_inventory(inventory) if inventory is not None else None
        rules = load_rules(targets, books if books.is_dir() else None, inv)
    except EngineError as exc:
        for line in str(exc).splitlines():
            click.echo(line)
        sys.exit(1)
    click.echo(f"ok: {len(rules.rules)} rules in {len(rules.sources)} files")
    if source:
        from gpuops.sources.coverage import NOTES, gaps

        found = gaps(rules, source)
        for gap in found:
            click.echo(f"warning: {gap}")
        for note in NOTES[source]:
            click.echo(f"note: {note}")
        click.echo(f"{source}: {len(found)} of {len(rules.rules)} rules not fully served")


def _rules(rules_dir: Path | None, inventory: Path | None = None) -> RuleSet:
    from gpuops.inventory import load_inventory
    from gpuops.match.loader import load_rules
    from gpuops.shipped import locate

    books = locate("playbooks").path
    try:
        inv = load_inventory(inventory) if inventory is not None else None
        return load_rules(
            [rules_dir or locate("rules").path], books if books.is_dir() else None, inv
        )
    except EngineError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)


@click.command("test-rules")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--rules", "rules_dir", type=click.Path(path_type=Path), help="default: rules/")
@click.option(
    "--inventory",
    type=click.Path(path_type=Path),
    help="check rules that read the inventory against it (cases give hosts' variables)",
)
def test_rules(paths: tuple[Path, ...], rules_dir: Path | None, inventory: Path | None) -> None:
    """Run rule tests (YAML cases of events and expected actions; default: the site's
    tests/rules/, else the shipped ones); exit 1 on any failure."""
    from gpuops.ruletest import load_cases, run_cases
    from gpuops.shipped import locate

    rules = _rules(rules_dir, inventory)
    if not paths:
        click.echo(f"running {locate('tests/rules').describe()}")
    paths = paths or (locate("tests/rules").path,)
    files = [f for p in paths for f in (sorted(p.rglob("*.y*ml")) if p.is_dir() else [p])]
    failed = total = 0
    for file in files:
        try:
            results = asyncio.run(run_cases(str(file), load_cases(file), rules))
        except RuleError as exc:
            click.echo(f"FAIL {exc}")
            failed += 1
            continue
        for result in results:
            total += 1
            click.echo(f"{'PASS' if result.passed else 'FAIL'} {file}: {result.name}")
            for failure in result.failures:
                click.echo(f"     {failure}")
            failed += 0 if result.passed else 1
    click.echo(f"{total - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


@click.command()
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--rules", "rules_dir", type=click.Path(path_type=Path), help="default: rules/")
@click.option(
    "--inventory", type=click.Path(path_type=Path), help="only these hosts may be acted on"
)
@click.option("--json", "as_json", is_flag=True, help="one JSON line per would-be action")
def replay(file: Path, rules_dir: Path | None, inventory: Path | None, as_json: bool) -> None:
    """Shadow mode: recorded events through matching and safety stages, acting on nothing."""
    from gpuops.clock import rfc3339
    from gpuops.replay import replay_file

    rules = _rules(rules_dir)
    actions, stats = run_async(replay_file(file, rules, inventory))
    if as_json:
        for action in actions:
            click.echo(json.dumps(action.as_dict(), sort_keys=True))
    else:
        table = Table("ts", "rule", "node", "gpu", "would run")
        for a in actions:
            would = a.action + (" (dry-run rule)" if a.dry_run else "")
            gpu = ",".join(map(str, a.gpus)) if a.gpus else ""
            table.add_row(*cells(rfc3339(a.ts), a.rule, a.node, gpu, would))
        out.print(table)
    err.print(
        f"{stats['events']} events, {stats['bad']} unreadable, {len(actions)} would-be actions",
        highlight=False,
    )


@click.group()
def bench() -> None:
    """Benchmarks that print figures (never timed tests)."""


@bench.command("windows")
@click.option("--gpus", type=int, default=10_000, show_default=True)
@click.option("--window", default="24h", show_default=True, help="the aggregate window")
def bench_windows(gpus: int, window: str) -> None:
    """Per-GPU state, RSS and samples/s of a p95 and an avg over a long window."""
    from gpuops.match.benchwin import bench_windows as run_bench

    for line in run_bench(gpus=gpus, window=window):
        click.echo(line)


@bench.command("rules")
@click.option("--rules", "n_rules", type=int, default=50, show_default=True)
@click.option("--gpus", type=int, default=10_000, show_default=True)
@click.option("--seconds", type=float, default=20.0, show_default=True, help="wall seconds to run")
def bench_rules(n_rules: int, gpus: int, seconds: float) -> None:
    """Matcher throughput on samples built from the H200 recording."""
    from gpuops.bench import bench_rules as run_bench

    for line in run_bench(n_rules=n_rules, gpus=gpus, seconds=seconds):
        click.echo(line)


@bench.command("decide")
@click.option("--nodes", type=int, default=300, show_default=True, help="one match per node")
@click.option("--rule", default="xid-48-dbe", show_default=True, help="a shipped xid rule")
def bench_decide(nodes: int, rule: str) -> None:
    """KV/JetStream round trips and latency of accepted and dropped decisions (real NATS)."""
    from gpuops.bench_decide import bench_decide as run_bench

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
    from gpuops.inventory_bench import bench_inventory as run_bench

    for line in run_bench(hosts=hosts, compare=compare_hosts if compare else None):
        click.echo(line)


@bench.command("intake")
@click.option("--gpus", type=int, default=50_000, show_default=True, help="GPUs at 1 Hz")
@click.option("--seconds", type=float, default=20.0, show_default=True, help="seconds measured")
@click.option("--health", type=int, default=200, show_default=True, help="XID events injected")
@click.option(
    "--partitions",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="partitions of the streams (nats.partitions), all owned by this one engine",
)
def bench_intake(gpus: int, seconds: float, health: int, partitions: int) -> None:
    """Engine CPU per GPU sample and health event -> intent latency under telemetry."""
    from gpuops.bench_intake import IntakeBench
    from gpuops.bench_intake import bench_intake as run_bench

    if min(gpus, health) < 1 or seconds <= 0:
        raise click.BadParameter("--gpus and --health must be at least 1, --seconds above 0")
    spec = IntakeBench(gpus=gpus, seconds=seconds, health=health, partitions=partitions)
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
    from gpuops.bench import bench_storm as run_bench
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
    from gpuops.match.durations import parse_duration
    from gpuops.power.bench import BenchSpec
    from gpuops.power.bench import bench_power as run_bench

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
@click.option(
    "--keep-logs",
    type=click.Path(file_okay=False, path_type=Path),
    help="copy each round's replica logs here (the bench's work directory is deleted)",
)
def bench_fleet(replicas: str, keep_logs: Path | None, **options: int) -> None:
    """A 1 Hz simulated fleet against engine replicas on a local 3-server NATS cluster."""
    from gpuops.bench_fleet import FleetSpec
    from gpuops.bench_fleet import bench_fleet as run_bench

    try:
        counts = tuple(int(c) for c in replicas.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"{replicas!r} is not a list of counts like 1,2,4") from exc
    run_bench(FleetSpec(replicas=counts, **options), click.echo, keep_logs=keep_logs)


@bench.command("soak", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_soak(args: tuple[str, ...]) -> None:
    """NATS outages and engine kill -9s against a simulated fleet; exit 1 on a broken invariant.

    Options (see `python -m gpuops.soak --help`): --nodes, --gpus, --minutes, --nats-every,
    --outage-min, --outage-max, --engine-kill-every, --seed, --json.
    """
    from gpuops.soak import main as soak_main

    sys.exit(soak_main(list(args)))


@click.command()
@click.argument("what", type=click.Choice(["events", "rules"]))
def schema(what: str) -> None:
    """Print the JSON Schema of events (format v1) or of rule files."""
    from gpuops.match.schema import RULES_FILE_SCHEMA
    from gpuops.models import event_json_schema

    doc = event_json_schema() if what == "events" else RULES_FILE_SCHEMA
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


COMMANDS = [run, validate, test_rules, replay, bench, schema]
