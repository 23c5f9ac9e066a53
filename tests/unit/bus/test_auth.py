"""A node's own permissions: the agent role's, narrowed to one node."""

from __future__ import annotations

from gpuops import subjects
from gpuops.bus.auth import PERMISSIONS, node_permissions


def test_a_node_may_publish_and_read_only_its_own_subjects() -> None:
    perms = node_permissions("gpu.a1")
    assert perms.publish == (subjects.telemetry("gpu.a1"), "gpuops.events.*.gpu_a1")
    assert perms.subscribe == ("gpuops.agent.gpu_a1.>", "_INBOX.node.gpu_a1.>")
    assert perms.allow_responses


def test_a_node_is_denied_what_only_the_engine_makes_as_a_source_is() -> None:
    denied = node_permissions(subjects.USER_NAME).deny_publish
    assert denied == PERMISSIONS["source"].deny_publish
    only_engine = ("alert", "drift", "chatops", "diagnostics")
    assert {subjects.events_of(k) for k in only_engine} == set(denied)
