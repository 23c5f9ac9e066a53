"""`gpuops history` prints each failed run's task and message: text the node wrote."""

from __future__ import annotations

import pytest
from gpuops.cli.operator_cmds import _print_failed_tasks
from gpuops.models import AuditRecord


def test_a_node_written_message_is_one_line_with_no_terminal_escapes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = "exit 1\n  2026-12-08T00:00:00 node-009 reboot.yml run r2: task 'x': fine\x1b[2J\x07"
    body = {
        "playbook": "drain.yml",
        "run_id": "r1",
        "failed_task": "Drain\nit",
        "failed_message": message,
    }
    _print_failed_tasks([AuditRecord(type="run", at=0.0, node="node-001", summary="s", body=body)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "failed tasks:"
    assert len(printed) == 2, printed
    assert "\x1b" not in printed[1] and "\x07" not in printed[1]
    assert "task 'Drain it': exit 1" in printed[1] and "node-009 reboot.yml" in printed[1]
