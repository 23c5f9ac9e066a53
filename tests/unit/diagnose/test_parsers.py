"""The parsers read each tool's real format into the right numbers and verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.diagnose.parsers import all_reduce_perf, dcgm_diag, ib_write_bw, nvbandwidth
from gpuops.diagnose.results import GradeResult
from gpuops.errors import DiagnosticsError, EngineError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "diag"
NVB_EXPECT = {"host_to_device": 48.0, "device_to_host": 48.0, "device_to_device": 335.0}


def text(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_a_passing_dcgm_run_gives_one_passing_check_per_plugin_and_gpu() -> None:
    checks = dcgm_diag(text("dcgmi_diag_r2_pass.json"))
    assert {c.name for c in checks} == {"dcgm:software", "dcgm:pcie", "dcgm:memory"}
    assert len(checks) == 3 * 8
    assert all(c.ok for c in checks)
    assert sorted(c.gpu for c in checks if c.name == "dcgm:pcie") == list(range(8))


def test_a_dcgm_fail_names_its_plugin_gpu_and_warning() -> None:
    result = GradeResult(grade=2, checks=tuple(dcgm_diag(text("dcgmi_diag_r2_pcie_fail.json"))))
    assert not result.ok
    [bad] = result.failing
    assert (bad.name, bad.gpu) == ("dcgm:pcie", 3)
    assert "PCI link width 8X" in bad.detail
    assert result.summary().startswith("grade 2 failed: dcgm pcie GPU 3: Fail: GPU 3 is running")


def test_dcgm_3x_reports_are_read_and_a_skip_is_not_a_failure() -> None:
    checks = dcgm_diag(text("dcgmi_diag_r1_v3.json"))
    inforom = [c for c in checks if c.name == "dcgm:inforom"]
    assert len(inforom) == 8 and all(c.ok and c.detail == "Skip" for c in inforom)
    assert all(c.ok for c in checks)


def test_a_dcgm_runtime_error_fails_the_grade_with_its_text() -> None:
    checks = dcgm_diag('{"DCGM Diagnostic": {"runtime_error": "nv-hostengine not running"}}')
    assert [(c.name, c.ok, c.detail) for c in checks] == [
        ("dcgm:runtime", False, "nv-hostengine not running")
    ]


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (text("dcgmi_diag_r2_pass.json")[:700], "not JSON"),
        ("{}", "no 'DCGM Diagnostic'"),
        ('{"DCGM Diagnostic": {"test_categories": []}}', "no test results"),
        ('{"DCGM Diagnostic": {}}', "no test_categories"),
    ],
)
def test_bad_dcgm_output_raises_naming_the_tool(payload: str, words: str) -> None:
    with pytest.raises(DiagnosticsError, match=words) as caught:
        dcgm_diag(payload)
    assert caught.value.tool == "dcgmi diag" and str(caught.value).startswith("dcgmi diag:")
    assert isinstance(caught.value, EngineError)


def test_all_reduce_at_the_threshold_passes() -> None:
    checks = {
        c.name: c for c in all_reduce_perf(text("all_reduce_perf_h200_at_threshold.txt"), 431)
    }
    busbw = checks["nccl:all_reduce busbw"]
    assert (busbw.ok, busbw.value, busbw.expect) == (True, 431.62, ">= 431 GB/s")
    assert "17179869184 bytes" in busbw.detail
    assert checks["nccl:all_reduce avg busbw"].value == pytest.approx(320.071)
    assert checks["nccl:all_reduce data"].ok


def test_all_reduce_below_the_threshold_fails_with_its_number_in_the_summary() -> None:
    checks = all_reduce_perf(text("all_reduce_perf_h200_below.txt"), 431)
    result = GradeResult(grade=3, checks=tuple(checks))
    assert [c.name for c in result.failing] == ["nccl:all_reduce busbw"]
    assert result.summary() == (
        "grade 3 failed: nccl all_reduce busbw 398.2 GB/s (expect >= 431 GB/s)"
    )


def test_wrong_data_in_any_row_fails_the_run() -> None:
    good = text("all_reduce_perf_h200_at_threshold.txt")
    row = next(line for line in good.splitlines() if line.strip().startswith("67108864 "))
    bad = good.replace(row, row[: row.rindex("0")] + "7")  # in-place #wrong 0 -> 7
    data = {c.name: c for c in all_reduce_perf(bad, 431)}["nccl:all_reduce data"]
    assert (data.ok, data.value) == (False, 7)
    assert "7 at 67108864 bytes" in data.detail


def test_a_truncated_all_reduce_run_raises() -> None:
    whole = text("all_reduce_perf_h200_at_threshold.txt")
    with pytest.raises(DiagnosticsError, match=r"Avg bus bandwidth.*did not finish"):
        all_reduce_perf(whole[: whole.index("# Out of bounds")], 431)
    with pytest.raises(DiagnosticsError, match="no result table header"):
        all_reduce_perf(whole[:300], 431)
    with pytest.raises(DiagnosticsError, match="no rows"):
        all_reduce_perf(whole[: whole.index("     8388608")], 431)


def test_nvbandwidth_checks_the_lowest_cell_of_each_matrix() -> None:
    checks = {c.name: c for c in nvbandwidth(text("nvbandwidth_h200.txt"), NVB_EXPECT)}
    assert checks["nvbandwidth:host_to_device"].value == 55.12
    assert checks["nvbandwidth:host_to_device"].gpu == 1
    assert checks["nvbandwidth:device_to_host"].value == 55.44
    d2d = checks["nvbandwidth:device_to_device"]
    assert (d2d.value, d2d.ok) == (375.80, True)
    assert "GPU 5 (row) with GPU 3 (column)" in d2d.detail
    nccl = all_reduce_perf(text("all_reduce_perf_h200_at_threshold.txt"), 431)
    graded = GradeResult(grade=3, checks=(*checks.values(), *nccl))
    assert graded.measures() == {"busbw_gbs": 431.62, "d2d_gbs": 375.80, "h2d_gbs": 55.12}, (
        "what the fleet compares a node on (gpuops.match.baselines)"
    )


def test_nvbandwidth_one_slow_gpu_fails_and_is_named() -> None:
    lines = text("nvbandwidth_h200.txt").splitlines()
    at = lines.index("memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)")
    # GPU 6's row and column fall to 120 GB/s: its NVLinks are down to a few.
    for r in range(8):
        cells = lines[at + 2 + r].split()
        cells = [cells[0]] + [
            "120.00" if (r == 6 or c == 6) and v != "N/A" else v for c, v in enumerate(cells[1:])
        ]
        lines[at + 2 + r] = f"{cells[0]:>2s}" + "".join(f"{v:>10s}" for v in cells[1:])
    checks = nvbandwidth("\n".join(lines), NVB_EXPECT)
    result = GradeResult(grade=2, checks=tuple(checks))
    [bad] = result.failing
    assert (bad.name, bad.value, bad.gpu) == ("nvbandwidth:device_to_device", 120.0, 6)
    assert "120.0 GB/s (expect >= 335 GB/s)" in result.summary()


def test_nvbandwidth_without_an_expected_matrix_or_cut_short_raises() -> None:
    whole = text("nvbandwidth_h200.txt")
    with pytest.raises(DiagnosticsError, match="no device_to_device_memcpy_write_ce matrix"):
        nvbandwidth(whole, {"device_to_device_memcpy_write_ce": 335})
    with pytest.raises(DiagnosticsError, match="no 'Running"):
        nvbandwidth("", NVB_EXPECT)
    cut = whole[: whole.index(" 3    378.30") + 30]
    with pytest.raises(DiagnosticsError, match="cut short"):
        nvbandwidth(cut, NVB_EXPECT)


def test_ib_write_bw_reads_gbits_against_the_bound() -> None:
    [check] = ib_write_bw(text("ib_write_bw_gdr_gbits.txt"), 380, "mlx5_ib3")
    assert (check.name, check.value, check.ok, check.unit) == (
        "ib_write_bw:mlx5_ib3",
        391.37,
        True,
        "Gb/s",
    )
    [slow] = ib_write_bw(text("ib_write_bw_gdr_gbits.txt"), 400, "mlx5_ib3")
    assert not slow.ok and slow.expect == ">= 400 Gb/s"


def test_ib_write_bw_converts_mebibytes_per_second() -> None:
    [check] = ib_write_bw(text("ib_write_bw_mbytes.txt"), 380, "mlx5_0")
    assert check.value == pytest.approx(46614.12 * 2**20 * 8 / 1e9, abs=0.01)  # 391.03
    assert check.ok and "MB/sec" in check.detail


def test_a_truncated_ib_write_bw_report_raises() -> None:
    whole = text("ib_write_bw_gdr_gbits.txt")
    with pytest.raises(DiagnosticsError, match="mlx5_ib3: no result row"):
        ib_write_bw(whole[: whole.index(" 8388608    5000")], 380, "mlx5_ib3")
    with pytest.raises(DiagnosticsError, match="ib_write_bw: mlx5_ib3: no '#bytes"):
        ib_write_bw(whole[:200], 380, "mlx5_ib3")


def test_a_grade_with_no_checks_fails() -> None:
    assert not GradeResult(grade=1, checks=()).ok
    assert GradeResult(grade=1, checks=()).summary() == "grade 1 failed: no checks ran"
