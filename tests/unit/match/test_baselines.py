"""The fleet baseline: each node against the median of its peers of the same GPU model
under the same load, fed the same way on the live path and replay's."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from gpuops.inventory.hosts import Inventory
from gpuops.match.baselines import (
    GRADE_MAX_AGE_S,
    MAX_AGE_S,
    MIN_PEERS,
    REFRESH_S,
    FleetBaseline,
    GradeBaseline,
    _Latest,
)
from gpuops.match.facts import Telemetry
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import EVENT_ADAPTER, Event, new_event
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.decide.helpers import ROOT


def _gpus(bw: float, active: float = 95.0, name: str = "NVIDIA H200") -> list[dict[str, Any]]:
    return [{"dram_bw_util": bw, "sm_active": active, "name": name} for _ in range(2)]


def test_the_median_is_of_the_others_of_the_same_model_and_load_band() -> None:
    baseline = FleetBaseline()
    values = {f"n{i}": 50.0 + i for i in range(8)}
    for node, bw in values.items():
        baseline.observe(node, _gpus(bw), 0.0)
    baseline.observe("h100", _gpus(10.0, name="NVIDIA H100"), 0.0)  # another model
    baseline.observe("idle", _gpus(1.0, active=3.0), 0.0)  # another load band
    facts = _gpus(values["n0"])
    baseline.observe("n0", facts, 10.0)
    others = statistics.median(v for n, v in values.items() if n != "n0")
    assert facts[0]["dram_bw_util_fleet_median"] == others
    assert [f["node_dram_bw_util"] for f in facts] == [50.0, 50.0]


def test_too_few_peers_or_stale_ones_give_no_median() -> None:
    baseline = FleetBaseline()
    for i in range(MIN_PEERS):
        baseline.observe(f"n{i}", _gpus(60.0), 0.0)
    alone = _gpus(40.0)
    baseline.observe("n-new", alone, REFRESH_S)  # the medians are at most REFRESH_S old
    assert alone[0]["dram_bw_util_fleet_median"] == 60.0, "five peers: a median"
    later = _gpus(40.0)
    baseline.observe("n-new", later, MAX_AGE_S + 10)
    assert later[0]["dram_bw_util_fleet_median"] is None, "the others stopped reporting"
    nothing = [{"dram_bw_util": None, "sm_active": None, "name": "NVIDIA H200"}]
    baseline.observe("n-none", nothing, 0.0)
    assert nothing[0]["dram_bw_util_fleet_median"] is None


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([f"n{i}" for i in range(12)]),
        st.one_of(st.integers(40, 44).map(float), st.floats(0, 100)),
        max_size=12,
    ),
    st.sampled_from([f"n{i}" for i in range(14)]),
)
def test_each_node_gets_the_median_of_the_others_latest(
    values: dict[str, float], asking: str
) -> None:
    """Whatever its value's place among equal and unequal peers (or none, a node not
    seen at the last refresh), a node's median is the others' as statistics computes it."""
    band = _Latest(MAX_AGE_S)
    band.latest.update({node: (0.0, v) for node, v in values.items()})
    got = band.median(asking, 0.0, lambda node: None)
    others = [v for node, v in values.items() if node != asking]
    want = round(statistics.median(others), 2) if len(others) >= MIN_PEERS else None
    assert got == want


def test_live_and_replay_feed_the_baseline_alike() -> None:
    """Matcher.match (live: a Telemetry) and match_facts (replay's path) see one fleet."""
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    fired: list[list[str]] = []
    for live in (True, False):
        matcher = Matcher(rules)
        assert matcher.baseline is not None, "rules/baselines.yml reads the baseline"
        names = []
        for step in range(0, 15 * 60, 30):
            for i in range(1, 21):
                facts = [
                    {**g, "index": j, "gpu": j, "node": f"n{i:02d}"}
                    for j, g in enumerate(_gpus(42.0 if i == 7 else 60.0))
                ]
                full = [{**dict.fromkeys(matcher_fields()), **f} for f in facts]
                if live:
                    event = Telemetry(f"e{step}-{i}", f"n{i:02d}", float(step), "t", full)
                    found = matcher.match(event)
                else:
                    found = matcher.match_facts("telemetry", full, float(step), f"e{step}-{i}")
                names += [f"{m.rule}@{m.node}" for m in found if m.rule.startswith("hbm")]
        fired.append(names)
    assert fired[0] == fired[1] and fired[0][:1] == ["hbm-bandwidth-below-fleet@n07"], fired
    assert {n.split("@")[1] for n in fired[0]} == {"n07"}


def matcher_fields() -> tuple[str, ...]:
    from gpuops.match.facts import GPU_FIELDS

    return (*GPU_FIELDS, "dram_bw_util_peer_median")


def _graded(node: str, busbw: float | None, t: float, ok: bool = True) -> Event:
    data: dict[str, Any] = {"grade": 3, "ok": ok, "checks": 40, "busbw_gbs": busbw}
    return EVENT_ADAPTER.validate_python(new_event("diagnostics", node, t, data, "gpuops-executor"))


def _inventory(skus: dict[str, str]) -> Inventory:
    return Inventory(
        Path("<test>"), frozenset(skus), {}, {n: {"gpu_sku": s} for n, s in skus.items()}
    )


def test_a_grade_passing_its_bound_at_70_percent_of_its_peers_busbw_is_flagged() -> None:
    """One node among 20 passes grade 3 (busbw above the SKU's 431 GB/s) at 70% of the
    others' median; the shipped rule tells a person about it and about none of the 19."""
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    nodes = {f"n{i:02d}": "h200-8gpu" for i in range(1, 21)} | {"b200": "b200-8gpu"}
    matcher = Matcher(rules, inventory=_inventory(nodes))
    assert matcher.grades is not None, "rules/baselines.yml reads the grades' baseline"
    fired = []
    for t, node in enumerate(sorted(nodes)):
        busbw = {"b200": 900.0, "n07": 0.7 * 660.0}.get(node, 650.0 + t)
        found = matcher.match(_graded(node, busbw, 10.0 * t))
        fired += [(m.rule, m.node) for m in found if m.rule.startswith("nccl")]
    assert fired == [("nccl-busbw-below-fleet", "n07")], "six peers were known by then"
    again = matcher.match(_graded("n07", 0.7 * 660.0, 1000.0))  # its peers all known now
    [match] = [m for m in again if m.rule == "nccl-busbw-below-fleet"]
    assert match.facts["busbw_gbs_fleet_median"] == statistics.median(
        650.0 + t for t, n in enumerate(sorted(nodes)) if n not in ("b200", "n07")
    ), "the median is of the other h200 nodes: the B200 and the node itself are not peers"


def test_only_passing_results_teach_the_grades_baseline() -> None:
    baseline = GradeBaseline(lambda node: "h200-8gpu")
    for i in range(MIN_PEERS):
        baseline.observe(f"n{i}", {"ok": True, "busbw_gbs": 600.0}, 0.0)
    for i in range(10):  # failed runs (acted on as faults): not peers
        baseline.observe(f"bad{i}", {"ok": False, "busbw_gbs": 100.0}, 0.0)
    fact: dict[str, Any] = {"ok": True, "busbw_gbs": 590.0, "d2d_gbs": None}
    baseline.observe("new", fact, REFRESH_S)
    assert fact["busbw_gbs_fleet_median"] == 600.0
    assert fact["d2d_gbs_fleet_median"] is None, "no node measured device<->device"
    later: dict[str, Any] = {"ok": True, "busbw_gbs": 590.0}
    baseline.observe("new", later, GRADE_MAX_AGE_S + 10)
    assert later["busbw_gbs_fleet_median"] is None, "a month-old result stands for no one"
