"""The NVML backend against answers recorded on a real H200 (including its refusals)."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
from gpuops.agent.nvml import NvmlBackend
from gpuops.models import GpuSample

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
