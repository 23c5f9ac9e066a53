"""A decision's audit message id names its whole match: one event's decisions on the
GPUs of a node are each stored, however long the event id or the node's name."""

from __future__ import annotations

import json

import pytest
from gpuops.bus.publish import MemoryPublisher
from gpuops.models import ActionSpec, Decision, Match, Reason
from gpuops.record.audit import Auditor
from gpuops.record.recorder import decision_msg_id, decision_record

T0 = 1_800_000_000.0


def _decision(event_id: str, node: str, gpu: int) -> Decision:
    match = Match(
        rule="nvlink-recovery-errors-increasing",
        kind="telemetry",
        node=node,
        gpu=gpu,
        key=f"{node}/{gpu}",
        event_id=event_id,
        event_ts=T0,
        at=T0,
        facts={"node": node, "gpu": gpu},
    )
    return Decision(
        match=match,
        accepted=True,
        reason=Reason.ACCEPTED,
        actions=(ActionSpec(playbook="gpu_reset.yml"),),
    )


@pytest.mark.parametrize(
    ("event_id", "node"),
    [
        pytest.param("e" * 200, "node-001", id="event id of 200 characters"),
        pytest.param(
            "0f8fad5b-d9cb-469f-a165-70867728950e", "n" * 170 + ".gpu.local", id="long node name"
        ),
    ],
)
async def test_each_gpu_decision_of_one_event_is_stored(event_id: str, node: str) -> None:
    publisher = MemoryPublisher()
    auditor = Auditor(publisher)
    for gpu in range(8):
        d = _decision(event_id, node, gpu)
        await auditor.write(decision_record(d, [], T0), decision_msg_id(d))
    stored = [
        json.loads(payload)["body"]["decision"]["match"]["gpu"] for _, payload in publisher.messages
    ]
    assert stored == list(range(8))


def test_the_id_is_the_same_for_the_same_decision_and_fits_jetstream() -> None:
    first, again = _decision("e" * 200, "n" * 253, 3), _decision("e" * 200, "n" * 253, 3)
    assert decision_msg_id(first) == decision_msg_id(again)
    assert len(decision_msg_id(first)) <= 250
