"""`gpuops` commands for the simulated fleet: create and drive one, put faults on its
nodes, and the demo that runs the whole loop on it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpuops.cli.terminal import out, run_async, settings_from
from gpuops.sim.scenario import FAULTS

if TYPE_CHECKING:
    from gpuops.settings import Settings
    from gpuops.sim.fleet import SimFleet

FAULT_CHOICES = [*FAULTS, "lost", "drained"]


@click.command()
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
    from gpuops.sim.fleet import SimFleet

    settings = settings_from(ctx, nats=nats)
    fleet = SimFleet.create(root or settings.state_dir / "sim", nodes, gpus)
    click.echo(f"fleet of {nodes} x {gpus} GPUs at {fleet.root}")
    click.echo(f"inventory: {fleet.write_inventory(inventory_dir or settings.inventory)}")
    if seconds:
        for line in run_async(drive_fleet(settings, fleet, seconds, scenario)):
            click.echo(line)


async def drive_fleet(
    settings: Settings, fleet: SimFleet, seconds: float, scenario: str | None
) -> list[str]:
    """Publish a fleet's events in real time for `seconds`; report whether it kept up."""
    import asyncio

    from gpuops.bus.conn import open_bus
    from gpuops.bus.identity import KeyRing
    from gpuops.clock import ScaledClock
    from gpuops.sim.driver import SimDriver
    from gpuops.sim.scenario import load_scenario
    from gpuops.spine.app import identity_key

    plan = load_scenario(scenario, fleet.nodes) if scenario else None
    keys = KeyRing(identity_key(settings))  # the simulator speaks as each of its nodes
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-simulate") as bus:
        driver = SimDriver(
            fleet, bus, ScaledClock(1.0), plan, probe_s=0 if plan is None else 30.0, keys=keys
        )
        stop = asyncio.Event()
        task = asyncio.create_task(driver.run(stop))
        await asyncio.sleep(seconds)
        stop.set()
        await task
    st = driver.stats
    gpus = fleet.gpus * len(fleet.nodes)
    return [
        f"ticks={st.ticks} late_ticks={st.late_ticks} busy={st.busy_s:.1f}s of {seconds:.0f}s",
        f"telemetry_msgs={st.telemetry} health_msgs={st.health} faults_injected={len(st.injected)}",
        f"nodes={len(fleet.nodes)} gpus={gpus} telemetry_per_s={st.telemetry / seconds:.0f} "
        f"gpu_samples_per_s={st.telemetry * fleet.gpus / seconds:.0f} "
        f"tick_busy_ms={1000 * st.busy_s / max(st.ticks, 1):.0f}",
        f"telemetry_dropped={st.telemetry_dropped} health_retries={st.health_retries} "
        f"health_unsent={st.health_unsent}",
    ]


@click.command("sim-fault")
@click.option(
    "--root", required=True, type=click.Path(exists=True, path_type=Path), help="the fleet"
)
@click.option("--node", required=True)
@click.option("--fault", required=True, type=click.Choice(FAULT_CHOICES))
@click.option("--gpu", type=int, default=0, show_default=True)
@click.option(
    "--param",
    "params",
    multiple=True,
    help="KEY=VALUE, e.g. watts=400, value=false; job: duration=90s name=train; "
    "pod: name=web-0 grace=10s pdb=true",
)
def sim_fault(root: Path, node: str, fault: str, gpu: int, params: tuple[str, ...]) -> None:
    """Put a fault, or running work (a Slurm job, a Kubernetes pod), on a simulated node."""
    import time

    import yaml

    from gpuops.errors import ConfigError
    from gpuops.sim.fleet import SimFleet
    from gpuops.sim.scenario import WORK_PARAMS, check_work
    from gpuops.sim.state import read

    nodes = sorted(p.name for p in (root / "nodes").iterdir())
    if node not in nodes:
        raise click.BadParameter(f"{node!r} is not in the fleet at {root}", param_hint="--node")
    fleet = SimFleet(root=root, nodes=nodes, gpus=len(read(root / "nodes" / node)["gpus"]))
    values = {k: yaml.safe_load(v) for k, _, v in (p.partition("=") for p in params)}
    if fault in WORK_PARAMS:
        try:
            check_work(fault, values)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--param") from exc
    fleet.inject(node, fault, gpu, at=time.time(), **values)
    click.echo(f"{fault} on {node}/{gpu} {values or ''}")


@click.command()
@click.option("--nodes", type=int, default=16, show_default=True)
@click.option("--scenario", default="demo", show_default=True, help="shipped name or a .yml file")
@click.option("--speed", type=float, help="simulated seconds per second [default: 10; peak: 5]")
@click.option("--json-summary", is_flag=True, help="print the summary as JSON")
@click.option("--timeout", type=float, help="wall seconds at most [default: 300; peak: 240]")
@click.option(
    "--http", default="127.0.0.1:0", show_default=True, help="console and /metrics (port 0: any)"
)
@click.option("--linger", type=float, default=0.0, help="keep the console up this long after")
@click.pass_context
def demo(
    ctx: click.Context,
    nodes: int,
    scenario: str,
    speed: float | None,
    json_summary: bool,
    timeout: float | None,
    http: str,
    linger: float,
) -> None:
    """Run the whole loop on a simulated fleet: faults, rules, playbooks, recovery."""
    from gpuops.cli.demo import run_demo

    # budget holds: slower simulated time keeps them inside its override on a loaded host.
    peak = scenario == "peak"
    speed = speed or (5.0 if peak else 10.0)
    # The lost GPU's way back (reboot, grade 2 fails, reprovision, grade 2 passes) is about
    # 1,700 simulated seconds of playbooks: on 2 loaded cores their wall time passed 110 s.
    # A run that handles every fault ends then, so the bound only caps one that does not.
    timeout = timeout or (240.0 if peak else 300.0)

    ok = run_async(
        run_demo(
            nodes=nodes,
            speed=speed,
            json_summary=json_summary,
            timeout_s=timeout,
            state_dir=(ctx.obj or {}).get("state_dir"),
            console=out,
            scenario=scenario,
            http=http,
            linger_s=linger,
        )
    )
    sys.exit(0 if ok else 1)


COMMANDS = [simulate, sim_fault, demo]
