"""Issue 14: a dcgm-exporter scrape of an 8-GPU node with one GPU at 92 C (slowdown 89 C)
for two minutes leads, through the shipped rules, to the same drain the agent's events do.

Both paths read the same H200 (the recorded NVML snapshot, GPU 3 at 92 C) every 10 s,
the agent's interval, for two minutes: one through the NVML backend as the agent
samples it, one as dcgm-exporter's page scraped over HTTP by `scrape_once` with a
manual clock. Each path's published events are written as JSON lines and replayed by
`gpuops replay`'s engine (the shadow pipeline on in-memory buckets).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpuops.agent.agent import event as agent_event
from gpuops.agent.nvml import NvmlBackend
from gpuops.agent.spool import Spool
from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.match.loader import load_rules
from gpuops.settings import PrometheusSourceSettings
from gpuops.sources.binding import Binding
from gpuops.sources.prometheus import PromSource
from gpuops.spine.replay import replay_file

from tests.conftest import ROOT
from tests.dcgm_exposition import exposition, inventory, serve
from tests.fake_pynvml import FakeNvml
from tests.support import AsEvents

pytestmark = pytest.mark.integration
NODE, HOT, T0 = "gpu-node-07", 3, 1_800_000_000.0
EVERY_S, FOR_S = 10.0, 120.0  # the agent's default interval; two minutes


class HotNvml(FakeNvml):
    """The recorded H200, eight of them, GPU 3 at 92 C."""

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 92 if h == HOT else super().nvmlDeviceGetTemperature(h, sensor)


def _times() -> list[float]:
    return [T0 + i * EVERY_S for i in range(int(FOR_S / EVERY_S) + 1)]


def _agent_events() -> list[dict[str, Any]]:
    backend = NvmlBackend(HotNvml(gpus=8))
    return [agent_event("telemetry", NODE, t, {"gpus": backend.sample()[0]}) for t in _times()]


async def _dcgm_events(tmp_path: Path) -> list[dict[str, Any]]:
    page = exposition(node=NODE, overrides={HOT: {"DCGM_FI_DEV_GPU_TEMP": 92}})
    clock, publisher = ManualClock(T0), MemoryPublisher()
    async with serve({"/metrics": page}) as port:
        cfg = PrometheusSourceSettings(targets=(f"http://127.0.0.1:{port}/metrics",))
        binding = Binding(inventory(**{NODE: "127.0.0.1"}))
        source = PromSource(cfg, binding, publisher, clock, Spool(tmp_path / "spool.jsonl"))
        for t in _times():
            clock.set(t)
            report = await source.scrape_once()
            assert report.failed == {}
    read = AsEvents()  # v2 telemetry, as the source sends it, joined to its keyframes
    return [read(payload) for _, payload in publisher.messages]


def _recording(events: list[dict[str, Any]], path: Path) -> Path:
    """The events as `gpuops export` writes them and `gpuops replay` reads them."""
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


async def _would_run(events: list[dict[str, Any]], path: Path) -> list[dict[str, object]]:
    _recording(events, path)
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    actions, stats = await replay_file(path, rules, None)
    assert stats == {"events": len(events), "bad": 0}
    return [a.as_dict() for a in actions]


async def test_a_hot_gpu_seen_by_dcgm_exporter_is_drained_as_the_agent_would(
    tmp_path: Path,
) -> None:
    dcgm = await _dcgm_events(tmp_path)
    assert {(e["kind"], e["source"]) for e in dcgm} == {("telemetry", "prometheus")}
    assert len(dcgm) == len(_times())
    hot = dcgm[0]["data"]["gpus"][HOT]
    assert (hot["temp_c"], hot["temp_slowdown_c"]) == (92, 89)

    by_dcgm = await _would_run(dcgm, tmp_path / "dcgm.jsonl")
    by_agent = await _would_run(_agent_events(), tmp_path / "agent.jsonl")

    drains = [a for a in by_dcgm if a["action"] == "drain.yml"]
    assert [(a["rule"], a["node"], a["gpus"]) for a in drains] == [("gpu-overheat", NODE, [HOT])]
    assert drains[0]["ts"] == "2027-01-15T08:01:00.000Z"  # held for the rule's 60 s
    assert by_dcgm == by_agent  # every decision, at the same event time
    # Neither path sends heartbeats, so agent-silent fires in both: what
    # `gpuops validate --source dcgm` warns of where no agent runs.
    assert {a["rule"] for a in by_dcgm} == {"gpu-overheat", "agent-silent"}
