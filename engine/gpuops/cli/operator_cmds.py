"""`gpuops` commands for operators against a running engine's bus: status, history,
approvals, silences, the breaker, drains, dry-run, drift checks, publishing events.

Those that change things ask the running engine to run the ChatOps command of the same
name (gpuops.ops.commands) as the operator's NATS user, so a terminal and a chat do exactly
the same thing under the same permission table. None of them starts a NATS server.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from gpuops.cli.terminal import cells, err, one_line, out, run_async, settings_from
from gpuops.errors import EventError

if TYPE_CHECKING:
    from gpuops.act.driftcheck import DriftReport
    from gpuops.models import AuditRecord
    from gpuops.settings import Settings

NATS_HELP = "NATS URL (default: the running engine's embedded server)"


async def read_status(settings: Settings) -> dict[str, Any]:
    """The status as the bus has it; no inventory file needed (the engine's heartbeat
    says how many hosts it watches)."""
    from gpuops.bus.conn import open_bus
    from gpuops.clock import SystemClock
    from gpuops.ops.commands import Commands

    async with open_bus(settings.nats, settings.state_dir, name="gpuops-cli", role="cli") as bus:
        return await Commands.over_bus(bus, SystemClock(), None, settings.chatops).status()


@click.command()
@click.option("--json", "as_json", is_flag=True, help="the status as one JSON object")
@click.option("--nats", help=NATS_HELP)
@click.pass_context
def status(ctx: click.Context, as_json: bool, nats: str | None) -> None:
    """The engine (up or not), nodes per state, nodes not healthy and why, breaker,
    approvals, silences. Exits 1 when no engine is running (after saying so)."""
    from gpuops.ops.commands import render_status

    result = run_async(read_status(settings_from(ctx, nats=nats)))
    click.echo(
        json.dumps(result, sort_keys=True, default=str) if as_json else render_status(result)
    )
    if not result["engine"]["running"]:
        ctx.exit(1)


def _chat_command(name: str, doc: str) -> click.Command:
    """A CLI command that asks the running engine to run the ChatOps command of that name,
    as this connection's NATS user (the engine checks the permission table)."""

    @click.command(name, help=doc, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1)
    @click.option("--nats", help=NATS_HELP)
    @click.pass_context
    def command(ctx: click.Context, args: tuple[str, ...], nats: str | None) -> None:
        settings = settings_from(ctx, nats=nats)
        click.echo(run_async(ask(settings, name, list(args))))

    return command


async def ask(settings: Settings, name: str, args: list[str]) -> str:
    """Connect as this operator and have the engine run one command; its reply."""
    from gpuops.bus.conn import open_bus
    from gpuops.ops.cmdwire import ask_engine

    async with open_bus(settings.nats, settings.state_dir, name="gpuops-cli", role="cli") as bus:
        return await ask_engine(bus, name, args)


CHAT_COMMANDS = [
    _chat_command(name, doc)
    for name, doc in (
        ("approve", "Approve a pending action: approve ID."),
        ("deny", "Deny a pending action: deny ID."),
        (
            "silence",
            "Silence rule:NAME, node:NAME, group:NAME or label:K=V for a DURATION with a REASON "
            "(a node or group the inventory lacks: add --force).",
        ),
        ("unsilence", "Remove a silence: unsilence ID."),
        (
            "breaker",
            "Reset the fleet breaker (reset) or let one action through on approval (half-open).",
        ),
        ("dry-run", "Switch the running engine's dry-run on or off."),
        ("drain", "Ask the engine to drain a node: drain NODE REASON."),
        ("undrain", "Ask the engine to return a node to service: undrain NODE [REASON]."),
        (
            "state",
            "Stored records that do not decode: state list; state repair BUCKET KEY shows one "
            "raw, --set JSON rewrites it (validated), --delete removes it.",
        ),
    )
]


@click.command()
@click.argument("node", required=False)
@click.option("--json", "as_json", is_flag=True, help="one JSON record per line")
@click.option("--nats", help="NATS URL (default: the running engine's or the state dir's store)")
@click.option("--limit", type=int, default=200, show_default=True, help="the newest N records")
@click.option("--drift", is_flag=True, help="only drift-check summaries")
@click.option("--run", "run_id", help="print this run's output (kept under STATE/runs/RUN_ID)")
@click.pass_context
def history(
    ctx: click.Context,
    node: str | None,
    as_json: bool,
    nats: str | None,
    limit: int,
    drift: bool,
    run_id: str | None,
) -> None:
    """Print the audit trail: decisions, runs (with playbook revision), notes (for NODE, or all).

    With --run ID, print the output of one playbook run instead (its ID is in the run's
    record); the output is kept by the executor that ran it, under its state dir.
    """
    from gpuops.clock import rfc3339
    from gpuops.record.audit import as_json_line

    if run_id is not None:
        click.echo(run_output(settings_from(ctx, nats=nats), run_id), nl=False)
        return
    records = run_async(audit_records(settings_from(ctx, nats=nats), node))
    if drift:
        records = [r for r in records if "drift_check" in r.body]
    records = records[-limit:]
    if as_json:
        for record in records:
            click.echo(as_json_line(record))
        return
    table = Table("time", "type", "node", "rule", "what", "playbook version")
    for r in records:
        version = ""
        if r.type == "run":
            rev, sha = r.body.get("revision") or "-", r.body.get("sha256") or "-"
            version = (
                f"{rev[:12]}{'+dirty' if str(rev).endswith('+dirty') else ''} sha256:{sha[:12]}"
            )
        table.add_row(*cells(rfc3339(r.at)[:19], r.type, r.node, r.rule, _what(r), version))
    out.print(table)
    _print_failed_tasks(records)


def _print_failed_tasks(records: list[AuditRecord]) -> None:
    """Each failed run's task and message in full, one per line (a table cell would wrap them)."""
    from gpuops.clock import rfc3339

    failed = [r for r in records if r.type == "run" and r.body.get("failed_task")]
    if failed:
        out.print("failed tasks:", markup=False)
    for r in failed:
        b = r.body
        out.print(
            f"  {rfc3339(r.at)[:19]} {r.node} {b.get('playbook')} run {b.get('run_id') or '-'}: "
            f"task {one_line(b['failed_task'])!r}: {one_line(b.get('failed_message') or '-')}",
            markup=False,
            highlight=False,
        )


def _what(record: AuditRecord) -> str:
    """The summary; for a run also its id and, when a task failed, which and why."""
    if record.type != "run":
        return record.summary
    lines = [record.summary]
    if record.body.get("run_id"):
        lines.append(f"run {record.body['run_id']} ({record.body.get('hosts_in_run', 1)} hosts)")
    if record.body.get("failed_task"):
        lines.append(f"failed task: {record.body['failed_task']} (message below)")
    return "\n".join(lines)


def run_output(settings: Settings, run_id: str) -> str:
    """A kept run's stdout; an ActionError (exit 2) says why there is none."""
    from gpuops.act.evidence import Evidence
    from gpuops.errors import EngineError

    try:
        return Evidence(settings.state_dir / "runs").stdout(run_id)
    except EngineError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)


async def audit_records(settings: Settings, node: str | None) -> list[AuditRecord]:
    """Every audit record (for one node, or all), oldest first."""
    from gpuops.bus.conn import open_bus
    from gpuops.record.audit import read_audit

    settings.state_dir.mkdir(parents=True, exist_ok=True)
    async with open_bus(
        settings.nats, settings.state_dir, name="gpuops-history", role="cli", stopped_store=True
    ) as bus:
        return [r async for r in read_audit(bus.js, node)]


@click.command("drift-check")
@click.option("--group", default="all", show_default=True, help="inventory group to check")
@click.option(
    "--inventory",
    type=click.Path(path_type=Path, exists=True, dir_okay=True),
    help="the hosts to check (default: the running engine's inventory, from its heartbeat)",
)
@click.option("--json", "as_json", is_flag=True, help="the report as one JSON object")
@click.option("--nats", help=NATS_HELP)
@click.option("--no-publish", is_flag=True, help="only report; send no drift events to the engine")
@click.pass_context
def drift_check(
    ctx: click.Context,
    group: str,
    inventory: Path | None,
    as_json: bool,
    nats: str | None,
    no_publish: bool,
) -> None:
    """Run baseline.yml in check mode over a group now; print hosts x drifted settings."""
    from rich.progress import Progress

    settings = settings_from(ctx, nats=nats, inventory=inventory)
    if inventory is None:
        running = run_async(engine_inventory(settings))
        if running is not None and running != settings.inventory:
            click.echo(f"inventory: {running} (the running engine's)", err=True)
            settings = settings.model_copy(update={"inventory": running})
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(cells(f"drift check of {group}")[0], total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        report = run_async(run_drift_check(settings, group, advance, publish=not no_publish))
    if as_json:
        hosts = {
            h: {"drifts": r.drifts, "unreachable": r.unreachable, "failed": r.failed}
            for h, r in sorted(report.hosts.items())
        }
        click.echo(json.dumps({**report.summary(), "results": hosts}, sort_keys=True))
        return
    _print_drift(report, group)


def _print_drift(report: DriftReport, group: str) -> None:
    table = Table("host", "drifted settings", "state", title=cells(f"drift check of {group}")[0])
    for host, result in sorted(report.hosts.items()):
        drifted = ", ".join(
            f"{d['setting']}"
            + (f"[{d['gpu']}]" if d.get("gpu") is not None else "")
            + f": {d['actual']} (want {d['expected']})"
            for d in result.drifts
        )
        table.add_row(*cells(host, drifted or "-", report.state_of(host)))
    out.print(table)
    s = report.summary()
    out.print(
        f"{s['hosts_checked']} hosts, {len(s['drifted'])} drifted, "
        f"{len(s['unreachable'])} unreachable, {s['duration_s']}s",
        markup=False,
    )


async def engine_inventory(settings: Settings) -> Path | None:
    """The running engine's inventory file, from its heartbeat; None when no engine runs,
    its beat predates the field, or the file is not on this machine."""
    from gpuops.bus.conn import open_bus
    from gpuops.errors import EngineError
    from gpuops.ops.heartbeat import Heartbeats, engine_state

    try:
        async with open_bus(
            settings.nats, settings.state_dir, name="gpuops-cli", role="cli"
        ) as bus:
            state = engine_state(
                await Heartbeats(bus.buckets.control).all(), time.time(), time.time()
            )
    except EngineError:
        return None
    path = (
        Path(state.beat.inventory)
        if state.running and state.beat and state.beat.inventory
        else None
    )
    return path if path is not None and path.exists() else None


async def run_drift_check(
    settings: Settings, group: str, progress: Callable[[int, int], None], publish: bool = True
) -> DriftReport:
    """One drift check now; its events and summary go to the bus unless `publish` is off."""
    from gpuops.act.driftcheck import drift_check
    from gpuops.act.runenv import RunEnv
    from gpuops.clock import SystemClock
    from gpuops.diagnose.topology import Manifests
    from gpuops.inventory.hosts import load_inventory

    inventory = load_inventory(settings.inventory)
    clock = SystemClock()
    report = await drift_check(
        inventory,
        settings.playbooks_dir,
        clock,
        group=group,
        batch_size=settings.drift.batch_size,
        forks=settings.drift.forks,
        progress=progress,
        env=RunEnv.of(settings),
        manifests=Manifests.load(settings.drift.topology_dir),
    )
    if publish:
        # The engine checks again and publishes what it finds: an operator's own report
        # would be decided as the baseline's word (drift events are the engine's to send).
        await ask(settings, "drift-check", [group])
    return report


@click.command()
@click.argument("file", type=click.File("rb"))
@click.option("--nats", help=NATS_HELP)
@click.option(
    "--direct",
    is_flag=True,
    help="publish straight to NATS as this connection's user (a test bus; an engine "
    "that checks publishers dead-letters them as forged)",
)
@click.pass_context
def publish(ctx: click.Context, file: Any, nats: str | None, direct: bool) -> None:
    """Have the engine publish events from a JSON lines file (`-` for stdin).

    The engine publishes them as its own, in your name (the audit says who); the
    permission table's `publish` entry says who may. A line that is not a valid event
    is reported (line number and why, as the dead-letter queue would say) and still
    sent, so the engine dead-letters it; the command then exits 1.
    """
    settings = settings_from(ctx, nats=nats)
    lines = [line for line in file.read().splitlines() if line.strip()]
    rejected = rejected_lines(lines)
    sent = run_async(publish_lines(settings, lines, direct))
    for number, why in rejected:
        click.echo(f"line {number}: {why}", err=True)
    click.echo(f"published {sent} events")
    if rejected:
        raise EventError(
            "rejected",
            f"{len(rejected)} line(s) are not valid events (reasons above); fix them and "
            "publish those lines again",
        )


def rejected_lines(lines: list[bytes]) -> list[tuple[int, str]]:
    """(line number, why) of each line the intake would dead-letter (a v2 sample joined
    to the static facts the lines before it carried, as the intake would)."""
    from gpuops.intake.compact import FactsBook
    from gpuops.intake.decode import decode_line

    out = []
    book = FactsBook()
    for number, line in enumerate(lines, start=1):
        try:
            decode_line(line, book)
        except EventError as exc:
            out.append((number, str(exc)))
    return out


# A command request is one NATS message (1 MiB at most): lines go in batches under it.
_BATCH_BYTES = 512 * 1024


async def publish_lines(settings: Settings, lines: list[bytes], direct: bool = False) -> int:
    """Send JSON-lines events through the engine (or, `direct`, straight to their
    subjects); how many were sent."""
    from gpuops.bus.conn import open_bus
    from gpuops.ops.cmdwire import ask_engine
    from gpuops.ops.commands import recorded_subject

    async with open_bus(
        settings.nats, settings.state_dir, name="gpuops-publish", role="cli"
    ) as bus:
        if direct:
            for line in lines:
                subject, msg_id = recorded_subject(line)
                headers = {"Nats-Msg-Id": msg_id} if msg_id else None
                await bus.js.publish(subject, line, headers=headers)
            return len(lines)
        for batch in _batches(lines):
            await ask_engine(bus, "publish", [line.decode(errors="replace") for line in batch])
    return len(lines)


def _batches(lines: list[bytes]) -> list[list[bytes]]:
    """Lines in requests under the limit, each line's size as the request carries it
    (JSON-escaped); a line that alone is over it is a clear error, not a lost request."""
    out: list[list[bytes]] = [[]]
    size = 0
    for number, line in enumerate(lines, start=1):
        sent = len(json.dumps(line.decode(errors="replace"))) + 2
        if sent > _BATCH_BYTES:
            raise EventError(
                "too_large", f"line {number} is {sent} bytes as sent; at most {_BATCH_BYTES}"
            )
        if out[-1] and size + sent > _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(line)
        size += sent
    return [b for b in out if b]


@click.group()
def report() -> None:
    """Reports the running engine keeps."""


@report.command()
@click.option(
    "--threshold",
    default="10%",
    show_default=True,
    help="p95 utilisation over the day under which a GPU is reported",
)
@click.option("--nats", help=NATS_HELP)
@click.pass_context
def density(ctx: click.Context, threshold: str, nats: str | None) -> None:
    """GPUs whose p95 utilisation over a day stays under a threshold: per node and GPU, the
    utilisation profile, peak memory, and a recommended MIG layout (or time-slicing for a
    development pool: host variable `pool: development`)."""
    settings = settings_from(ctx, nats=nats)
    click.echo(run_async(ask(settings, "density", [threshold])))


COMMANDS = [status, *CHAT_COMMANDS, history, drift_check, publish, report]
