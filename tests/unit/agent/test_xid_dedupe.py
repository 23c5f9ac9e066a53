"""One (gpu, xid) per window, whichever path (NVML events, kernel log) reports it first."""

from __future__ import annotations

from pathlib import Path

from gpuops.agent.agent import Agent, AgentSettings
from gpuops.agent.backend import HealthSignal
from gpuops.agent.nvml import NvmlBackend
from gpuops.clock import ManualClock
from nats.aio.client import Client

from tests.fake_pynvml import FakeNvml


def _agent(tmp_path: Path, clock: ManualClock) -> Agent:
    settings = AgentSettings(node="n1", spool_path=tmp_path / "spool.jsonl", xid_dedupe_s=30)
    return Agent(settings, NvmlBackend(FakeNvml(gpus=2)), Client(), clock)


def test_the_second_report_within_the_window_is_dropped_whatever_its_path(tmp_path: Path) -> None:
    clock = ManualClock()
    agent = _agent(tmp_path, clock)
    nvml = HealthSignal("xid", {"gpu": 1, "xid": 79, "message": "NVML XID event"})
    kmsg = HealthSignal("xid", {"gpu": 1, "xid": 79, "message": "GPU has fallen off"}, "kmsg")
    assert not agent._duplicate(kmsg)
    clock.advance(2)
    assert agent._duplicate(nvml) and agent.xid_duplicates == 1
    assert not agent._duplicate(HealthSignal("xid", {"gpu": 0, "xid": 79}, "kmsg")), "other GPU"
    assert not agent._duplicate(HealthSignal("xid", {"gpu": 1, "xid": 48}, "kmsg")), "other XID"


def test_after_the_window_the_same_xid_is_a_new_event(tmp_path: Path) -> None:
    clock = ManualClock()
    agent = _agent(tmp_path, clock)
    signal = HealthSignal("xid", {"gpu": 0, "xid": 13}, "kmsg")
    assert not agent._duplicate(signal)
    clock.advance(20)
    assert agent._duplicate(signal), "the window runs from the first report, not the last"
    clock.advance(11)
    assert not agent._duplicate(signal)


def test_other_kinds_are_never_deduplicated(tmp_path: Path) -> None:
    agent = _agent(tmp_path, ManualClock())
    sxid = HealthSignal("sxid", {"switch": "nvidia-nvswitch0", "sxid": 24007}, "kmsg")
    assert not agent._duplicate(sxid) and not agent._duplicate(sxid)
