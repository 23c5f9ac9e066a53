"""`gpuops ingest`: telemetry from what a fleet already runs, instead of the agent."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from gpuops.cli.terminal import run_async, settings_from

F = TypeVar("F", bound=Callable[..., Any])


@click.group()
def ingest() -> None:
    """Publish telemetry that other monitoring already collects (see docs/sources.md)."""


@ingest.command("prometheus")
@click.option("--target", "targets", multiple=True, help="a dcgm-exporter /metrics URL (repeat)")
@click.option("--prometheus", help="a Prometheus server's URL, asked with /api/v1/query")
@click.option("--selector", help='label matchers for the Prometheus query, e.g. job="dcgm"')
@click.option("--interval", type=float, help="seconds between scrapes (default 10)")
@click.option("--timeout", type=float, help="seconds each target may take (default 5)")
@click.option(
    "--inventory", type=click.Path(path_type=Path), help="the nodes targets are (by host/address)"
)
@click.option("--node-label", help="the exporter's own host name label, checked (default Hostname)")
@click.option("--target-label", help="a label Prometheus sets per target naming its node")
@click.option("--nats", help="NATS URL (default: the settings' or the state dir's embedded one)")
@click.option("--http", help="host:port for /metrics and /healthz of this source")
@click.option("--once", is_flag=True, help="scrape once and print the events, without NATS")
@click.pass_context
def prometheus(ctx: click.Context, /, **opts: Any) -> None:
    """Scrape dcgm-exporter (or Prometheus) every interval; publish telemetry and XID events."""
    from gpuops.sources.run import ingest_once, run_ingest

    over = {
        "targets": opts["targets"] or None,
        "prometheus": opts["prometheus"],
        "selector": opts["selector"],
        "interval_s": opts["interval"],
        "timeout_s": opts["timeout"],
        "node_label": opts["node_label"],
        "target_label": opts["target_label"],
    }
    # Laid over the settings file's `sources.prometheus`, key by key.
    flags = {k: v for k, v in over.items() if v is not None}
    settings = settings_from(
        ctx,
        nats=opts["nats"],
        inventory=opts["inventory"],
        sources={"prometheus": flags} if flags else None,
    )
    if opts["once"]:
        once = run_async(ingest_once(settings))
        for event in once.events:
            click.echo(json.dumps(event, sort_keys=True))
        for line in once.remembered:  # not an event, so not on stdout (it pipes to `publish`)
            click.echo(line, err=True)
        quiet = once.quiet_error()
        if quiet is not None:
            raise quiet  # exit 1: a check that placed nothing did not pass
        return
    run_async(run_ingest(settings, opts["http"]))


def _polling(inventory: str, verb: str) -> Callable[[F], F]:
    """The options every polling source shares: its inventory, NATS, and --once."""

    def add(command: F) -> F:
        command = click.option(
            "--once", is_flag=True, help=f"{verb} once and print the events, without NATS"
        )(command)
        command = click.option(
            "--nats", help="NATS URL (default: the settings' or the state dir's embedded one)"
        )(command)
        return click.option("--inventory", type=click.Path(path_type=Path), help=inventory)(command)

    return add


@ingest.command("redfish")
@click.option(
    "--target",
    "targets",
    multiple=True,
    metavar="NODE=URL",
    help="a BMC or cooling unit and the inventory host it is (repeat); else the settings'",
)
@click.option("--user", help="the user of --target services")
@click.option("--password-file", type=click.Path(path_type=Path), help="their password, in a file")
@click.option("--ca", type=click.Path(path_type=Path), help="the CA of their certificates (https)")
@click.option("--interval", type=float, help="seconds between polls (default 30)")
@_polling("the hosts targets speak for, and their domains", "poll")
@click.pass_context
def redfish(ctx: click.Context, /, **opts: Any) -> None:
    """Poll BMCs and cooling units over Redfish; publish facility events (inlet and coolant
    temperatures, flow, pumps, fans, PSU power, leak detectors)."""
    from gpuops.sources.run import redfish_once, run_redfish

    flags: dict[str, Any] = {}
    if opts["targets"]:
        flags["targets"] = [
            _target(t, opts["user"], opts["password_file"], opts["ca"]) for t in opts["targets"]
        ]
    if opts["interval"] is not None:
        flags["interval_s"] = opts["interval"]
    settings = settings_from(
        ctx,
        nats=opts["nats"],
        inventory=opts["inventory"],
        sources={"redfish": flags} if flags else None,
    )
    if opts["once"]:
        for event in run_async(redfish_once(settings)):
            click.echo(json.dumps(event, sort_keys=True))
        return
    run_async(run_redfish(settings))


def _target(text: str, user: str | None, password: Path | None, ca: Path | None) -> dict[str, Any]:
    node, sep, url = text.partition("=")
    if not sep or not node or not url:
        raise click.BadParameter(f"{text!r}: write NODE=URL (node-001=https://10.0.0.11)")
    return {"node": node, "url": url, "user": user or "", "password_file": password, "ca": ca}


@ingest.command("dra")
@click.option(
    "--slices",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="read `kubectl get resourceslices -o json` output instead of the API",
)
@click.option(
    "--interval", type=float, default=30.0, show_default=True, help="seconds between reads"
)
@_polling("the hosts the slices' nodes are", "read")
@click.pass_context
def dra(ctx: click.Context, /, **opts: Any) -> None:
    """Publish the Kubernetes DRA driver's device taints (ResourceSlices) as dra_taint events."""
    from gpuops.bus.publish import MemoryPublisher
    from gpuops.sources.run import dra_source, run_dra

    settings = settings_from(ctx, nats=opts["nats"], inventory=opts["inventory"])
    if opts["once"]:
        source = dra_source(settings, MemoryPublisher(), opts["slices"], opts["interval"])
        for event in run_async(source.poll_once()):
            click.echo(json.dumps(event, sort_keys=True))
        for node in sorted(source.unknown):
            click.echo(f"{node}: not in the inventory, its taints not published", err=True)
        return
    run_async(run_dra(settings, opts["slices"], opts["interval"]))


COMMANDS = [ingest]
