"""The spool's file: a line that does not read, or a write that fails, loses no other event."""

from __future__ import annotations

import json
from pathlib import Path

from gpuops.agent.spool import Spool, Spooled


def _event(n: int) -> Spooled:
    return Spooled("gpuops.events.xid.n1", json.dumps({"n": n}), f"e{n}")


def test_a_line_that_does_not_read_is_skipped_counted_and_rewritten_away(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    Spool(path).push(_event(1))
    good = path.read_text()
    path.write_bytes(good.encode() + b'{"subject": "gpuops.ev\n\xff\xfe\n[1, 2]\n' + good.encode())
    spool = Spool(path)
    assert [i.msg_id for i in spool.pending()] == ["e1", "e1"]
    assert spool.unreadable == 3 and spool.dropped == 3, "each lost line is a dropped event"
    spool.push(_event(2))
    assert [json.loads(line)["msg_id"] for line in path.read_text().splitlines()] == [
        "e1",
        "e1",
        "e2",
    ]
    assert Spool(path).dropped == 3, "the count outlives a restart"


def test_a_failed_write_keeps_the_events_in_memory_within_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    path.mkdir()  # a directory where the file should be: like a full disk, writes fail
    spool = Spool(path, max_events=3)
    for n in range(1, 5):
        spool.push(_event(n))
    assert [i.msg_id for i in spool.pending()] == ["e2", "e3", "e4"]
    assert spool.write_failures == 4 and spool.dropped == 1
    path.rmdir()  # the disk has room again: the next write puts everything held there
    spool.push(_event(5))
    assert [i.msg_id for i in Spool(path).pending()] == ["e3", "e4", "e5"]
