"""`validate --source dcgm`: which rules a dcgm-exporter feed cannot serve, and why."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.match.loader import load_rules
from gpuops.sources.coverage import gaps, rule_fields

ROOT = Path(__file__).resolve().parents[3]


def _rules(tmp_path: Path, body: str) -> list[tuple[str, str]]:
    (tmp_path / "r.yml").write_text(body)
    return [(g.rule, g.level) for g in gaps(load_rules([tmp_path]))]


def test_shipped_rules_that_a_dcgm_feed_cannot_serve() -> None:
    found = {g.rule: g for g in gaps(load_rules([ROOT / "rules"]))}
    levels = {name: g.level for name, g in found.items()}
    assert {n for n, lv in levels.items() if lv == "cannot-fire"} >= {
        "ecc-dbe-event",
        "nvml-gpu-lost",
        "probe-failed",
    }
    assert levels["agent-silent"] == "fires-everywhere"
    assert levels["gpu-overheat"] == "needs-counters"
    assert "DCGM_FI_DEV_SLOWDOWN_TEMP" in found["gpu-overheat"].message
    # XID rules are served (a change of DCGM_FI_DEV_XID_ERRORS is an xid event); drift,
    # unreachable and ChatOps come from gpuops itself whatever the source.
    for served in ("xid-79-gpu-lost", "xid-48-dbe", "drift-safe-fix", "host-unreachable"):
        assert served not in found
    # Fields in dcgm-exporter's default counters need nothing: remap-failure reads one.
    assert "remap-failure" not in found
    where = found["probe-failed"]
    assert where.file.endswith("zombie.yml") and where.line > 0
    assert str(where).startswith(f"{where.file}:{where.line}: rule probe-failed: cannot-fire:")


def test_a_field_the_mapping_never_fills_means_the_rule_cannot_fire(tmp_path: Path) -> None:
    body = """rules:
  - name: link-down
    on: telemetry
    group_by: [node, gpu]
    when: nvlink_links_down > 0
  - name: crc-climbing
    on: telemetry
    group_by: [node, gpu]
    increase: {field: nvlink_crc_errors, by: 10, within: 1h}
  - name: off
    on: probe
    enabled: false
"""
    assert _rules(tmp_path, body) == [
        ("link-down", "cannot-fire"),
        ("crc-climbing", "needs-counters"),
    ]


def test_rule_fields_are_the_names_read_not_the_functions_called(tmp_path: Path) -> None:
    (tmp_path / "r.yml").write_text(
        """rules:
  - name: r
    on: telemetry
    group_by: [node, gpu]
    when: bit(clocks_event_reasons, 0x20) and abs(temp_c - temp_slowdown_c) < 3 and gpu == 1
"""
    )
    (rule,) = load_rules([tmp_path]).rules
    assert rule_fields(rule) == {"clocks_event_reasons", "temp_c", "temp_slowdown_c"}


def test_an_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown source 'snmp'"):
        gaps(load_rules([ROOT / "rules"]), "snmp")


def test_window_functions_and_derived_facts_are_judged_by_the_fields_they_read(
    tmp_path: Path,
) -> None:
    body = """rules:
  - name: underused
    on: telemetry
    group_by: [node, gpu]
    when: p95(util_gpu, 24h) < 10
  - name: hot-for-a-day
    on: telemetry
    group_by: [node, gpu]
    when: max(temp_slowdown_c, 1h) > 0
  - name: bandwidth
    on: telemetry
    group_by: [node, gpu]
    when: dram_bw_util < dram_bw_util_peer_median / 2 and sm_active > 50
"""
    assert _rules(tmp_path, body) == [
        ("hot-for-a-day", "needs-counters"),
        ("bandwidth", "needs-counters"),
    ]
    assert gaps(load_rules([ROOT / "rules"])) and "gpu-underused" not in {
        g.rule for g in gaps(load_rules([ROOT / "rules"]))
    }
