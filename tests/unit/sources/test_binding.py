"""Binding scrape targets to inventory nodes: lookups, claims, refusals and their letters."""

from __future__ import annotations

import json

from gpuops.sources.binding import Binding, Bound, Refusals, letter
from gpuops.sources.readings import Series

from tests.dcgm_exposition import inventory

FLEET = inventory(
    **{"gpu-1": "10.0.0.1", "gpu-2.lab.example": "10.0.0.2", "twin-a": "10.0.0.9"},
    **{"twin-b": "10.0.0.9", "bare": None},
)


def _s(**labels: str) -> Series:
    return Series("DCGM_FI_DEV_XID_ERRORS", {"gpu": "0", **labels}, 79)


def test_a_target_is_found_by_name_address_or_short_name_and_never_guessed() -> None:
    b = Binding(FLEET)
    assert b.node_of("GPU-1.") == b.node_of("10.0.0.1") == "gpu-1"
    assert b.node_of("gpu-2") == b.node_of("gpu-2.other") == "gpu-2.lab.example"
    assert b.node_of_url("http://10.0.0.2:9400/metrics") == "gpu-2.lab.example"
    assert b.node_of("bare") == "bare"
    assert b.node_of("10.0.0.9") is None, "two nodes share the address: neither is guessed"
    assert b.node_of("10.0.0.3") is None and b.node_of("") is None


def test_an_exact_name_is_found_beside_a_full_name_that_shares_its_short_one() -> None:
    b = Binding(inventory(**{"gpu-1": None, "gpu-1.lab": None}))
    assert b.node_of("gpu-1") == "gpu-1" and b.node_of("gpu-1.lab") == "gpu-1.lab"
    assert b.node_of("gpu-1.other") is None, "two nodes have that short name: neither is guessed"


def test_the_exporters_claim_is_checked_against_the_targets_node() -> None:
    b = Binding(FLEET)
    assert b.agrees("gpu-1", _s(Hostname="gpu-1").labels) and b.agrees("gpu-1", _s().labels)
    assert b.agrees("gpu-2.lab.example", _s(Hostname="gpu-2").labels)
    assert b.agrees("gpu-1", _s(Hostname="10.0.0.1").labels)
    assert not b.agrees("gpu-1", _s(Hostname="gpu-2").labels)
    assert Binding(FLEET, node_label="").agrees("gpu-1", _s(Hostname="gpu-2").labels), (
        "checks nothing"
    )


def test_a_series_speaks_for_its_targets_node_or_is_refused_with_a_reason() -> None:
    bound = Bound()
    url = "http://10.0.0.1:9400/metrics"
    Binding(FLEET).bind(url, False, [_s(Hostname="gpu-1"), _s(Hostname="gpu-2")] * 2, bound)
    Binding(FLEET).bind("http://10.0.0.7:9400/metrics", False, [_s()], bound)
    assert {node: len(got) for node, got in bound.series.items()} == {"gpu-1": 2}
    forged = bound.refused[(url, "forged")]
    assert (forged.node, forged.claim, forged.count) == ("gpu-1", "gpu-2", 2)
    assert bound.refused[("http://10.0.0.7:9400/metrics", "unknown_target")].count == 1


def test_through_prometheus_the_target_is_instance_or_the_target_label() -> None:
    by_instance, by_label = Binding(FLEET), Binding(FLEET, target_label="node")
    labels = {"instance": "10.0.0.1:9400", "node": "gpu-2"}
    assert by_instance.target_of(labels) == ("10.0.0.1:9400", "gpu-1")
    assert by_label.target_of(labels) == ("10.0.0.1:9400", "gpu-2.lab.example")
    assert by_label.target_of({"instance": "10.0.0.1:9400"}) == ("10.0.0.1:9400", None)


def test_a_refusal_is_news_once_while_it_lasts_and_again_after_it_stopped() -> None:
    url = "http://10.0.0.1:9400/metrics"
    bound = Bound()
    Binding(FLEET).bind(url, False, [_s(Hostname="gpu-2")], bound)
    refusals = Refusals()
    seen = [
        len(refusals.news(bound.refused, [])),
        len(refusals.news(bound.refused, [])),
        len(refusals.news({}, [url])),  # not read this time: still under way
        len(refusals.news(bound.refused, [])),
        len(refusals.news({}, [])),  # read, and clean
        len(refusals.news(bound.refused, [])),
    ]
    assert seen == [1, 0, 0, 0, 0, 1]


def test_the_dead_letter_names_the_target_its_node_and_the_claim() -> None:
    bound = Bound()
    Binding(FLEET).bind("http://10.0.0.1:9400/metrics", False, [_s(Hostname="gpu-2")], bound)
    (refused,) = bound.refused.values()
    item = letter(refused, 1_800_000_000.0)
    body = json.loads(item.payload)
    assert item.subject == "gpuops.dlq.forged" and item.msg_id.startswith("dlq-src-")
    assert (body["reason"], body["subject"]) == ("forged", "scrape:http://10.0.0.1:9400/metrics")
    assert "node gpu-1" in body["error"] and "'gpu-2'" in body["error"]
    detail = json.loads(body["payload"])
    assert (detail["node"], detail["claim"], detail["first"]["labels"]["Hostname"]) == (
        "gpu-1",
        "gpu-2",
        "gpu-2",
    )
