"""The soak's accounting: invariants over audit records, stream counts and tool calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuops.bench.soak import SoakConfig, scenario
from gpuops.bench.soak_tally import AuditTally, StreamCounts, extra_tool_calls, invariants
from gpuops.models import AuditRecord


def _decision(node: str, intents: list[str], accepted: bool = True) -> AuditRecord:
    reason = "accepted" if accepted else "cooldown"
    body = {"decision": {"accepted": accepted, "reason": reason}, "intents": intents}
    return AuditRecord(type="decision", at=1.0, node=node, rule="r", body=body)


def _started(node: str, key: str, book: str = "gpu_reset.yml") -> AuditRecord:
    return AuditRecord(
        type="note", at=2.0, node=node, summary=f"running {book} on {node}", body={"intent": key}
    )


def _run(node: str, key: str, book: str = "gpu_reset.yml") -> AuditRecord:
    body = {"intent_key": key, "playbook": book, "status": "successful"}
    return AuditRecord(type="run", at=3.0, node=node, rule="r", body=body)


def _counts(published: int, acked: int, pending: int = 0) -> StreamCounts:
    counts = StreamCounts()
    counts.messages["GPUOPS_EVENTS"] = published
    counts.consumers["gpuops-engine"] = {"ack_floor": acked, "pending": pending, "ack_pending": 0}
    return counts


def _tally(*records: AuditRecord) -> AuditTally:
    tally = AuditTally()
    for r in records:
        tally.add(r)
    return tally


def test_a_clean_run_holds_every_invariant() -> None:
    tally = _tally(_decision("n1", ["k1"]), _started("n1", "k1"), _run("n1", "k1"))
    result = invariants(_counts(10, 10), tally, {}, 0)
    assert result["failed"] == []
    assert result["runs"] == 1 and result["accepted_decisions"] == 1


def test_unacked_events_a_second_run_and_an_orphan_intent_fail() -> None:
    tally = _tally(
        _decision("n1", ["k1"]),
        _run("n1", "k1"),
        _run("n1", "k1"),
        _run("n2", "k9"),  # no decision behind it
        _decision("n3", ["k3"]),  # never queued, run or noted
    )
    result = invariants(_counts(10, 8, pending=2), tally, {}, 0)
    assert set(result["failed"]) == {
        "every health event decided or dead-lettered",
        "no remediation run twice",
        "no intent without an accepted decision",
        "no accepted decision without an intent",
    }
    assert result["intents_run_twice"] == 1


def test_tool_calls_beyond_the_started_intents_are_counted(tmp_path: Path) -> None:
    node = tmp_path / "n1"
    node.mkdir()
    rows: list[dict[str, Any]] = [
        {"tool": "nvidia-smi", "argv": ["-r", "-i", "0"]},
        {"tool": "nvidia-smi", "argv": ["-r", "-i", "0"]},
        {"tool": "nvidia-smi", "argv": ["-i", "0", "--query-gpu=index"]},
    ]
    (node / "calls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tally = _tally(_started("n1", "k1"))
    assert extra_tool_calls(tmp_path, tally) == {"n1/gpu_reset.yml": 1}


def test_the_scenario_spreads_faults_over_distinct_nodes() -> None:
    cfg = SoakConfig(nodes=50, minutes=2, faults_per_min=10)
    plan = scenario(cfg, [f"node-{i:03d}" for i in range(1, 51)])
    nodes = [f["node"] for f in plan["faults"]]
    assert len(nodes) == 20 == len(set(nodes))
    assert all(5.0 <= float(f["at"][:-1]) <= 101.0 for f in plan["faults"])
