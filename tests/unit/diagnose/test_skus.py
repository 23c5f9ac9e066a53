"""The shipped expectations load, every number says where it came from, a site overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.diagnose import skus
from gpuops.errors import ConfigError


def test_the_shipped_file_holds_azures_enforced_numbers() -> None:
    table = skus.load()
    h100, h200 = table.get("h100-8gpu"), table.get("h200-8gpu")
    assert h100.nccl_allreduce_busbw_gbs.value == 460
    assert h200.nccl_allreduce_busbw_gbs.value == 431
    assert h200.ib_write_bw_gbps.value == 360 and h100.ib_write_bw_gbps.value == 380
    assert h200.nvbandwidth_expect() == {
        "host_to_device_memcpy_ce": 48,
        "device_to_host_memcpy_ce": 48,
        "device_to_device_memcpy_read_ce": 335,
    }
    assert (h200.gpu_count.value, h200.pcie_gen.value, h200.pcie_width.value) == (8, 5, 16)


def test_every_shipped_number_has_a_source() -> None:
    for key, sku in skus.load().skus.items():
        for number in skus.NUMBERS:
            sources = getattr(sku, number).sources
            assert sources and all(s.strip() for s in sources), f"{key}.{number}"
    azure = skus.load().get("h200-8gpu").nccl_allreduce_busbw_gbs.sources[0]
    assert "Azure/azurehpc-health-checks" in azure and "nd96isr_h200_v5.conf" in azure


def test_a_site_file_overrides_one_number_and_keeps_the_rest(tmp_path: Path) -> None:
    site = tmp_path / "skus.yml"
    site.write_text(
        "skus:\n"
        "  h200-8gpu:\n"
        "    nccl_allreduce_busbw_gbs:\n"
        "      value: 455\n"
        '      sources: ["site burn-in of 64 nodes, 2026-05"]\n'
    )
    h200 = skus.load(site).get("h200-8gpu")
    assert h200.nccl_allreduce_busbw_gbs.value == 455
    assert h200.nccl_allreduce_busbw_gbs.sources == ("site burn-in of 64 nodes, 2026-05",)
    assert h200.ib_write_bw_gbps.value == 360  # untouched
    assert skus.load(site).get("h100-8gpu").nccl_allreduce_busbw_gbs.value == 460


def test_a_site_number_without_a_source_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "skus.yml"
    site.write_text("skus:\n  h200-8gpu:\n    ib_write_bw_gbps: {value: 350}\n")
    with pytest.raises(ConfigError, match=r"skus.h200-8gpu.ib_write_bw_gbps.sources"):
        skus.load(site)


def test_an_unknown_sku_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"'b200-8gpu'.*h100-8gpu, h200-8gpu"):
        skus.load().get("b200-8gpu")


def test_a_missing_site_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        skus.load(tmp_path / "absent.yml")
