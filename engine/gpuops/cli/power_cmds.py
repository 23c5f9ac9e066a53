"""`gpuops power`: budget overrides (asked of the running engine, as the ChatOps command
`power`) and the budgets' status (read from the bus)."""

from __future__ import annotations

import click

from gpuops.cli.operator_cmds import NATS_HELP, ask
from gpuops.cli.terminal import run_async, settings_from


@click.group()
def power() -> None:
    """Power budgets: overrides and status (docs/power.md)."""


@power.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, required=True)
@click.option("--nats", help=NATS_HELP)
@click.pass_context
def budget(ctx: click.Context, args: tuple[str, ...], nats: str | None) -> None:
    """Set a group's budget for a while, or end it: budget GROUP WATTS DURATION [REASON]
    (e.g. `rack-a1 32kW 2h`), or budget GROUP --end."""
    settings = settings_from(ctx, nats=nats)
    click.echo(run_async(ask(settings, "power", ["budget", *args])))


@power.command()
@click.option("--nats", help=NATS_HELP)
@click.pass_context
def status(ctx: click.Context, nats: str | None) -> None:
    """Budgets now (configured and overrides) and the limits the controller holds."""
    click.echo(run_async(_status(ctx, nats)))


async def _status(ctx: click.Context, nats: str | None) -> str:
    from gpuops.bus.conn import open_bus
    from gpuops.clock import SystemClock
    from gpuops.ops.power import power_status

    settings = settings_from(ctx, nats=nats)
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-cli", role="cli") as bus:
        return await power_status(bus.buckets.control, settings.power, SystemClock().now())


COMMANDS = [power]
