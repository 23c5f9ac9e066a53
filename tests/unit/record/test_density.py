"""The density report: a day of utilisation per GPU, the under-used ones, and their layout."""

from __future__ import annotations

from typing import Any

from gpuops.models import EVENT_ADAPTER, Event, new_event
from gpuops.record.density import DAY_S, DensityTracker, render

GB = 10**9


def _sample(node: str, t: float, gpus: list[tuple[float, int]]) -> Event:
    data: dict[str, Any] = {
        "gpus": [
            {"index": i, "util_gpu": util, "mem_used_bytes": mem, "mem_total_bytes": 141 * GB}
            for i, (util, mem) in enumerate(gpus)
        ]
    }
    return EVENT_ADAPTER.validate_python(new_event("telemetry", node, t, data, "test"))


def _day(tracker: DensityTracker, node: str, gpus: list[tuple[float, int]], step: float = 10.0):
    t = 1_800_000_000.0
    while t <= 1_800_000_000.0 + DAY_S:
        tracker.observe(_sample(node, t, gpus))
        t += step


def test_under_used_gpus_are_reported_with_a_layout_that_fits_their_work() -> None:
    tracker = DensityTracker()
    _day(tracker, "n1", [(5.0, 8 * GB), (85.0, 120 * GB), (5.0, 25 * GB)])

    rows = tracker.underused(10.0)

    assert [(r.node, r.gpu) for r in rows] == [("n1", 0), ("n1", 2)], "the busy GPU is not waste"
    notebook, bigger = rows
    assert abs(notebook.p95 - 5.0) <= 0.5 and notebook.hours >= 23.9
    assert notebook.mem_peak_bytes == 8 * GB
    assert list(notebook.recommendation.profiles) == [19] * 7, "seven 1g.18gb"
    assert list(bigger.recommendation.profiles) == [15] * 4, "25 GB and headroom need 1g.35gb"
    text = render(rows, 10.0, len(tracker.gpus))
    assert text.splitlines()[0] == "2 of 3 GPUs under 10% p95 utilisation over the day"
    assert "n1 GPU 0: util p50 5% p95 5%" in text and "MIG [19, 19, 19, 19, 19, 19, 19]" in text


def test_a_development_pool_is_time_sliced_and_a_short_history_says_so() -> None:
    tracker = DensityTracker()
    for k in range(60):
        tracker.observe(_sample("dev1", 1_800_000_000.0 + 60 * k, [(4.0, 2 * GB)]))

    rows = tracker.underused(10.0, development=lambda node: node.startswith("dev"))

    assert rows[0].recommendation.kind == "time-slicing"
    assert "(seen 1.0 h)" in render(rows, 10.0, 1)


def test_a_day_of_one_hertz_samples_is_taken_once_a_minute() -> None:
    tracker = DensityTracker()
    _day(tracker, "n1", [(5.0, GB)], step=1.0)

    series = tracker.gpus[("n1", 0)].util
    assert series.value("count") is not None
    assert 1400 <= (series.value("count") or 0) <= 1441, "one sample a minute over the day"


def test_a_gpu_not_seen_for_a_day_is_forgotten() -> None:
    tracker = DensityTracker()
    tracker.observe(_sample("n1", 1_800_000_000.0, [(5.0, GB)]))

    assert tracker.sweep(1_800_000_000.0 + DAY_S + 1) == 1
    assert tracker.gpus == {}


def test_a_node_between_its_minutes_costs_nothing_but_a_gpu_it_gains_is_taken_at_once() -> None:
    tracker = DensityTracker()
    t = 1_800_000_000.0
    tracker.observe(_sample("n1", t, [(5.0, GB)]))
    tracker.observe(_sample("n1", t + 1, [(50.0, GB)]))  # within the minute: not taken

    assert tracker.gpus[("n1", 0)].util.value("count") == 1
    tracker.observe(_sample("n1", t + 2, [(5.0, GB), (7.0, GB)]))  # a GPU came back

    assert tracker.gpus[("n1", 1)].util.value("max") == 7.0
    assert tracker.gpus[("n1", 0)].util.value("count") == 1, "GPU 0 still waits its minute"
    tracker.observe(_sample("n1", t + 60, [(9.0, GB), (7.0, GB)]))

    assert tracker.gpus[("n1", 0)].util.value("count") == 2
    assert tracker.gpus[("n1", 1)].util.value("count") == 1, "GPU 1's minute is not over"


def test_a_node_whose_gpus_read_no_utilisation_is_looked_at_again() -> None:
    tracker = DensityTracker()
    tracker.observe(_sample("n1", 1_800_000_000.0, [(None, GB)]))  # type: ignore[list-item]
    tracker.observe(_sample("n1", 1_800_000_001.0, [(5.0, GB)]))

    assert tracker.gpus[("n1", 0)].util.value("count") == 1


def test_a_gpu_that_had_no_reading_is_taken_when_its_reading_comes() -> None:
    tracker = DensityTracker()
    t = 1_800_000_000.0
    tracker.observe(_sample("n1", t, [(5.0, GB), (None, GB)]))  # type: ignore[list-item]
    tracker.observe(_sample("n1", t + 5, [(5.0, GB), (9.0, GB)]))

    assert tracker.gpus[("n1", 1)].util.value("max") == 9.0, "not a minute later"
    assert tracker.gpus[("n1", 0)].util.value("count") == 1, "GPU 0 still waits its minute"
