"""The Prometheus / dcgm-exporter source against real peers: an HTTP server serving a
dcgm-exporter page, a real Prometheus scraping it, a real nats-server."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from gpuops import subjects
from gpuops.agent.spool import Spool
from gpuops.bus.conn import Bus
from gpuops.bus.publish import JetStreamPublisher, MemoryPublisher
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ManualClock
from gpuops.models import EVENT_ADAPTER
from gpuops.settings import PrometheusSourceSettings
from gpuops.sources.binding import Binding
from gpuops.sources.prometheus import PromSource, SourceMetrics

from tests.conftest import wait_for
from tests.dcgm_exposition import exposition, inventory, serve
from tests.support import AsEvents, ask
from tests.support import prometheus as run_prometheus

pytestmark = pytest.mark.integration
NODE = "gpu-node-07"
# Each node's exporter on an address of its own, as on a fleet (Linux answers all of 127/8).
FLEET = inventory(**{NODE: "127.0.0.1", "gpu-node-08": "127.0.0.2"})


@dataclass
class Exporter:
    """A local HTTP server playing dcgm-exporter (and a few broken ones)."""

    port: int = 0
    pages: dict[str, str] = field(default_factory=lambda: {"/metrics": exposition()})

    def url(self, path: str = "/metrics") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@pytest.fixture
async def exporter() -> AsyncIterator[Exporter]:
    ex = Exporter()

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)  # the source gives up after its 1 s timeout
        return web.Response(text="")

    async def huge(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(64):  # 4 MiB without a Content-Length, against a 1 MiB cap
            await resp.write(b"#" * (1 << 16))
        return resp

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>login</body></html>", content_type="text/html")

    async def failing(request: web.Request) -> web.Response:
        return web.Response(text="oops", status=500)

    broken = [web.get("/slow", slow), web.get("/huge", huge), web.get("/html", html)]
    async with serve(ex.pages, [*broken, web.get("/500", failing)]) as port:
        ex.port = port
        yield ex


def _source(
    tmp_path: Path, publisher: Any, clock: ManualClock | None = None, **over: Any
) -> PromSource:
    cfg = PrometheusSourceSettings.model_validate({"timeout_s": 1.0, **over})
    spool = Spool(tmp_path / "spool.jsonl")
    binding = Binding(FLEET, cfg.node_label, cfg.target_label)
    return PromSource(cfg, binding, publisher, clock or ManualClock(1_800_000_000.0), spool)


def _published(publisher: MemoryPublisher) -> list[dict[str, Any]]:
    read = AsEvents()
    return [read(payload) for _, payload in publisher.messages]


@pytest.fixture
async def node2() -> AsyncIterator[str]:
    """gpu-node-08's exporter (two GPUs) on its own address; its /metrics URL."""
    async with serve({"/metrics": exposition(node="gpu-node-08", gpus=2)}, host="127.0.0.2") as p:
        yield f"http://127.0.0.2:{p}/metrics"


async def test_a_down_slow_huge_or_garbage_target_is_counted_and_the_others_go_on(
    tmp_path: Path, exporter: Exporter, node2: str
) -> None:
    broken = {
        "http://127.0.0.1:1/metrics": "down",
        exporter.url("/slow"): "timeout",
        exporter.url("/huge"): "too_large",
        exporter.url("/html"): "garbage",
        exporter.url("/500"): "http_status",
    }
    publisher = MemoryPublisher()
    source = _source(
        tmp_path,
        publisher,
        targets=[exporter.url(), *broken, node2],
        max_bytes=1 << 20,
    )
    report = await source.scrape_once()
    assert report.failed == broken
    events = _published(publisher)
    assert sorted((e["node"], len(e["data"]["gpus"])) for e in events) == [
        ("gpu-node-07", 8),
        ("gpu-node-08", 2),
    ]
    for e in events:
        EVENT_ADAPTER.validate_python(e)  # what the engine will decode
        assert (e["kind"], e["source"]) == ("telemetry", "prometheus")
        assert e["ts"] == "2027-01-15T08:00:00.000Z"  # the injected clock at the scrape
    outcomes: Counter[str] = Counter()
    for sample in _samples(source.metrics, "scrapes"):
        outcomes[sample.labels["outcome"]] += int(sample.value)
    assert outcomes == Counter(ok=2, down=1, timeout=1, too_large=1, garbage=1, http_status=1)


def _samples(metrics: SourceMetrics, name: str) -> list[Any]:
    counter = getattr(metrics, name)
    return [s for f in counter.collect() for s in f.samples if s.name.endswith("_total")]


async def test_nats_going_away_drops_telemetry_spools_xids_and_sends_them_on_return(
    tmp_path: Path, exporter: Exporter, nats_server: EmbeddedNats, bus: Bus
) -> None:
    seen: list[dict[str, Any]] = []
    read = AsEvents()

    async def keep(msg: Any) -> None:
        seen.append(read(msg.data))

    watcher = await _watcher(nats_server.url, keep)
    clock = ManualClock(1_800_000_000.0)
    source = _source(
        tmp_path, JetStreamPublisher(bus.js), clock, targets=[exporter.url()], timeout_s=2.0
    )
    source.connected = lambda: bus.nc.is_connected
    await source.scrape_once()  # the XID value (0) is remembered, not an event
    await wait_for(lambda: [e["kind"] for e in seen] == ["telemetry"], 10)

    nats_server.stop()
    await wait_for(lambda: not bus.nc.is_connected, 10)
    exporter.pages["/metrics"] = exposition(overrides={2: {"DCGM_FI_DEV_XID_ERRORS": 79}})
    clock.advance(10)
    report = await source.scrape_once()
    assert [e["kind"] for e in report.events] == ["xid", "telemetry"]
    assert len(source.spool) == 1
    events = {
        (s.labels["kind"], s.labels["outcome"]): s.value for s in _samples(source.metrics, "events")
    }
    assert events == {("telemetry", "published"): 1, ("telemetry", "dropped"): 1} | {
        ("xid", "spooled"): 1
    }

    nats_server.start()
    await wait_for(lambda: bus.nc.is_connected and watcher.is_connected, 20)
    clock.advance(10)
    await source.scrape_once()
    await wait_for(lambda: len(seen) == 3, 10)
    xid = seen[1]
    assert (xid["kind"], xid["node"], xid["data"]["gpu"], xid["data"]["xid"]) == (
        "xid",
        NODE,
        2,
        79,
    )
    assert xid["ts"] == report.events[0]["ts"]  # the time it was seen, not when it went out
    assert len(source.spool) == 0
    await watcher.close()


async def _watcher(url: str, cb: Any) -> Any:
    """A plain subscriber on every gpuops subject (it reconnects like the others)."""
    import nats

    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await nc.subscribe("gpuops.>", cb=cb)
    return nc


@pytest.fixture
def prometheus(tmp_path: Path, exporter: Exporter) -> Iterator[str]:
    """/usr/bin/prometheus scraping the exporter every second; its base URL."""
    job = f"  - job_name: dcgm\n    static_configs: [{{targets: ['127.0.0.1:{exporter.port}']}}]\n"
    with run_prometheus(tmp_path, job) as url:
        yield url


async def _series_in(prometheus: str, query: str) -> int:
    return len(await ask(prometheus, query))


async def test_a_real_prometheus_query_becomes_telemetry_on_real_nats(
    tmp_path: Path, exporter: Exporter, prometheus: str, bus: Bus
) -> None:
    exporter.pages["/metrics"] = exposition(overrides={3: {"DCGM_FI_DEV_GPU_TEMP": 92}})
    await wait_for(lambda: _has_every_gpu(prometheus), 15, 0.3)
    seen: list[dict[str, Any]] = []
    read = AsEvents()

    async def keep(msg: Any) -> None:
        seen.append(read(msg.data))

    sub = await bus.nc.subscribe("gpuops.telemetry.>", cb=keep)
    clock = ManualClock(1_800_000_000.0)
    source = _source(
        tmp_path, JetStreamPublisher(bus.js), clock, prometheus=prometheus, selector='job="dcgm"'
    )
    report = await source.scrape_once()
    assert report.failed == {}
    await wait_for(lambda: len(seen) == 1, 10)
    (event,) = seen
    assert (event["node"], event["source"], event["ts"]) == (
        NODE,
        "prometheus",
        report.events[0]["ts"],
    )
    gpus = {g["index"]: g for g in event["data"]["gpus"]}
    assert sorted(gpus) == list(range(8))
    assert gpus[3]["temp_c"] == 92 and gpus[2]["temp_c"] == 34
    assert gpus[3]["temp_slowdown_c"] == 89 and gpus[3]["power_w"] == 112.008
    assert gpus[3]["pod"] == "llama-pretrain-0" and gpus[3]["namespace"] == "ml-train"
    # Prometheus's own target labels come along with dcgm-exporter's.
    assert gpus[3]["labels"]["job"] == "dcgm" and gpus[3]["labels"]["Hostname"] == NODE
    stored = await bus.js.get_last_msg("GPUOPS_TELEMETRY", subjects.stored_telemetry(NODE))
    assert AsEvents()(stored.data)["id"] == event["id"]
    await sub.unsubscribe()


async def _has_every_gpu(prometheus: str) -> bool:
    return await _series_in(prometheus, "DCGM_FI_DEV_GPU_TEMP") == 8 and (
        await _series_in(prometheus, "DCGM_FI_DEV_GPU_TEMP == 92") == 1
    )
