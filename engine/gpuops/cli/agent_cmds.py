"""The `gpuops agent` command, run on every GPU node."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from gpuops.agent.backend import GpuBackend
from gpuops.cli.terminal import err, run_async, settings_from
from gpuops.errors import ConfigError, EngineError


@click.command()
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
@click.option(
    "--ib-root",
    help="InfiniBand sysfs root, 'off' for none [default: /sys/class/infiniband; "
    "backend sim: the node's own tree]",
)
@click.option(
    "--kmsg",
    help="kernel log to follow for XID/SXid lines, 'off' for none [default: /dev/kmsg; "
    "backend sim: the node's kmsg file]",
)
@click.option("--once", is_flag=True, help="one telemetry event and probe results, no NATS")
@click.option(
    "--health-check",
    is_flag=True,
    help="one reading checked, as an NHC check: exit 1 and say why when unfit (never drains)",
)
@click.option("--expect-gpus", type=int, help="with --health-check: the GPUs the node must have")
@click.option("--json", "as_json", is_flag=True, help="with --once: JSON lines on stdout")
@click.pass_context
def agent(ctx: click.Context, /, **opts: Any) -> None:
    """The node agent: NVML telemetry, XID/ECC events, probes and heartbeats to NATS."""
    from gpuops.agent.run import agent_once, run_agent

    settings = settings_from(ctx, nats=opts.pop("nats"))
    if opts["health_check"]:
        sys.exit(_health_check(opts))
    if opts["once"]:
        try:
            lines = agent_once(opts, make_backend(opts))
        except EngineError as exc:
            err.print(f"error: {exc}", markup=False)
            sys.exit(2)
        for line in lines:
            click.echo(json.dumps(line, sort_keys=True) if opts["as_json"] else str(line))
        return
    run_async(run_agent(settings, opts, make_backend(opts)))


def _health_check(opts: dict[str, Any]) -> int:
    """Slurm's (or NHC's) node health check: its findings on stdout, exit 0 fit, 1 unfit,
    2 when the check itself could not run (NVML missing)."""
    from gpuops.agent.agent import default_node
    from gpuops.agent.healthcheck import check

    node = opts.get("node") or os.environ.get("SLURMD_NODENAME") or default_node()
    try:
        lines, status = check(make_backend(opts), node, opts["expect_gpus"])
    except EngineError as exc:
        err.print(f"ERROR: gpuops: health check could not run: {exc}", markup=False)
        return 2
    for line in lines:
        click.echo(line)
    return status


def make_backend(opts: dict[str, Any]) -> GpuBackend:
    """The NVML backend, or one simulated node (the CLI chooses: agent/ knows no sim)."""
    if opts["backend"] == "sim":
        if not opts.get("sim_root") or not opts.get("node"):
            raise ConfigError("--backend sim needs --sim-root and --node")
        from gpuops.sim.nodebackend import SimBackend

        return SimBackend(Path(opts["sim_root"]), opts["node"])
    from gpuops.agent.nvml import NvmlBackend

    try:
        return NvmlBackend()
    except Exception as exc:
        raise ConfigError(f"NVML is not available on this host: {exc}") from exc


COMMANDS = [agent]
