"""`gpuops` commands about the engine itself: run it, check rules, print schemas (trying
rules on events is shadow_cmds)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpuops.cli.terminal import run_async, settings_from
from gpuops.errors import EngineError

if TYPE_CHECKING:
    from gpuops.clock import Clock
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
    from gpuops.bus.conn import open_bus
    from gpuops.clock import SystemClock
    from gpuops.spine.app import App, enrol_inventory, load_world, writable_state_dir
    from gpuops.spine.heap import settle_heap
    from gpuops.spine.starting import Starting

    writable_state_dir(settings)
    rules, inventory = load_world(settings)
    settle_heap()
    if settings.role != "executor":
        enrol_inventory(settings, inventory)
    # /healthz says what the start waits for, until the engine's own server takes over
    starting = Starting(settings.http_limits)
    await starting.serve(settings.http)
    try:
        async with open_bus(
            settings.nats,
            settings.state_dir,
            name="gpuops-engine",
            role="executor" if settings.role == "executor" else "engine",
            waiting=starting.note,
        ) as bus:
            await starting.stop()
            app = App(
                settings=settings,
                bus=bus,
                clock=clock or SystemClock(),
                rules=rules,
                inventory=inventory,
            )
            await app.run()
    finally:
        await starting.stop()


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
    from gpuops.inventory.hosts import load_inventory
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


@click.command()
@click.argument("what", type=click.Choice(["events", "rules"]))
def schema(what: str) -> None:
    """Print the JSON Schema of events (format v1) or of rule files."""
    from gpuops.match.schema import RULES_FILE_SCHEMA
    from gpuops.models import event_json_schema

    doc = event_json_schema() if what == "events" else RULES_FILE_SCHEMA
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


COMMANDS = [run, validate, schema]
