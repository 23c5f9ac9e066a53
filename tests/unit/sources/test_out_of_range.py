"""Review D: finite values past any reading. Two of 1e308, summed (FB used + free where
the page has no FB_TOTAL, or one counter's NVLink links), made inf, and round(inf) raised
out of the scrape before anything was published: one exporter's page stopped every
node's telemetry and XID events. Such a value is refused (`out_of_range`), and a GPU
whose conversion still raises loses its own sample only."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpuops.agent.spool import Spool
from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.settings import PrometheusSourceSettings
from gpuops.sources.binding import Binding
from gpuops.sources.prometheus import PromSource, parse_exposition
from gpuops.sources.readings import GpuReading, NodeReading, group, telemetry_event

from tests.dcgm_exposition import exposition, inventory, labels, serve
from tests.support import AsEvents

BAD, GOOD = "gpu-node-07", "gpu-node-08"
T = 1_800_000_000.0
HUGE = 1e308
FB_USED, FB_FREE = "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"
CRC = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"


def _fb_page() -> str:
    """One GPU whose FB used and free are 1e308 each; the page has no FB_TOTAL."""
    return exposition(BAD, gpus=1, overrides={0: {FB_USED: HUGE, FB_FREE: HUGE}})


def _nvlink_page() -> str:
    """One GPU whose CRC counter comes per link, 1e308 on each of two links."""
    page = exposition(BAD, gpus=1)
    whole = f"{CRC}{{{labels(BAD, 0)}}} 0\n"
    per_link = "".join(f'{CRC}{{{labels(BAD, 0)},link="{i}"}} {HUGE}\n' for i in (0, 1))
    assert whole in page
    return page.replace(whole, per_link)


# page, the fields its huge values would have filled
PAGES: dict[str, tuple[Callable[[], str], set[str]]] = {
    "fb_used_and_free": (_fb_page, {"mem_used_bytes", "mem_total_bytes"}),
    "nvlink_crc_per_link": (_nvlink_page, {"nvlink_crc_errors"}),
}


@pytest.mark.parametrize("case", sorted(PAGES))
def test_a_value_past_any_reading_is_refused_and_the_gpu_keeps_the_rest(case: str) -> None:
    page, fields = PAGES[case]
    dropped: Counter[str] = Counter()
    nodes = group({BAD: parse_exposition(page(), 1000, dropped)}, "gpu", dropped)
    event = telemetry_event(BAD, nodes[BAD], T, dropped)
    assert dropped == Counter({"out_of_range": 2})
    assert event is not None
    (gpu,) = event["data"]["gpus"]
    assert not fields & set(gpu) and gpu["temp_c"] == 34


@pytest.mark.parametrize("case", sorted(PAGES))
async def test_one_exporters_huge_values_leave_the_other_nodes_published(
    tmp_path: Path, case: str
) -> None:
    page, fields = PAGES[case]
    async with (
        serve({"/metrics": page()}) as bad,
        serve({"/metrics": exposition(GOOD, gpus=2)}, host="127.0.0.2") as good,
    ):
        targets = [f"http://127.0.0.1:{bad}/metrics", f"http://127.0.0.2:{good}/metrics"]
        cfg = PrometheusSourceSettings.model_validate({"timeout_s": 5.0, "targets": targets})
        fleet = Binding(inventory(**{BAD: "127.0.0.1", GOOD: "127.0.0.2"}), cfg.node_label)
        publisher = MemoryPublisher()
        source = PromSource(cfg, fleet, publisher, ManualClock(T), Spool(tmp_path / "s.jsonl"))
        report = await source.scrape_once()
    assert not report.failed and report.dropped["out_of_range"] == 2
    read = AsEvents()
    events: dict[str, dict[str, Any]] = {}
    for _, payload in publisher.messages:
        event = read(payload)
        events[event["node"]] = event
    assert sorted(events) == [BAD, GOOD]
    assert len(events[GOOD]["data"]["gpus"]) == 2
    (bad_gpu,) = events[BAD]["data"]["gpus"]
    assert not fields & set(bad_gpu) and bad_gpu["temp_c"] == 34


def test_a_gpu_whose_conversion_raises_loses_only_its_own_sample(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever else a conversion may raise (here the sum that overflowed, handed in
    past the bound) costs that GPU's sample, counted and logged with its node."""
    gl = {"gpu": "0", "Hostname": BAD}
    broken = GpuReading(gl, {FB_USED: {"": HUGE}, FB_FREE: {"": HUGE}})
    healthy = GpuReading({**gl, "gpu": "1"}, {"DCGM_FI_DEV_GPU_TEMP": {"": 40.0}})
    dropped: Counter[str] = Counter()
    with caplog.at_level(logging.WARNING, logger="gpuops.sources.readings"):
        event = telemetry_event(BAD, NodeReading({0: broken, 1: healthy}), T, dropped)
    assert event is not None
    assert [(g["index"], g["temp_c"]) for g in event["data"]["gpus"]] == [(1, 40.0)]
    assert dropped == Counter({"invalid": 1})
    assert f"node {BAD} GPU 0: not a valid sample" in caplog.text
