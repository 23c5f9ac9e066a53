"""`gpuops` commands for operators and nodes: agent, status, approvals, silences, the
breaker, drift checks, and the simulated fleet. Registered on the group in engine.cli."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from engine.cli import _run, _settings, err, main, out
from engine.errors import EngineError
from engine.sim.scenario import FAULTS


@main.command()
@click.option("--node", help="this node's inventory name (default: short hostname)")
@click.option("--nats", help="NATS URL (default: the settings' or the state dir's embedded one)")
@click.option("--backend", type=click.Choice(["nvml", "sim"]), default="nvml", show_default=True)
@click.option("--sim-root", type=click.Path(path_type=Path), help="simulated fleet (backend sim)")
@click.option("--interval", type=float, default=10.0, show_default=True, help="telemetry seconds")
@click.option("--heartbeat", type=float, default=30.0, show_default=True, help="heartbeat seconds")
@click.option("--probe-every", type=float, default=3600.0, show_default=True)
@click.option("--probe-timeout", type=float, default=60.0, show_default=True)
@click.option("--probe-command", help="run this instead of the built-in probe ({gpu} is replaced)")
@click.option("--spool", type=click.Path(path_type=Path), help="spool file for health events")
@click.option("--once", is_flag=True, help="one telemetry event and probe results, no NATS")
@click.option("--json", "as_json", is_flag=True, help="with --once: JSON lines on stdout")
@click.pass_context
def agent(ctx: click.Context, /, **opts: Any) -> None:
    """The node agent: NVML telemetry, XID/ECC events, probes and heartbeats to NATS."""
    from engine.agent.run import agent_once, run_agent

    settings = _settings(ctx, nats=opts.pop("nats"))
    if opts["once"]:
        try:
            lines = agent_once(opts)
        except EngineError as exc:
            err.print(f"error: {exc}", markup=False)
            sys.exit(2)
        for line in lines:
            click.echo(json.dumps(line, sort_keys=True) if opts["as_json"] else str(line))
        return
    _run(run_agent(settings, opts))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="the status as one JSON object")
@click.option("--nats", help="NATS URL (default: the running engine's embedded server)")
@click.pass_context
def status(ctx: click.Context, as_json: bool, nats: str | None) -> None:
    """The fleet: nodes per state, nodes not healthy and why, breaker, approvals, silences."""
    from engine.commands import render_status
    from engine.runtime import with_commands

    result = _run(with_commands(_settings(ctx, nats=nats), lambda c: c.status()))
    click.echo(
        json.dumps(result, sort_keys=True, default=str) if as_json else render_status(result)
    )


def _command(name: str, doc: str) -> None:
    """A CLI command that runs the ChatOps command of the same name."""

    @main.command(name, help=doc, context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1)
    @click.option("--nats", help="NATS URL (default: the running engine's embedded server)")
    @click.pass_context
    def command(ctx: click.Context, args: tuple[str, ...], nats: str | None) -> None:
        import shlex

        from engine.commands import Caller
        from engine.runtime import with_commands

        line = shlex.join([name, *args])
        caller = Caller(user=_user(), platform="cli")
        click.echo(_run(with_commands(_settings(ctx, nats=nats), lambda c: c.run(line, caller))))


def _user() -> str:
    import getpass

    return getpass.getuser()


for _name, _doc in (
    ("approve", "Approve a pending action: approve ID."),
    ("deny", "Deny a pending action: deny ID."),
    (
        "silence",
        "Silence rule:NAME, node:NAME, group:NAME or label:K=V for a DURATION with a REASON.",
    ),
    ("unsilence", "Remove a silence: unsilence ID."),
    (
        "breaker",
        "Reset the fleet breaker (reset) or let one action through on approval (half-open).",
    ),
    ("dry-run", "Switch the running engine's dry-run on or off."),
    ("drain", "Drain a node now: drain NODE REASON."),
    ("undrain", "Return a node to service: undrain NODE."),
):
    _command(_name, _doc)


@main.command("drift-check")
@click.option("--group", default="all", show_default=True, help="inventory group to check")
@click.option("--json", "as_json", is_flag=True, help="the report as one JSON object")
@click.option("--nats", help="NATS URL (default: the running engine's embedded server)")
@click.option("--no-publish", is_flag=True, help="only report; send no drift events to the engine")
@click.pass_context
def drift_check_cmd(
    ctx: click.Context, group: str, as_json: bool, nats: str | None, no_publish: bool
) -> None:
    """Run baseline.yml in check mode over a group now; print hosts x drifted settings."""
    from rich.progress import Progress

    from engine.runtime import run_drift_check

    settings = _settings(ctx, nats=nats)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(f"drift check of {group}", total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        report = _run(run_drift_check(settings, group, advance, publish=not no_publish))
    if as_json:
        hosts = {
            h: {"drifts": r.drifts, "unreachable": r.unreachable, "failed": r.failed}
            for h, r in sorted(report.hosts.items())
        }
        click.echo(json.dumps({**report.summary(), "results": hosts}, sort_keys=True))
        return
    table = Table("host", "drifted settings", "state", title=f"drift check of {group}")
    for host, result in sorted(report.hosts.items()):
        drifted = ", ".join(
            f"{d['setting']}"
            + (f"[{d['gpu']}]" if d.get("gpu") is not None else "")
            + f": {d['actual']} (want {d['expected']})"
            for d in result.drifts
        )
        table.add_row(host, drifted or "-", report.state_of(host))
    out.print(table)
    s = report.summary()
    out.print(
        f"{s['hosts_checked']} hosts, {len(s['drifted'])} drifted, "
        f"{len(s['unreachable'])} unreachable, {s['duration_s']}s"
    )


@main.command()
@click.option("--nodes", type=int, default=16, show_default=True)
@click.option("--gpus", type=int, default=8, show_default=True)
@click.option(
    "--root", type=click.Path(path_type=Path), help="fleet state (default: STATE_DIR/sim)"
)
@click.option("--inventory-dir", type=click.Path(path_type=Path), help="default: inventories/sim")
@click.option(
    "--run", "seconds", type=float, help="then publish the fleet's events for this many seconds"
)
@click.option("--scenario", help="fault scenario while running (demo, storm, or a .yml)")
@click.option("--nats", help="NATS URL (default: the running engine's embedded server)")
@click.pass_context
def simulate(
    ctx: click.Context,
    nodes: int,
    gpus: int,
    root: Path | None,
    inventory_dir: Path | None,
    seconds: float | None,
    scenario: str | None,
    nats: str | None,
) -> None:
    """Create a simulated fleet (state, tool shims, inventory); with --run, drive it onto NATS."""
    from engine.sim.fleet import SimFleet

    settings = _settings(ctx, nats=nats)
    fleet = SimFleet.create(root or settings.state_dir / "sim", nodes, gpus)
    click.echo(f"fleet of {nodes} x {gpus} GPUs at {fleet.root}")
    click.echo(f"inventory: {fleet.write_inventory(inventory_dir or settings.inventory)}")
    if seconds:
        from engine.runtime import drive_fleet

        for line in _run(drive_fleet(settings, fleet, seconds, scenario)):
            click.echo(line)


@main.command("sim-fault")
@click.option(
    "--root", required=True, type=click.Path(exists=True, path_type=Path), help="the fleet"
)
@click.option("--node", required=True)
@click.option(
    "--fault",
    required=True,
    type=click.Choice([*FAULTS, "lost", "drained"]),
)
@click.option("--gpu", type=int, default=0, show_default=True)
@click.option("--param", "params", multiple=True, help="KEY=VALUE, e.g. watts=400 or value=false")
def sim_fault(root: Path, node: str, fault: str, gpu: int, params: tuple[str, ...]) -> None:
    """Put a fault on a simulated node (tests, molecule scenarios, hands-on demos)."""
    import time

    import yaml

    from engine.sim.fleet import SimFleet
    from engine.sim.state import read

    nodes = sorted(p.name for p in (root / "nodes").iterdir())
    fleet = SimFleet(root=root, nodes=nodes, gpus=len(read(root / "nodes" / node)["gpus"]))
    values = {k: yaml.safe_load(v) for k, _, v in (p.partition("=") for p in params)}
    fleet.inject(node, fault, gpu, at=time.time(), **values)
    click.echo(f"{fault} on {node}/{gpu} {values or ''}")
