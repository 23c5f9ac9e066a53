"""The drift check reads differences from a typed key in task results, never from task names."""

from __future__ import annotations

from gpuops.act.driftcheck import DRIFT_KEY, drift_records


def test_a_result_carrying_the_key_gives_typed_records() -> None:
    res = {
        "changed": True,
        "msg": {
            DRIFT_KEY: [
                {"setting": "power_limit", "gpu": "1", "expected": 700.0, "actual": 400.0},
                {"setting": "driver_version", "gpu": None, "expected": "1.2", "actual": "1.1"},
            ]
        },
    }
    assert drift_records(res) == [
        {"setting": "power_limit", "gpu": 1, "expected": 700.0, "actual": 400.0},
        {"setting": "driver_version", "gpu": None, "expected": "1.2", "actual": "1.1"},
    ]


def test_a_task_name_or_an_untyped_message_is_not_drift() -> None:
    # What the old name-based contract looked like: a changed debug with a dict message.
    named = {"changed": True, "msg": {"setting": "ecc_mode", "expected": "Enabled"}}
    assert drift_records(named) == []
    assert drift_records({"msg": "Drift ecc_mode"}) == []
    assert drift_records({"msg": {DRIFT_KEY: "not a list"}}) == []
    assert drift_records(None) == []
