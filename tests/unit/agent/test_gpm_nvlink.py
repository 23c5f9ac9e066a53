"""GPM metrics over two samples and NVLink per link, on a fake device with real pynvml types."""

from __future__ import annotations

import pynvml
from gpuops.agent.nvml import NvmlBackend
from gpuops.models import GpuSample

from tests.fake_pynvml import FakeNvml

BUSY = {
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 71.5,
    pynvml.NVML_GPM_METRIC_SM_UTIL: 98.0,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 42.25,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 63.0,
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: 1024.0,  # MiB/s
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: 512.0,
}
GPM_FIELDS = ("dram_bw_util", "sm_active", "sm_occupancy", "tensor_active")
NVLINK_FIELDS = (
    "nvlink_links_active",
    "nvlink_links_down",
    "nvlink_crc_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
)


def test_gpm_needs_two_intervals_then_reports_the_difference() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.gpm = {0: BUSY, 1: {pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 12.0}}
    backend = NvmlBackend(nvml)
    first, _ = backend.sample()
    assert not any(f in first[0] for f in GPM_FIELDS), "one sample has nothing to compare with"
    nvml.gpm[0] = {**BUSY, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 20.0}
    second, _ = backend.sample()
    gpu = GpuSample.model_validate(second[0])
    assert (gpu.dram_bw_util, gpu.sm_active, gpu.sm_occupancy, gpu.tensor_active) == (
        20.0,
        98.0,
        42.25,
        63.0,
    )
    assert gpu.nvlink_rx_bytes_s == 1024 * 1024 * 1024 and gpu.nvlink_tx_bytes_s == 512 * 1024**2
    other = GpuSample.model_validate(second[1])
    assert other.dram_bw_util == 12.0 and other.sm_active is None, "a refused metric stays null"
    assert backend.sample()[0][0]["dram_bw_util"] == 20.0, "the buffers swap and keep working"


def test_gpu_without_gpm_or_driver_without_the_functions_leaves_the_fields_null() -> None:
    for setting in ("gpm_supported", "gpm_in_driver"):
        nvml = FakeNvml()
        nvml.gpm = {0: BUSY}
        setattr(nvml, setting, False)
        backend = NvmlBackend(nvml)
        samples = [backend.sample()[0][0] for _ in range(3)]
        assert all(f not in s for s in samples for f in GPM_FIELDS), setting
        assert samples[-1]["temp_c"] == 34, "the other fields are still read"


def test_a_non_finite_gpm_reading_is_left_out_not_sent() -> None:
    nvml = FakeNvml()
    nvml.gpm = {0: {**BUSY, pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: float("nan")}}
    backend = NvmlBackend(nvml)
    backend.sample()
    gpu = backend.sample()[0][0]
    assert "sm_occupancy" not in gpu and gpu["dram_bw_util"] == 71.5


def test_a_lost_gpu_frees_its_samples_and_starts_over_when_back() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.gpm = {1: BUSY}
    backend = NvmlBackend(nvml)
    backend.sample()
    backend.sample()
    nvml.lost.add(1)
    assert [s.kind for s in backend.sample()[1]] == ["gpu_lost"]
    assert nvml.samples_freed >= 2, "both buffers of the lost GPU are given back"
    nvml.lost.clear()
    back = backend.sample()[0]
    assert "dram_bw_util" not in back[1], "no stale sample is compared with the new one"
    assert backend.sample()[0][1]["dram_bw_util"] == 71.5
    backend.close()


def test_recorded_h200_has_no_nvlink_so_the_fields_are_null() -> None:
    nvml = FakeNvml()
    backend = NvmlBackend(nvml)
    gpu = backend.sample()[0][0]
    assert not any(f in gpu for f in NVLINK_FIELDS)
    calls = nvml.calls
    backend.sample()
    assert nvml.calls - calls < 60, "links are discovered once, not probed every interval"


def test_links_are_counted_and_errors_summed_over_links() -> None:
    nvml = FakeNvml(gpus=1)
    nvml.nvlinks[0] = [
        {"active": True, "crc": 5, "replay": 1, "recovery": 0},
        {"active": False, "crc": 7, "replay": 2, "recovery": 1},
        *({"active": True} for _ in range(16)),
    ]
    gpu = GpuSample.model_validate(NvmlBackend(nvml).sample()[0][0])
    assert (gpu.nvlink_links_active, gpu.nvlink_links_down) == (17, 1)
    assert (gpu.nvlink_crc_errors, gpu.nvlink_replay_errors, gpu.nvlink_recovery_errors) == (
        12,
        3,
        1,
    )


def test_refused_per_link_counters_fall_back_to_the_device_totals() -> None:
    nvml = FakeNvml()
    nvml.nvlinks[0] = [{"active": True} for _ in range(18)]
    nvml.nvlink_counters_supported = False
    nvml.extra_fields = {"NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 40}
    gpu = NvmlBackend(nvml).sample()[0][0]
    assert gpu["nvlink_links_active"] == 18 and gpu["nvlink_crc_errors"] == 40
    assert "nvlink_replay_errors" not in gpu, "neither per link nor as a total: null"


def test_the_driver_s_recovery_action_is_read_from_its_field() -> None:
    nvml = FakeNvml()  # the recorded H200 answers 0: nothing to do
    assert NvmlBackend(nvml).sample()[0][0]["recovery_action"] == 0
    nvml.extra_fields = {"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION": 2}
    gpu = GpuSample.model_validate(NvmlBackend(nvml).sample()[0][0])
    assert gpu.recovery_action == pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
