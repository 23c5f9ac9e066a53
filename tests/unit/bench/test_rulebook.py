"""The side-by-side bench's rules say the same on both sides, and its samples are the
recording's, once per GPU for ansible-rulebook and as v2 lines for gpuops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from gpuops.bench.replay import record
from gpuops.bench.rulebook import conditions, gpuops_rules, rulebook_yaml, samples
from gpuops.errors import ConfigError


def test_each_rule_is_one_condition_written_for_each_engine(tmp_path: Path) -> None:
    conds = conditions(20)
    assert len({c.name for c in conds}) == 20
    book = yaml.safe_load(rulebook_yaml(conds, tmp_path / "events.jsonl"))
    (ruleset,) = book
    assert ruleset["match_multiple_rules"] is True
    said = {r["name"]: r["condition"] for r in ruleset["rules"]}
    assert said.pop("bench-end") == "event.bench_end == true"
    assert said == {c.name: f"event.{c.gpuops()}" for c in conds}
    rules = gpuops_rules(conds)
    assert [r.name for r in rules.rules] == [c.name for c in conds]
    assert all(r.on == "telemetry" and r.span_s == 0 for r in rules.rules), "no window"
    with pytest.raises(ConfigError, match="20 rules"):
        conditions(21)


def test_the_samples_are_the_recordings_in_both_forms(tmp_path: Path) -> None:
    recording, _, n = record(tmp_path, 160)
    v2, flat = tmp_path / "v2.jsonl", tmp_path / "events.jsonl"
    assert samples(recording, v2, flat) == n
    events = [json.loads(line) for line in recording.read_text().splitlines()]
    gpus = [g for e in events for g in e["data"]["gpus"]]
    per_gpu = [json.loads(line) for line in flat.read_text().splitlines()]
    assert [(f["node"], f["gpu"], f["temp_c"]) for f in per_gpu] == [
        (e["node"], g["index"], g["temp_c"]) for e in events for g in e["data"]["gpus"]
    ]
    assert len(per_gpu) == len(gpus)
    lines = [json.loads(line) for line in v2.read_text().splitlines()]
    assert all(line["v"] == 2 for line in lines) and len(lines) == len(events)
