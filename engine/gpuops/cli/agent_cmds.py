"""The `gpuops agent` command, run on every GPU node."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from gpuops.agent.backend import GpuBackend
from gpuops.cli.terminal import err, run_async, settings_from, telemetry_format_option
from gpuops.clock import rfc3339
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
@click.option(
    "--topology",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="the topology manifest this node is held to (gpuops topology learn writes one)",
)
@click.option(
    "--topology-every", type=float, default=300.0, show_default=True, help="seconds between checks"
)
@telemetry_format_option("what the agent sends (1 for an engine older than v2)")
@click.option(
    "--keyframe-every",
    type=float,
    default=120.0,
    show_default=True,
    help="format 2: seconds between the samples that carry the static facts again",
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


@click.group()
def topology() -> None:
    """Topology as code: the manifest a node is held to (docs/operations.md, Topology)."""


def _backend_options(command: Any) -> Any:
    for option in reversed(
        [
            click.argument("node"),
            click.option("--backend", type=click.Choice(["nvml", "sim"]), default="nvml"),
            click.option("--sim-root", type=click.Path(path_type=Path)),
            click.option("--ib-root", help="InfiniBand sysfs root, 'off' for none"),
        ]
    ):
        command = option(command)
    return command


@topology.command("learn")
@_backend_options
@click.option("--sku", default="h200-8gpu", show_default=True, help="the SKU the manifest is for")
@click.option("--out", type=click.Path(path_type=Path), help="write here (default: stdout)")
def topology_learn(node: str, sku: str, out: Path | None, **opts: Any) -> None:
    """Write a manifest from NODE, a known-good node (run it on that node): every GPU at
    its link's maximum, its NUMA node and NVLink links, every HCA and its nearest GPU."""
    from gpuops.diagnose.topology import dump, learned

    seen = _observe(node, opts, maxima=True)
    text = dump(learned(seen, node, sku, rfc3339(time.time())))
    if out is None:
        click.echo(text, nl=False)
    else:
        out.write_text(text)
        click.echo(f"wrote {out}: {len(seen.gpus)} GPUs, {len(seen.nics)} HCAs from {node}")


@topology.command("check")
@_backend_options
@click.option("--manifest", type=click.Path(path_type=Path, exists=True), required=True)
def topology_check(node: str, manifest: Path, **opts: Any) -> None:
    """NODE against a manifest, now: each difference on a line; exit 1 when any."""
    from gpuops.diagnose.topology import differences, load_manifest

    want = load_manifest(manifest).for_host(node)
    gpus = _sample(node, opts)
    seen = _observe(node, opts, maxima=False, gpus=gpus)
    found = differences(want, seen, {int(g["index"]): g.get("util_gpu") for g in gpus})
    for d in found:
        where = f"GPU {d.gpu}" if d.gpu is not None else d.device
        click.echo(f"{node} {where}: {d.check} {d.actual} (expect {d.expected}): {d.detail}")
    if found:
        sys.exit(1)
    click.echo(f"{node}: as the manifest says ({len(want.gpus)} GPUs, {len(want.nics)} HCAs)")


def _sample(node: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    backend = make_backend({**opts, "node": node})
    try:
        return backend.sample()[0]
    finally:
        backend.close()


def _observe(
    node: str, opts: dict[str, Any], maxima: bool, gpus: list[dict[str, Any]] | None = None
) -> Any:
    from gpuops.agent.infiniband import read_ib
    from gpuops.agent.run import node_paths, sys_root
    from gpuops.agent.topology import observe

    opts = {**opts, "node": node, "kmsg": "off"}
    backend = make_backend(opts)
    try:
        readings = gpus if gpus is not None else backend.sample()[0]
        ib_root = node_paths(opts, node)[0]
        ib = read_ib(ib_root) if ib_root is not None and ib_root.is_dir() else None
        return observe(
            readings, backend.pci_bus_ids(), sys_root(opts, node), ib, ib_root, maxima=maxima
        )
    finally:
        backend.close()


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


COMMANDS = [agent, topology]
