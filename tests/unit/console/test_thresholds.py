"""The heatmap's "at threshold" is the overheat rule's, per GPU: never an assumed 90 C."""

from __future__ import annotations

from pathlib import Path

from gpuops.console.latest import Latest
from gpuops.console.thresholds import temp_threshold, with_threshold
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.models import EVENT_ADAPTER
from gpuops.sim.fleet import envelope

ROOT = Path(__file__).resolve().parents[3]
INVENTORY = Inventory(Path("inv"), frozenset({"a"}), {}, {})


def _write(tmp_path: Path, when: str) -> Path:
    (tmp_path / "r.yml").write_text(
        f"rules:\n  - name: hot\n    on: telemetry\n    when: {when}\n    for: 1m\n"
    )
    return tmp_path


def test_the_shipped_overheat_rule_sets_each_gpus_threshold_and_none_without_slowdown() -> None:
    threshold = temp_threshold(load_rules([ROOT / "rules"], ROOT / "playbooks", INVENTORY))
    assert threshold is not None
    assert threshold.text == "gpu-overheat: temp_c >= temp_slowdown_c - 3"
    latest = Latest(INVENTORY)
    gpus = [
        {"index": 0, "temp_c": 88.0, "temp_slowdown_c": 89.0},  # an H200: the rule fires at 86
        {"index": 1, "temp_c": 88.0},  # a stock dcgm-exporter: no slowdown threshold
    ]
    event = envelope("telemetry", "a", 1_800_000_000.0, {"gpus": gpus})
    latest.observe(EVENT_ADAPTER.validate_python(event))
    rows = with_threshold(latest.frame(latest.nodes, 1_800_000_001.0).rows, threshold)
    assert [row[-1] for row in rows] == [86.0, None], "no assumed 90 C for GPU 1"


def test_an_absolute_threshold_and_no_rule(tmp_path: Path) -> None:
    absolute = temp_threshold(load_rules([_write(tmp_path, "temp_c > 83")]))
    assert absolute is not None and absolute.text == "hot: temp_c > 83"
    assert with_threshold([[0, 0, 1, 80.0, None, None, None, None, None]], absolute)[0][-1] == 83
    (tmp_path / "r.yml").unlink()
    assert temp_threshold(load_rules([_write(tmp_path, "power_w > 100")])) is None
    assert with_threshold([[0, 0, 1, 80.0, 89.0, None, None, None, None]], None)[0][-1] is None
