"""Kernel-log XID and SXid lines, in the /dev/kmsg record format, read from a file and a FIFO."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from gpuops.agent.backend import HealthSignal
from gpuops.agent.kmsg import MAX_LINE, KmsgParser, KmsgReader, pci_key
from gpuops.agent.nvml import NvmlBackend
from gpuops.models import EVENT_ADAPTER

from tests.conftest import wait_for
from tests.fake_pynvml import FakeNvml

XID_79 = (
    b"3,1024,73125332,-;NVRM: Xid (PCI:0000:18:00): 79, pid=2881, name=python3, "
    b"GPU has fallen off the bus."
)
SXID_FATAL = (
    b"3,1030,73125400,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 24007, Fatal, Link 44 "
    b"sourcetrack timeout error (First)"
)
SXID_DETAIL = (
    b"4,1031,73125401,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 24007, "
    b"Severity 1 Engine instance 44 Sub-engine instance 00"
)


def _parser(gpus: dict[tuple[int, int, int], int] | None = None) -> KmsgParser:
    table = gpus if gpus is not None else {(0, 0x18, 0): 0, (0, 0x2A, 0): 1}
    return KmsgParser(lambda: dict(table))


def test_an_xid_line_becomes_an_xid_for_the_gpu_at_that_address() -> None:
    signal = _parser().parse(XID_79)
    assert signal == HealthSignal(
        "xid",
        {"gpu": 0, "xid": 79, "message": "pid=2881, name=python3, GPU has fallen off the bus."},
        "kmsg",
    )
    other = _parser().parse(b"4,7,9,-;NVRM: Xid (PCI:0000:2a:00): 13, Graphics SM Warp Exception")
    assert other is not None and other.data["gpu"] == 1 and other.data["xid"] == 13


def test_nvml_pci_info_places_the_gpus() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.pci = {0: (0, 0x18, 0), 1: (0, 0x2A, 0)}
    parser = KmsgParser(NvmlBackend(nvml).pci_bus_ids)
    signal = parser.parse(b"4,7,9,-;NVRM: Xid (PCI:0000:2a:00): 48, DBE (double bit error)")
    assert signal is not None and signal.data["gpu"] == 1
    assert pci_key("00000000:2A:00.0") == pci_key("0000:2a:00") == (0, 0x2A, 0)


def test_a_gpu_that_fell_off_after_start_is_still_placed() -> None:
    nvml = FakeNvml(gpus=2)
    nvml.pci = {0: (0, 0x18, 0), 1: (0, 0x2A, 0)}
    parser = KmsgParser(NvmlBackend(nvml).pci_bus_ids)
    parser.prime()
    nvml.lost.add(0)  # NVML no longer answers for it: its address was learnt before
    signal = parser.parse(XID_79)
    assert signal is not None and signal.data["gpu"] == 0


def test_an_unknown_address_is_counted_not_guessed() -> None:
    parser = _parser()
    assert parser.parse(b"4,7,9,-;NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off") is None
    assert parser.stats.unmapped == 1


def test_sxid_opening_lines_become_sxid_events_and_detail_lines_do_not() -> None:
    parser = _parser()
    signal = parser.parse(SXID_FATAL)
    assert signal is not None and signal.kind == "sxid" and signal.source == "kmsg"
    assert signal.data == {
        "switch": "nvidia-nvswitch2",
        "pci": "0000:07:00.0",
        "sxid": 24007,
        "fatal": True,
        "message": "Fatal, Link 44 sourcetrack timeout error (First)",
    }
    assert parser.parse(SXID_DETAIL) is None
    nonfatal = parser.parse(SXID_FATAL.replace(b"Fatal", b"Non-fatal"))
    assert nonfatal is not None and nonfatal.data["fatal"] is False
    event = {"id": "1", "kind": "sxid", "node": "n1", "ts": "2027-01-15T08:00:00Z"}
    EVENT_ADAPTER.validate_python({**event, "source": "kmsg", "data": signal.data})


def test_malformed_lines_are_ignored_and_counted() -> None:
    parser = _parser()
    assert parser.parse(b"NVRM: Xid (PCI:0000:18:00): 79, no kmsg prefix") is None
    assert parser.parse(b"4,7,9,-;NVRM: Xid (PCI:nonsense): 79, bad address") is None
    assert parser.parse(b"4,7,9,-;NVRM: Xid (PCI:0000:18:00): seventy-nine") is None
    assert parser.stats.malformed == 3
    assert parser.parse(b"6,8,10,-;usb 1-1: new high-speed USB device") is None
    assert parser.parse(b" SUBSYSTEM=pci") is None, "a continuation line is not a record"
    assert parser.stats.malformed == 3 and parser.stats.records == 4


def test_over_long_lines_are_dropped_whole_across_reads() -> None:
    reader = KmsgReader(Path("/nonexistent"), _parser())
    long = b"4,1,1,-;" + b"x" * (MAX_LINE + 10)
    got = reader.lines(long[:3000]) + reader.lines(long[3000:] + b"\n" + XID_79 + b"\n")
    assert got == [XID_79] and reader.parser.stats.malformed == 1
    assert reader.lines(b"4,2,2,-;" + b"y" * 100 + b"\n") == [b"4,2,2,-;" + b"y" * 100]


def _follow(
    path: Path, parser: KmsgParser
) -> tuple[list[HealthSignal], threading.Event, KmsgReader]:
    got: list[HealthSignal] = []
    halt = threading.Event()
    reader = KmsgReader(path, parser)
    threading.Thread(target=reader.follow, args=(halt, got.append), daemon=True).start()
    assert reader.ready.wait(10), "the reader opened the log"
    return got, halt, reader


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_following_a_file_starts_at_its_end(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_bytes(XID_79 + b"\n")  # from before the agent started: history
    got, halt, _ = _follow(log, _parser())
    try:
        more = b"4,7,9,-;NVRM: Xid (PCI:0000:2a:00): 48, DBE\n" + SXID_FATAL + b"\n"
        await asyncio.to_thread(_append, log, more)
        await wait_for(lambda: len(got) == 2, 10)
        assert [(s.kind, s.data.get("gpu")) for s in got] == [("xid", 1), ("sxid", None)]
    finally:
        halt.set()


async def test_following_a_fifo_with_records_split_across_writes(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    got, halt, reader = _follow(fifo, _parser())
    try:
        fd = os.open(fifo, os.O_WRONLY)
        os.write(fd, XID_79[:40])
        await wait_for(lambda: reader.pending == 40, 10)  # the first half was read alone
        os.write(fd, XID_79[40:] + b"\n")
        os.close(fd)
        await wait_for(lambda: len(got) == 1, 10)
        assert got[0].data["xid"] == 79
    finally:
        halt.set()


def test_an_unreadable_log_ends_the_reader_quietly(tmp_path: Path) -> None:
    reader = KmsgReader(tmp_path / "missing", _parser())
    got: list[HealthSignal] = []
    reader.follow(threading.Event(), got.append)  # returns: no exception, nothing emitted
    assert got == [] and not reader.ready.is_set()


def test_a_forged_or_quoted_xid_is_not_a_signal() -> None:
    parser = _parser()
    forged = b"14,8,9,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus."
    quoted = b"6,9,9,-;usb 1-1: Product: NVRM: Xid (PCI:0000:18:00): 79, from a USB string"
    real = b"3,10,9,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus."

    assert parser.parse(forged) is None, "facility user (14 >> 3 == 1): anyone can write it"
    assert parser.parse(quoted) is None, "the driver's line starts with NVRM"
    assert parser.parse(real) is not None
