"""Starting the agent from the command line."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError

from gpuops import subjects
from gpuops.agent.agent import Agent, AgentSettings, default_node, event
from gpuops.agent.backend import GpuBackend
from gpuops.agent.infiniband import DEFAULT_ROOT as IB_ROOT
from gpuops.agent.infiniband import read_ib
from gpuops.agent.kmsg import DEFAULT_PATH as KMSG_PATH
from gpuops.agent.probe import run_probe
from gpuops.bus.conn import agent_endpoint, connect_forever
from gpuops.bus.embedded import publisher_signer
from gpuops.bus.identity import node_identity
from gpuops.clock import SystemClock
from gpuops.settings import Settings


def node_paths(opts: dict[str, Any], node: str) -> tuple[Path | None, Path | None]:
    """The InfiniBand sysfs root and the kernel log: given, off, or the backend's default."""
    if opts.get("backend") == "sim" and opts.get("sim_root"):
        node_dir = Path(opts["sim_root"]) / "nodes" / node
        defaults = (node_dir / "sys" / "class" / "infiniband", node_dir / "kmsg")
    else:
        defaults = (IB_ROOT, KMSG_PATH)
    chosen = []
    for given, default in zip((opts.get("ib_root"), opts.get("kmsg")), defaults, strict=True):
        chosen.append(None if given == "off" else Path(given) if given else default)
    return chosen[0], chosen[1]


def sys_root(opts: dict[str, Any], node: str) -> Path:
    """Where sysfs is: /sys, or a simulated node's own tree (its GPUs' NUMA nodes)."""
    if opts.get("backend") == "sim" and opts.get("sim_root"):
        return Path(opts["sim_root"]) / "nodes" / node / "sys"
    return Path(opts.get("sys_root") or "/sys")


def agent_once(opts: dict[str, Any], backend: GpuBackend) -> list[dict[str, Any]]:
    """One telemetry event and a probe result per GPU, without NATS (checks, debugging)."""
    node = opts.get("node") or default_node()
    try:
        gpus, signals = backend.sample()
        now = time.time()
        out = [event("telemetry", node, now, {"gpus": gpus})]
        out += [event(s.kind, node, now, s.data) for s in signals]
        ib_root = node_paths(opts, node)[0]
        ib = read_ib(ib_root) if ib_root is not None else None
        out += [event("ib", node, now, ib)] if ib is not None else []
        command = shlex.split(opts["probe_command"]) if opts.get("probe_command") else None
        for result in run_probe(list(range(backend.gpu_count())), opts["probe_timeout"], command):
            keep = {
                k: v
                for k, v in result.items()
                if k in ("gpu", "ok", "outcome", "error", "duration_s")
            }
            out.append(event("probe", node, time.time(), keep))
        return out
    finally:
        backend.close()


async def run_agent(settings: Settings, opts: dict[str, Any], backend: GpuBackend) -> None:
    """Run until SIGINT/SIGTERM, whether NATS answers or not."""
    node = opts.get("node") or default_node()
    agent_settings = AgentSettings(
        node=node,
        interval_s=opts["interval"],
        heartbeat_s=opts["heartbeat"],
        probe_every_s=opts["probe_every"],
        probe_timeout_s=opts["probe_timeout"],
        probe_command=tuple(shlex.split(opts["probe_command"]))
        if opts.get("probe_command")
        else (),
        spool_path=opts.get("spool") or settings.state_dir / f"agent-{node}-spool.jsonl",
        ib_root=node_paths(opts, node)[0],
        kmsg_path=node_paths(opts, node)[1],
        topology=opts.get("topology"),
        topology_every_s=opts.get("topology_every") or 300.0,
        sys_root=sys_root(opts, node),
        telemetry_format=opts.get("telemetry_format") or 2,
        keyframe_every_s=opts.get("keyframe_every") or 120.0,
    )
    stop = stop_on_signals()
    url, credentials = agent_endpoint(settings.nats, settings.state_dir, node)
    signer = publisher_signer(
        settings.state_dir, node_identity(node), settings.identity.publisher_key
    )
    nc = Client()
    # Connecting runs beside the agent, not before it: with NATS down at boot the agent
    # still samples, spools health events and answers SIGTERM.
    connecting = asyncio.create_task(
        connect_forever(
            nc,
            url,
            settings.nats,
            credentials,
            name=f"gpuops-agent-{node}",
            inbox=subjects.node_inbox(node),
        )
    )
    try:
        await Agent(agent_settings, backend, nc, SystemClock(), signer).run(stop)
    finally:
        await cancel_connecting(connecting)
        await close_client(nc)
        backend.close()


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: a long-running loop's way to end cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def cancel_connecting(task: asyncio.Task[None]) -> None:
    """Cancel until it ends: nats-py's connect loop swallows a cancel that lands in its cleanup."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.2)
    with contextlib.suppress(asyncio.CancelledError, NatsError, OSError, TimeoutError):
        task.result()


async def close_client(nc: Client) -> None:
    """Flush and close a connected client; a client still connecting is just dropped."""
    if not (nc.is_connected or nc.is_reconnecting):
        return  # never connected: there is nothing to flush, and nats-py cannot close it
    with contextlib.suppress(NatsError, OSError, TimeoutError):
        if nc.is_connected:
            await nc.flush(timeout=2)
        await asyncio.wait_for(nc.close(), 5)
