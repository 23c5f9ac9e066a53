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


def _full(path: Path) -> Spool:
    spool = Spool(path, max_events=5)
    for n in range(1, 6):
        spool.push(_event(n))
    return spool


async def test_an_event_pushed_while_a_flush_awaits_its_acks_is_kept(tmp_path: Path) -> None:
    """The reviewer's race: a full spool flushing, an XID arriving at the second ack."""
    spool, sent = _full(tmp_path / "spool.jsonl"), []

    async def send(item: Spooled) -> bool:
        sent.append(item.msg_id)
        if len(sent) == 2:
            spool.push(_event(6))
        return True

    assert await spool.flush(send)
    assert sent == ["e1", "e2", "e3", "e4", "e5"]
    assert [i.msg_id for i in spool.pending()] == ["e6"], "the unsent event stays"
    assert [i.msg_id for i in Spool(tmp_path / "spool.jsonl").pending()] == ["e6"]
    assert spool.dropped == 0, "nothing was lost"


async def test_a_drop_during_a_flush_is_of_an_unsent_event_and_it_is_not_sent(
    tmp_path: Path,
) -> None:
    spool, sent = _full(tmp_path / "spool.jsonl"), []

    async def send(item: Spooled) -> bool:
        sent.append(item.msg_id)
        if len(sent) == 2:  # e2 awaits its ack: the push drops e3, the oldest unsent
            spool.push(_event(6))
            spool.push(_event(7))
        return True

    assert await spool.flush(send)
    assert sent == ["e1", "e2", "e4", "e5"]
    assert [i.msg_id for i in spool.pending()] == ["e6", "e7"]
    assert spool.dropped == 1


def test_a_full_spool_drops_replaceable_events_before_older_faults(tmp_path: Path) -> None:
    path = tmp_path / "spool.jsonl"
    spool = Spool(path, max_events=3)
    spool.push(_event(1))  # an XID
    for n in (2, 3):  # an hour's passing probes
        spool.push(Spooled("gpuops.events.probe.n1", json.dumps({"n": n}), f"e{n}", True))
    spool.push(_event(4))
    spool.push(_event(5))
    assert [i.msg_id for i in spool.pending()] == ["e1", "e4", "e5"]
    assert spool.dropped == 2
    spool.push(_event(6))  # no replaceable one left: the oldest goes
    assert [i.msg_id for i in Spool(path, max_events=3).pending()] == ["e4", "e5", "e6"]
