"""Starting `gpuops ingest prometheus`: NATS as the agent reaches it, the loop, /metrics."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from gpuops.agent.run import cancel_connecting, close_client, stop_on_signals
from gpuops.agent.spool import Spool
from gpuops.bus.conn import agent_endpoint, connect_forever
from gpuops.bus.embedded import publisher_signer
from gpuops.bus.identity import source as source_identity
from gpuops.bus.publish import JetStreamPublisher, MemoryPublisher
from gpuops.clock import SystemClock
from gpuops.errors import SourceError
from gpuops.http.server import HttpServer
from gpuops.inventory.hosts import load_inventory
from gpuops.settings import Settings
from gpuops.sources.binding import Binding
from gpuops.sources.prometheus import PromSource, SourceMetrics, check_targets

log = logging.getLogger(__name__)
SPOOL = "prometheus-source-spool.jsonl"


def binding(settings: Settings) -> Binding:
    """Targets to the inventory's nodes (read once: restart the source after changing it)."""
    cfg = settings.sources.prometheus
    check_targets(cfg)  # what to give first: without a target, no inventory helps
    return Binding(load_inventory(settings.inventory), cfg.node_label, cfg.target_label)


async def ingest_once(settings: Settings) -> list[dict[str, Any]]:
    """One scrape without NATS: the events it would publish (checks, debugging); a
    SourceError when every target failed."""
    with tempfile.TemporaryDirectory() as held:  # a memory publisher never spools
        spool = Spool(Path(held) / "spool.jsonl")
        cfg, publisher = settings.sources.prometheus, MemoryPublisher()
        source = PromSource(cfg, binding(settings), publisher, SystemClock(), spool)
        report = await source.scrape_once()
    if report.failed and not report.events:
        what = ", ".join(f"{t} ({why})" for t, why in report.failed.items())
        raise SourceError("down", f"no target answered: {what}")
    return report.events


async def run_ingest(settings: Settings, http: str | None) -> None:
    """Scrape and publish until SIGINT/SIGTERM, whether NATS answers or not."""
    cfg = settings.sources.prometheus
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    stop = stop_on_signals()
    # The source user may publish any node's telemetry and health events: what this does;
    # each message says it is this source's, with its own key.
    url, credentials = agent_endpoint(settings.nats, settings.state_dir)
    identity = source_identity("prometheus")
    signer = publisher_signer(settings.state_dir, identity, settings.identity.publisher_key)
    nc = Client()
    connecting = asyncio.create_task(
        connect_forever(nc, url, settings.nats, credentials, name="gpuops-ingest-prometheus")
    )
    metrics = SourceMetrics()
    source = PromSource(
        cfg,
        binding(settings),
        JetStreamPublisher(nc.jetstream(timeout=5), signer),
        SystemClock(),
        Spool(settings.state_dir / SPOOL, cfg.spool_max),
        metrics,
        connected=lambda: nc.is_connected,
    )
    server = HttpServer(metrics.registry, lambda: (nc.is_connected, {"nats": nc.is_connected}))
    try:
        if http:
            await server.start(http)
        await source.run(stop)
    finally:
        await server.stop()
        await cancel_connecting(connecting)
        await close_client(nc)
