"""Subjects are built and parsed in one place; inventories cannot hold colliding tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops import subjects
from gpuops.errors import ConfigError, EventError
from gpuops.inventory.hosts import load_inventory
from gpuops.models import action_subject, subject_for, subject_token


def test_every_subject_comes_from_the_node_token() -> None:
    assert subjects.telemetry("gpu.a1") == "gpuops.telemetry.gpu_a1"
    assert subjects.event("xid", "gpu.a1") == "gpuops.events.xid.gpu_a1"
    assert subjects.event("telemetry", "n1") == "gpuops.telemetry.n1"
    assert subjects.action("n1") == "gpuops.actions.n1"
    assert subjects.audit("n1") == "gpuops.audit.n1"
    assert subjects.audit("") == "gpuops.audit._fleet"
    assert subjects.dlq("future") == "gpuops.dlq.future"
    assert subjects.probe_request("gpu.a1") == "gpuops.agent.gpu_a1.probe"


def test_node_patterns_take_a_node_or_the_user_name_template() -> None:
    assert subjects.telemetry("gpu.a1") == "gpuops.telemetry.gpu_a1"
    assert subjects.events_from("gpu.a1") == "gpuops.events.*.gpu_a1"
    assert subjects.agent_requests_to("gpu.a1") == "gpuops.agent.gpu_a1.>"
    # The template stays whole: nats-server fills it in from the user's JWT name.
    assert subjects.telemetry(subjects.USER_NAME) == "gpuops.telemetry.{{name()}}"
    assert subjects.events_from(subjects.USER_NAME) == "gpuops.events.*.{{name()}}"
    assert subjects.agent_requests_to(subjects.USER_NAME) == "gpuops.agent.{{name()}}.>"
    # Anything else with braces is a node name, made one token like every other.
    assert subjects.telemetry("{{tag(x)}}") == "gpuops.telemetry.__tag_x___"


def test_models_re_export_the_same_builders() -> None:
    assert subject_token("a.b") == subjects.token("a.b") == "a_b"
    assert subject_for("xid", "a.b") == subjects.event("xid", "a.b")
    assert action_subject("a.b") == subjects.action("a.b")


@pytest.mark.parametrize(("kind", "node"), [("telemetry", "gpu.a1"), ("xid", "n-1"), ("ecc", "x")])
def test_parse_gives_back_what_build_made(kind: str, node: str) -> None:
    assert subjects.parse_event(subjects.event(kind, node)) == (kind, subjects.token(node))


@pytest.mark.parametrize(
    "subject", ["gpuops.events.xid.n1.x", "gpuops.telemetry", "gpuops.actions.n1", "a.b.c.d"]
)
def test_parse_refuses_any_other_shape(subject: str) -> None:
    with pytest.raises(EventError) as caught:
        subjects.parse_event(subject)
    assert caught.value.reason == "subject_mismatch"


def test_inventory_with_hosts_sharing_a_subject_token_is_refused(tmp_path: Path) -> None:
    # gpu.a1 and gpu_a1 both publish on gpuops.telemetry.gpu_a1: one could act for the other.
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[gpu]\ngpu.a1\ngpu_a1\ngpu-b2\n")
    with pytest.raises(ConfigError, match=r"'gpu.a1' and 'gpu_a1' share the subject token"):
        load_inventory(inventory)
    inventory.write_text("[gpu]\ngpu.a1\ngpu-b2\n")
    assert load_inventory(inventory).hosts == {"gpu.a1", "gpu-b2"}


def test_the_intake_checks_the_publisher_of_samples_and_events_only() -> None:
    assert subjects.is_checked(subjects.telemetry("n1"))
    assert subjects.is_checked(subjects.event("xid", "n1"))
    assert not subjects.is_checked(subjects.audit("n1"))
    assert not subjects.is_checked(subjects.action("n1"))
    assert not subjects.is_checked(subjects.dlq("forged"))
