"""Where `gpuops publish` (and the `publish` command) sends each recorded line: its
kind's and node's subject, or `unknown` for a line that is not an event, which the
intake then dead-letters by reason."""

from __future__ import annotations

from gpuops.models import subject_for
from gpuops.ops.commands import recorded_subject


def test_an_event_goes_to_its_kind_and_node_and_anything_else_to_unknown() -> None:
    line = b'{"id": "e1", "kind": "xid", "node": "node-001"}'
    assert recorded_subject(line) == (subject_for("xid", "node-001"), "e1")
    unknown = (subject_for("unknown", "unknown"), None)
    assert recorded_subject(b"not json") == unknown
    assert recorded_subject(b"[1, 2]") == unknown
    # Nested past the parser's depth: routed like any other non-event, not a crash.
    assert recorded_subject(b"[" * 100_000 + b"]" * 100_000) == unknown
