"""Grade 5, the service bundle: a check per part the playbook lists, collected when it
has bytes, and a summary a person reads first (where the bundle is, what it lacks)."""

from __future__ import annotations

import json

from gpuops.diagnose.grades import BUNDLE_PARTS, judge
from gpuops.diagnose.skus import load


def _bundle(**parts: dict[str, object]) -> str:
    listed = [{"name": n, "path": f"/b/{n}", "bytes": 10, "error": ""} for n in BUNDLE_PARTS]
    for item in listed:
        item.update(parts.get(str(item["name"]), {}))
    return json.dumps({"dir": "/diag/node-001/service-x", "parts": listed})


SKU = load().get("h200-8gpu")


def test_a_whole_bundle_passes_and_says_where_it_is() -> None:
    result = judge(5, {"bundle": _bundle()}, SKU)
    assert result.ok and result.grade == 5
    assert [c.name for c in result.checks][1:] == [f"bundle:{n}" for n in BUNDLE_PARTS]
    assert result.summary() == "grade 5: service bundle at /diag/node-001/service-x (5 of 5 parts)"


def test_a_part_missing_or_empty_is_named() -> None:
    text = _bundle(
        **{"bmc-sel": {"bytes": 0, "error": "BMC event log unavailable: timeout"}},
        **{"dmesg": {"bytes": 0}},
    )
    result = judge(5, {"bundle": text}, SKU)
    assert not result.ok
    assert result.summary().endswith("(3 of 5 parts); missing: bmc-sel, dmesg")
    [sel] = [c for c in result.checks if c.name == "bundle:bmc-sel"]
    assert sel.detail == "BMC event log unavailable: timeout"


def test_no_list_of_parts_is_a_failed_grade_not_a_crash() -> None:
    assert not judge(5, {"bundle": "not json"}, SKU).ok
    assert judge(5, {}, SKU).checks[0].name == "bundle:ran"


def test_a_tools_output_nested_too_deep_fails_its_check_not_the_grade() -> None:
    """A node's tool output is read as JSON (dcgmi, the fabric pass, the bundle's list);
    Python's parser recurses per level, so 100,000 nested arrays raise RecursionError. It
    is a failed check that says so, the other tools still judged, as for any bad output."""
    deep = "[" * 100_000 + "]" * 100_000
    for grade, tool in ((2, "dcgm"), (4, "fabric"), (5, "bundle")):
        result = judge(grade, {tool: deep}, SKU)
        [check] = [c for c in result.checks if c.name.startswith(f"{tool}:")]
        assert not check.ok and "nested" in check.detail, (tool, check)
