"""Facts derived from the other GPUs of the same sample (dram_bw_util_peer_median)."""

from __future__ import annotations

from gpuops.match.facts import with_medians
from gpuops.match.matcher import facts_of, peer_median
from gpuops.models import EVENT_ADAPTER, fact_fields
from hypothesis import given, settings
from hypothesis import strategies as st


def _sample(*bandwidth: float | None) -> object:
    gpus = [{"index": i, "dram_bw_util": b} for i, b in enumerate(bandwidth)]
    return EVENT_ADAPTER.validate_python(
        {
            "id": "e1",
            "kind": "telemetry",
            "node": "n1",
            "ts": "2027-01-15T08:00:00Z",
            "source": "agent",
            "data": {"gpus": gpus},
        }
    )


def test_each_gpu_gets_the_median_of_the_others_not_its_own() -> None:
    facts = facts_of(_sample(70, 72, 20, 68, 71))  # type: ignore[arg-type]
    medians = [f["dram_bw_util_peer_median"] for f in facts]
    assert medians == [69.5, 69.0, 70.5, 70.5, 69.0]


def test_fewer_than_two_reporting_peers_give_null() -> None:
    assert [f["dram_bw_util_peer_median"] for f in facts_of(_sample(70, 20))] == [None, None]  # type: ignore[arg-type]
    facts = facts_of(_sample(70, None, 20))  # type: ignore[arg-type]
    assert [f["dram_bw_util_peer_median"] for f in facts] == [None, 45.0, None]


def test_peers_without_the_field_do_not_count() -> None:
    assert peer_median([None, 10.0, 30.0, None, 50.0], 0) == 30.0
    assert peer_median([None, 10.0, None], 1) is None


def test_rules_may_name_the_derived_fact() -> None:
    assert "dram_bw_util_peer_median" in fact_fields("telemetry")
    assert "dram_bw_util_peer_median" not in fact_fields("xid")


@settings(max_examples=400)
@given(st.lists(st.one_of(st.none(), st.integers(0, 6).map(float), st.floats(0, 100)), max_size=9))
def test_each_gpus_peer_median_is_the_median_of_the_others(values: list[float | None]) -> None:
    """with_medians picks from one sorted list what peer_median computes from a copy."""
    facts: list[dict[str, object]] = [
        {"dram_bw_util": v, "dram_bw_util_peer_median": None} for v in values
    ]
    with_medians(facts)  # type: ignore[arg-type]
    if sum(v is not None for v in values) < 2:
        assert all(f["dram_bw_util_peer_median"] is None for f in facts)
        return
    assert [f["dram_bw_util_peer_median"] for f in facts] == [
        peer_median(values, i) for i in range(len(values))
    ]
