"""A node's timeline entries from audit records: faults, drops, runs, validation, notes."""

from __future__ import annotations

from gpuops.console.views import Entry, entry, folded
from gpuops.models import AuditRecord


def _decision(rule: str, reason: str, accepted: bool) -> AuditRecord:
    facts = {"index": 3, "uuid": "GPU-1", "temp_c": 88.0, "temp_slowdown_c": 89.0}
    body = {"decision": {"reason": reason, "accepted": accepted, "detail": ""}, "facts": facts}
    return AuditRecord(type="decision", at=1.0, node="n", rule=rule, summary="s", body=body)


def test_decisions_are_faults_drops_or_validation() -> None:
    fault = entry(_decision("gpu-overheat", "accepted", True))
    assert fault.kind == "fault" and fault.facts == {"temp_c": 88.0, "temp_slowdown_c": 89.0}
    assert entry(_decision("drift-needs-approval", "approval_pending", False)).kind == "fault"
    drop = entry(_decision("gpu-overheat", "cooldown", False))
    assert (drop.kind, drop.detail) == ("drop", "cooldown")
    assert entry(_decision("validation-passed", "accepted", True)).kind == "validation"


def test_a_run_links_its_output_and_names_its_revision_and_failed_task() -> None:
    body = {
        "intent_key": "k",
        "rule": "r",
        "node": "n",
        "playbook": "drain.yml",
        "status": "failed",
        "rc": 2,
        "started": 1.0,
        "ended": 4.5,
        "run_id": "20260101T120000-1a2b3c4d",
        "revision": "838293f8f3cd0000",
        "failed_task": "drain",
        "failed_message": "jobs would not leave",
    }
    run = entry(AuditRecord(type="run", at=2.0, node="n", rule="r", summary="x", body=body))
    assert (run.kind, run.run_id, run.outcome) == ("run", "20260101T120000-1a2b3c4d", "failed")
    assert run.revision == "838293f8f3cd0000"
    assert run.title == "drain.yml failed rc=2 in 3.5s"
    assert run.detail == "task 'drain': jobs would not leave"
    hidden = run.for_anonymous()
    assert "drain" not in hidden.detail and hidden.outcome == "failed"
    note = entry(AuditRecord(type="note", at=3.0, node="n", summary="episode resolved"))
    assert (note.kind, note.title) == ("note", "episode resolved")


def test_a_decision_line_names_the_gpus_it_is_about() -> None:
    record = _decision("xid-79-gpu-lost", "accepted", True)
    record.body["decision"]["match"] = {"gpu": None, "gpus": [4, 1]}
    assert entry(record).where == "GPUs 1,4", "a per-node match on several GPUs"
    record.body["decision"]["match"] = {"gpu": 3, "gpus": [3]}
    assert entry(record).where == "GPU 3"
    del record.body["decision"]["match"]
    assert entry(record).where == "GPU 3", "an older record: the fact's index"
    note = entry(AuditRecord(type="note", at=3.0, node="n", summary="episode resolved"))
    assert note.where == ""


def test_the_same_drop_in_a_row_is_one_line_with_a_count_and_its_first_and_last_time() -> None:
    def drop(at: float, reason: str = "cooldown", repeats: int = 0, rule: str = "r") -> Entry:
        record = _decision(rule, reason, False)
        body = {**record.body, "repeats_suppressed": repeats}
        return entry(record.model_copy(update={"at": at, "body": body}))

    first = drop(60.0, repeats=7)  # its repeats came before it: not this line's
    both = folded(first, drop(120.0, repeats=4))
    assert both is not None and (both.count, both.at, both.last_at) == (6, 60.0, 120.0)
    assert (both.when, both.last_when) == ("1970-01-01 00:01:00", "1970-01-01 00:02:00")
    assert folded(both, drop(180.0, "locked")) is None, "another reason: another line"
    assert folded(both, drop(180.0, rule="other")) is None, "another rule: another line"
    fault = entry(_decision("r", "accepted", True))
    assert folded(fault, entry(_decision("r", "accepted", True))) is None, "faults stay"


def test_a_grade_run_shows_its_verdict_and_its_failing_numbers_first() -> None:
    grade = {
        "grade": 2,
        "checks": [
            {"name": "gpus:count", "ok": True, "value": 8.0, "expect": "== 8"},
            {
                "name": "nvbandwidth:device_to_device",
                "ok": False,
                "value": 120.0,
                "expect": ">= 335 GB/s",
                "unit": "GB/s",
                "gpu": 5,
            },
        ],
    }
    body = {
        "intent_key": "k",
        "rule": "r",
        "node": "n",
        "playbook": "diagnose.yml",
        "status": "failed",
        "started": 1.0,
        "ended": 31.0,
        "grade": grade,
    }
    run = entry(AuditRecord(type="run", at=2.0, node="n", rule="r", summary="x", body=body))
    assert run.title.endswith(
        "; grade 2 failed: nvbandwidth device_to_device GPU 5 120.0 GB/s (expect >= 335 GB/s)"
    ), run.title
    assert run.detail.startswith("FAIL nvbandwidth device_to_device GPU 5 120.0 GB/s"), run.detail
    assert "gpus count 8.0 (expect == 8)" in run.detail
