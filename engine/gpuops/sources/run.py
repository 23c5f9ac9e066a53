"""Starting `gpuops ingest prometheus` and `gpuops ingest redfish`: NATS as the agent reaches
it, the loop, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from gpuops import subjects
from gpuops.agent.run import cancel_connecting, close_client, stop_on_signals
from gpuops.agent.spool import Spool
from gpuops.bus.conn import agent_endpoint, connect_forever
from gpuops.bus.embedded import publisher_signer
from gpuops.bus.identity import source as source_identity
from gpuops.bus.publish import JetStreamPublisher, MemoryPublisher, Publisher
from gpuops.clock import SystemClock
from gpuops.errors import EngineError, SourceError
from gpuops.http.server import HttpServer
from gpuops.inventory.hosts import Inventory, load_inventory
from gpuops.match.loader import load_rules
from gpuops.match.rules import RuleSet
from gpuops.settings import Settings
from gpuops.sources.binding import Binding
from gpuops.sources.dra import DraSource, slices_from_api, slices_from_file
from gpuops.sources.prometheus import PromSource, ScrapeReport, SourceMetrics, check_targets
from gpuops.sources.redfish import RedfishSource

log = logging.getLogger(__name__)
SPOOL = "prometheus-source-spool.jsonl"


def binding(settings: Settings) -> tuple[Binding, RuleSet | None]:
    """Targets to the inventory's nodes (read once: restart the source after changing it),
    and the rules the engine runs, to tell which fields they read that the feed lacks."""
    cfg = settings.sources.prometheus
    check_targets(cfg)  # what to give first: without a target, no inventory helps
    inventory = load_inventory(settings.inventory)
    bound = Binding(inventory, cfg.node_label, cfg.target_label)
    return bound, engine_rules(settings, inventory)


def engine_rules(settings: Settings, inventory: Inventory) -> RuleSet | None:
    """The rules of `settings.rules_dir`; None, said once, where they do not load."""
    try:
        return load_rules([settings.rules_dir], settings.playbooks_dir, inventory)
    except EngineError as exc:
        first = str(exc).splitlines()[0]
        log.warning(
            "rules in %s not read (%s): fields the feed lacks are not told",
            settings.rules_dir,
            first,
        )
        return None


@dataclass(frozen=True, slots=True)
class Once:
    """One scrape's events, the XIDs it only remembered (the first value seen is never an
    event), and the targets that answered and placed nothing (with why)."""

    events: list[dict[str, Any]]
    remembered: list[str]
    quiet: dict[str, str]

    def quiet_error(self) -> SourceError | None:
        """What `--once` exits with when a target placed nothing (None when all did)."""
        if not self.quiet:
            return None
        what = "; ".join(f"{t}: {why}" for t, why in self.quiet.items())
        return SourceError("no_series", f"a target answered and placed no series: {what}")


async def ingest_once(settings: Settings) -> Once:
    """One scrape without NATS (checks, debugging); a SourceError when every target failed."""
    with tempfile.TemporaryDirectory() as held:  # a memory publisher never spools
        spool = Spool(Path(held) / "spool.jsonl")
        cfg, publisher = settings.sources.prometheus, MemoryPublisher()
        bound, rules = binding(settings)
        source = PromSource(cfg, bound, publisher, SystemClock(), spool, rules=rules)
        report = await source.scrape_once()
    if report.failed and not report.events:
        what = ", ".join(f"{t} ({why})" for t, why in report.failed.items())
        raise SourceError("down", f"no target answered: {what}")
    return Once(report.events, remembered(source, report), report.quiet)


def remembered(source: PromSource, report: ScrapeReport) -> list[str]:
    """The XIDs DCGM holds that this scrape only remembered, one line each."""
    sent = {(e["node"], e["data"]["gpu"]) for e in report.events if e["kind"] == "xid"}
    return [
        f"{node} GPU {gpu}: last XID {xid} (remembered, not an event: DCGM keeps the last XID "
        "while the driver runs, so it may be old; a change while the source runs is one)"
        for (node, gpu), xid in sorted(source.xids.last.items())
        if xid and (node, gpu) not in sent
    ]


@contextlib.asynccontextmanager
async def source_bus(settings: Settings, name: str) -> AsyncIterator[tuple[Client, Publisher]]:
    """NATS as the agent reaches it, connecting in the background (a source runs whether
    NATS answers or not), and a publisher signing as `source:<name>`: a source may publish
    any node's telemetry and health events, each message saying it is this source's."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    url, credentials = agent_endpoint(settings.nats, settings.state_dir)
    identity = source_identity(name)
    signer = publisher_signer(settings.state_dir, identity, settings.identity.publisher_key)
    nc = Client()
    connecting = asyncio.create_task(
        connect_forever(
            nc,
            url,
            settings.nats,
            credentials,
            name=f"gpuops-ingest-{name}",
            inbox=subjects.inbox_of("source"),
        )
    )
    try:
        yield nc, JetStreamPublisher(nc.jetstream(timeout=5), signer)
    finally:
        await cancel_connecting(connecting)
        await close_client(nc)


async def run_ingest(settings: Settings, http: str | None) -> None:
    """Scrape and publish until SIGINT/SIGTERM, whether NATS answers or not."""
    cfg = settings.sources.prometheus
    stop = stop_on_signals()
    metrics = SourceMetrics()
    bound, rules = binding(settings)
    async with source_bus(settings, "prometheus") as (nc, publisher):
        source = PromSource(
            cfg,
            bound,
            publisher,
            SystemClock(),
            Spool(settings.state_dir / SPOOL, cfg.spool_max),
            metrics,
            connected=lambda: nc.is_connected,
            rules=rules,
        )
        server = HttpServer(
            metrics.registry,
            lambda: (nc.is_connected, {"nats": nc.is_connected}),
            limits=settings.http_limits,
        )
        try:
            if http:
                await server.start(http)
            await source.run(stop)
        finally:
            await server.stop()


async def redfish_once(settings: Settings) -> list[dict[str, Any]]:
    """One poll of every Redfish target without NATS; a SourceError when none answered."""
    cfg = settings.sources.redfish
    if not cfg.targets:
        raise SourceError("no_targets", "no Redfish targets: set sources.redfish.targets")
    source = RedfishSource(
        cfg, load_inventory(settings.inventory), MemoryPublisher(), SystemClock()
    )
    events = await source.poll_once()
    if source.failed and not events:
        what = "; ".join(f"{t}: {why}" for t, why in source.failed.items())
        raise SourceError("down", f"no Redfish target answered: {what}")
    return events


async def run_redfish(settings: Settings) -> None:
    """Poll and publish until SIGINT/SIGTERM, whether NATS and the targets answer or not."""
    cfg = settings.sources.redfish
    if not cfg.targets:
        raise SourceError("no_targets", "no Redfish targets: set sources.redfish.targets")
    stop = stop_on_signals()
    inventory = load_inventory(settings.inventory)
    async with source_bus(settings, "redfish") as (_, publisher):
        await RedfishSource(cfg, inventory, publisher, SystemClock()).run(stop)


def dra_source(
    settings: Settings, publisher: Any, slices: Path | None, interval_s: float
) -> DraSource:
    """The DRA taint source over a file (`kubectl get resourceslices -o json`) or the API."""
    read = (lambda: slices_from_file(slices)) if slices is not None else slices_from_api
    inventory = load_inventory(settings.inventory)
    return DraSource(inventory, publisher, SystemClock(), read, interval_s)


async def run_dra(settings: Settings, slices: Path | None, interval_s: float) -> None:
    """List and publish until SIGINT/SIGTERM, whether NATS and the API answer or not."""
    stop = stop_on_signals()
    async with source_bus(settings, "dra") as (_, publisher):
        await dra_source(settings, publisher, slices, interval_s).run(stop)
