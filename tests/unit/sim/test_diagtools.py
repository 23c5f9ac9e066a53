"""The simulated fleet speaks the real formats: each rendering parses back to its numbers."""

from __future__ import annotations

from gpuops.diagnose.parsers import all_reduce_perf, dcgm_diag, ib_write_bw, nvbandwidth
from gpuops.sim import diagtools

NVB = {"host_to_device": 48.0, "device_to_host": 48.0, "device_to_device": 335.0}


def test_dcgmi_diag_json_passes_each_plugin_of_its_level_on_every_gpu() -> None:
    checks = dcgm_diag(diagtools.dcgmi_diag_json(3, 8))
    names = {c.name for c in checks}
    assert names == {
        "dcgm:software",
        "dcgm:pcie",
        "dcgm:memory",
        "dcgm:diagnostic",
        "dcgm:targeted_stress",
        "dcgm:targeted_power",
        "dcgm:memory_bandwidth",
    }
    assert len(checks) == 7 * 8 and all(c.ok for c in checks)
    assert {c.name for c in dcgm_diag(diagtools.dcgmi_diag_json(1, 8))} == {"dcgm:software"}


def test_dcgmi_diag_json_fails_the_named_plugin_on_the_named_gpu() -> None:
    text = diagtools.dcgmi_diag_json(2, 8, failing={"memory": {5: "DBE on GPU 5"}})
    [bad] = [c for c in dcgm_diag(text) if not c.ok]
    assert (bad.name, bad.gpu, bad.detail) == ("dcgm:memory", 5, "Fail: DBE on GPU 5")


def test_all_reduce_perf_table_parses_to_the_busbw_given() -> None:
    checks = {c.name: c for c in all_reduce_perf(diagtools.all_reduce_perf_table(8, 441.3), 431)}
    assert checks["nccl:all_reduce busbw"].value == 441.3 and checks["nccl:all_reduce busbw"].ok
    slow = all_reduce_perf(diagtools.all_reduce_perf_table(8, 402.0), 431)
    assert [c.name for c in slow if not c.ok] == ["nccl:all_reduce busbw"]
    wrong = all_reduce_perf(diagtools.all_reduce_perf_table(8, 441.3, wrong=3), 431)
    assert [(c.name, c.value) for c in wrong if not c.ok] == [("nccl:all_reduce data", 6)]


def test_nvbandwidth_text_parses_to_the_bandwidths_given() -> None:
    checks = {c.name: c for c in nvbandwidth(diagtools.nvbandwidth_text(8, 55.1, 55.6, 377.0), NVB)}
    assert checks["nvbandwidth:host_to_device"].value == 55.1
    assert checks["nvbandwidth:device_to_host"].value == 55.6
    assert checks["nvbandwidth:device_to_device"].value == 377.0
    assert all(c.ok for c in checks.values())


def test_one_slow_gpu_in_nvbandwidth_text_is_found() -> None:
    pairs = diagtools.slow_gpu_pairs(8, 2, 120.0)
    text = diagtools.nvbandwidth_text(8, 55.1, 55.6, 377.0, d2d_pairs=pairs)
    [bad] = [c for c in nvbandwidth(text, NVB) if not c.ok]
    assert (bad.name, bad.value, bad.gpu) == ("nvbandwidth:device_to_device", 120.0, 2)


def test_ib_write_bw_report_parses_to_the_gbps_given() -> None:
    [check] = ib_write_bw(diagtools.ib_write_bw_report(371.2, hca="mlx5_ib4"), 360, "mlx5_ib4")
    assert (check.value, check.ok) == (371.2, True)
    [slow] = ib_write_bw(diagtools.ib_write_bw_report(220.0), 360, "mlx5_ib0")
    assert (slow.value, slow.ok) == (220.0, False)
