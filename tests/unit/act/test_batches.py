"""Which intents share a run, what each host of a run sees, and each host's own status."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.act.hostdata import Target, batch_key, host_data
from gpuops.act.playbooks import PlaybookVersion
from gpuops.act.runner import RunRequest, RunResult
from gpuops.models import ActionSpec, Intent, RunStatus


def _intent(node: str, playbook: str = "drain.yml", **vars_: object) -> Intent:
    return Intent(
        key=f"k-{node}",
        rule="overheat",
        node=node,
        gpu=3,
        gpus=(3, 5),
        action=ActionSpec(playbook=playbook, vars=dict(vars_)),
        event_id=f"e-{node}",
        event_ts=1.0,
        decided_at=2.0,
    )


def test_intents_differing_only_in_per_host_data_share_a_batch() -> None:
    a = _intent("node-001", reason="GPU 3 at 91 C")
    b = _intent("node-002", reason="GPU 0 at 95 C")
    assert batch_key(a) == batch_key(b)


@pytest.mark.parametrize(
    "other",
    [
        _intent("node-002", playbook="reboot.yml"),
        _intent("node-002", watts="500"),
        _intent("node-002").model_copy(
            update={"action": ActionSpec(playbook="drain.yml", ref="v1")}
        ),
        _intent("node-002").model_copy(
            update={"action": ActionSpec(playbook="drain.yml", timeout_s=5)}
        ),
    ],
    ids=["playbook", "vars", "ref", "timeout"],
)
def test_another_playbook_ref_timeout_or_shared_var_is_another_batch(other: Intent) -> None:
    assert batch_key(_intent("node-001")) != batch_key(other)


def test_each_host_sees_its_own_intent_and_the_rules_vars() -> None:
    data = host_data(_intent("node-007", watts="500", reason="hot"))
    assert data == {
        "watts": "500",
        "reason": "hot",
        "rule": "overheat",
        "node": "node-007",
        "gpu": 3,
        "gpus": [3, 5],
        "event_id": "e-node-007",
        "intent_key": "k-node-007",
        "episode": "",
    }


def test_vars_may_not_redefine_what_the_engine_sets() -> None:
    with pytest.raises(ValueError, match="may not redefine \\['intent_key'\\]"):
        host_data(_intent("node-001", intent_key="someone else's"))


def test_a_run_names_each_host_once_and_limits_to_exactly_them() -> None:
    version = PlaybookVersion(Path("drain.yml"), None, "0" * 64)
    intents = [_intent("node-001"), _intent("node-002")]
    request = RunRequest.for_intents(intents, version, Path("inv"), 60, forks=10)
    assert request.limit == "node-001,node-002" and request.forks == 2
    assert [t.node for t in request.targets] == ["node-001", "node-002"]
    with pytest.raises(ValueError, match="each host once"):
        RunRequest.for_intents([intents[0], intents[0]], version, Path("inv"), 60)


def _result(status: str, rc: int, stats: dict[str, dict[str, int]]) -> RunResult:
    version = PlaybookVersion(Path("drain.yml"), None, "0" * 64)
    intents = [_intent(h) for h in ("a", "b")]
    request = RunRequest.for_intents(intents, version, Path("inv"), 60)
    return RunResult(req=request, started=0.0, ended=1.0, status=status, rc=rc, stats=stats)


def test_one_failed_host_fails_alone() -> None:
    result = _result("failed", 2, {"a": {"ok": 3, "failures": 1}, "b": {"ok": 4}})
    result.failed["a"] = ("Drain the node in Slurm", "non-zero return code: no such node")
    a, b = (result.outcome(Target.of(_intent(h))) for h in ("a", "b"))
    assert a.status is RunStatus.FAILED and a.failed_task == "Drain the node in Slurm"
    assert a.failed_message == "non-zero return code: no such node"
    assert a.error == "task 'Drain the node in Slurm' failed: non-zero return code: no such node"
    assert b.status is RunStatus.SUCCESSFUL and b.failed_task is None and b.error is None
    assert a.stats == {"a": {"ok": 3, "failures": 1}} and b.stats == {"b": {"ok": 4}}


def test_an_unreachable_host_is_unreachable_and_the_others_finish() -> None:
    result = _result("failed", 4, {"a": {"dark": 1}, "b": {"ok": 4}})
    assert result.host_status("a") is RunStatus.UNREACHABLE
    assert result.host_status("b") is RunStatus.SUCCESSFUL


def test_a_play_stopped_for_every_host_fails_the_hosts_without_a_failure() -> None:
    # any_errors_fatal (rc bit 8): the clean host did not finish its tasks.
    result = _result("failed", 2 | 8, {"a": {"failures": 1}, "b": {"ok": 1}})
    assert result.host_status("b") is RunStatus.FAILED


@pytest.mark.parametrize(
    ("status", "expected"),
    [("timeout", RunStatus.TIMEOUT), ("canceled", RunStatus.CANCELED)],
)
def test_a_run_that_timed_out_or_was_canceled_is_so_for_every_host(
    status: str, expected: RunStatus
) -> None:
    result = _result(status, 254, {"a": {"ok": 2}})
    assert result.host_status("a") is expected and result.host_status("b") is expected


def test_a_host_missing_from_a_successful_run_did_not_run() -> None:
    assert _result("successful", 0, {"a": {"ok": 2}}).host_status("b") is RunStatus.ERROR


def test_an_intent_of_one_gpu_names_it_in_the_list_per_gpu_playbooks_read() -> None:
    one = _intent("node-007").model_copy(update={"gpu": 2, "gpus": ()})
    assert host_data(one)["gpus"] == [2]
    node_level = _intent("node-007").model_copy(update={"gpu": None, "gpus": ()})
    assert host_data(node_level)["gpus"] == []
