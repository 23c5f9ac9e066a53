"""The NVML backend against answers recorded on a real H200 (including its refusals)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from gpuops.agent.agent import Agent, AgentSettings
from gpuops.agent.nvml import NvmlBackend
from gpuops.clock import ManualClock
from gpuops.errors import SourceError
from gpuops.models import GpuSample
from nats.aio.client import Client

from tests.fake_pynvml import SNAPSHOT, FakeNvml


def test_sample_has_every_signal_the_h200_answered() -> None:
    backend = NvmlBackend(FakeNvml())
    gpus, signals = backend.sample()
    assert signals == []
    gpu = GpuSample.model_validate(gpus[0])  # the event schema accepts it
    dev = SNAPSHOT["devices"][0]
    assert gpu.uuid == dev["uuid"] and gpu.name == "NVIDIA H200"
    assert (gpu.temp_c, gpu.mem_temp_c) == (34, 37)
    assert (gpu.temp_slowdown_c, gpu.temp_shutdown_c, gpu.temp_gpu_max_c, gpu.temp_mem_max_c) == (
        89,
        95,
        87,
        95,
    )
    assert (gpu.power_w, gpu.power_limit_w, gpu.power_default_limit_w) == (112.008, 700.0, 700.0)
    assert (gpu.power_min_limit_w, gpu.power_max_limit_w) == (200.0, 700.0)
    assert (
        gpu.clocks_event_reasons == 1 and gpu.sm_clock_mhz == 375 and gpu.app_clock_sm_mhz == 1980
    )
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.pcie_max_gen, gpu.pcie_max_width) == (5, 16, 5, 16)
    assert gpu.remap_pending is False and gpu.remap_failure is False
    assert gpu.persistence_mode is True and gpu.ecc_mode is True and gpu.mig_mode is False
    assert gpu.mem_total_bytes == dev["memory"]["total"]


def test_not_supported_leaves_the_field_out() -> None:
    nvml = FakeNvml()
    nvml.dev = {
        **nvml.dev,
        "temp_thresholds": {
            **nvml.dev["temp_thresholds"],
            "gpu_slowdown": {"error": "Not Supported"},
        },
    }
    gpus, _ = NvmlBackend(nvml).sample()
    assert "temp_slowdown_c" not in gpus[0]
    assert gpus[0]["temp_c"] == 34


def test_lost_gpu_becomes_one_health_event_and_leaves_the_sample() -> None:
    nvml = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml)
    nvml.lost.add(1)
    gpus, signals = backend.sample()
    assert [g["index"] for g in gpus] == [0]
    assert [(s.kind, s.data["gpu"]) for s in signals] == [("gpu_lost", 1)]
    assert backend.sample()[1] == [], "reported once, not every sample"


def test_xid_and_ecc_events_are_read_with_a_short_timeout() -> None:
    nvml = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml)
    assert backend.wait_events(200) == []  # NVML's Timeout is not an error
    nvml.events.append(
        SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79, device=1)
    )
    nvml.events.append(
        SimpleNamespace(eventType=pynvml.nvmlEventTypeDoubleBitEccError, eventData=0, device=0)
    )
    first, second = backend.wait_events(200), backend.wait_events(200)
    assert first[0].kind == "xid" and first[0].data["xid"] == 79 and first[0].data["gpu"] == 1
    assert second[0].kind == "ecc" and second[0].data == {"gpu": 0, "type": "dbe", "count": 1}
    mask = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
    assert nvml.registered & mask == mask


def test_an_event_wait_nvml_refuses_is_an_error_not_an_empty_answer() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.event_wait_error = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(SourceError, match="GPU is lost"):
        NvmlBackend(nvml).wait_events(200)


async def test_a_failing_event_wait_is_retried_after_a_pause_and_warned_of_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = FakeNvml(gpus=2)
    nvml.event_wait_error = pynvml.NVML_ERROR_GPU_IS_LOST  # answered at once, every time
    settings = AgentSettings(node="n1", spool_path=tmp_path / "spool.jsonl")
    agent = Agent(settings, NvmlBackend(nvml), Client(), ManualClock())
    halt = threading.Event()
    listener = threading.Thread(target=agent._listen, args=(asyncio.get_running_loop(), halt))
    with caplog.at_level(logging.INFO, logger="gpuops.agent.agent"):
        listener.start()
        try:
            await asyncio.sleep(1.5)
            assert nvml.event_waits <= 3, f"{nvml.event_waits} waits in 1.5 s: it spins"
            nvml.event_wait_error = None  # the wait works again: events flow
            nvml.events.append(
                SimpleNamespace(
                    eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79, device=1
                )
            )
            signal = await asyncio.wait_for(agent._signals.get(), 5)
        finally:
            halt.set()
            await asyncio.to_thread(listener.join, 5)
    assert signal.data["xid"] == 79
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in said if level == logging.WARNING] == [
        "NVML event wait failed (NVML: GPU is lost), 1 in a row; trying again"
    ]
    assert any("works again after" in m for level, m in said if level == logging.INFO)


class IndexRefused(FakeNvml):
    """NVML refusing a device's index: `refusal` is the NVML_ERROR_* it answers."""

    def __init__(self, gpus: int, refusal: int) -> None:
        super().__init__(gpus)
        self.refusal = refusal

    def nvmlDeviceGetIndex(self, h: int) -> int:
        raise pynvml.NVMLError(self.refusal)


def _xid_on(device: Any, xid: int = 79) -> SimpleNamespace:
    return SimpleNamespace(
        eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid, device=device
    )


@pytest.mark.parametrize("refusal", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_GPU_IS_LOST])
def test_an_events_gpu_is_its_handles_whatever_nvml_says_of_its_index(refusal: int) -> None:
    nvml = IndexRefused(gpus=4, refusal=refusal)  # XID 79: the GPU has fallen off the bus
    backend = NvmlBackend(nvml)
    nvml.events.append(_xid_on(3))
    [signal] = backend.wait_events(200)
    assert (signal.kind, signal.data["gpu"], signal.data["xid"]) == ("xid", 3, 79)


def test_an_event_from_an_unknown_handle_is_dropped_never_put_on_gpu_0() -> None:
    nvml = FakeNvml(gpus=4)
    backend = NvmlBackend(nvml)
    nvml.events.append(_xid_on(7))
    assert backend.wait_events(200) == []
    assert backend.unmapped_events == 1


class PointerHandles(FakeNvml):
    """Handles as pynvml gives them: ctypes pointers, a new object for each event read."""

    def __init__(self, gpus: int) -> None:
        super().__init__(gpus)
        self.devices = (ctypes.c_char * gpus)()  # one byte each: distinct addresses

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return self.handle(i)

    def handle(self, i: int) -> Any:
        return ctypes.cast(ctypes.addressof(self.devices) + i, pynvml.c_nvmlDevice_t)


def test_an_events_handle_is_matched_by_address_as_pynvml_hands_out_new_pointers() -> None:
    nvml = PointerHandles(gpus=4)
    backend = NvmlBackend(nvml)
    nvml.events.append(_xid_on(nvml.handle(2)))
    [signal] = backend.wait_events(200)
    assert signal.data["gpu"] == 2
