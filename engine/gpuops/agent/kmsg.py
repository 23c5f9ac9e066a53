"""XID and NVSwitch SXid errors from the kernel log (/dev/kmsg).

Each /dev/kmsg record is `pri,seq,ts_us,flags[,...];message`, one per read, with
continuation lines (` KEY=value`) after it. The driver prints

    NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python, GPU has fallen off the bus.
    nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 12028, Non-fatal, Link 33 egress ...

An Xid line becomes an `xid` event for the GPU at that PCI address (NVML's PCI info
maps it to the index); an SXid line that opens an error (its text starts "Fatal" or
"Non-fatal"; the driver follows it with detail lines of the same SXid) becomes an `sxid`
event. Both carry source `kmsg`. The NVML event path may report the same XID: the
agent drops the second report of a (gpu, xid) within a short window (gpuops.agent.agent).

Reading starts at the end of the log: records from before the agent started were
either reported by the agent that ran then or are history, and replaying them after
every restart would act on old faults again. Lines longer than MAX_LINE, records
without the kmsg prefix and Xid/SXid lines of an unknown shape are dropped and counted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuops.agent.backend import HealthSignal

log = logging.getLogger(__name__)

DEFAULT_PATH = Path("/dev/kmsg")
MAX_LINE = 4096  # the kernel's own record limit is about 1 KiB
MAX_MESSAGE = 512
SOURCE = "kmsg"
PciKey = tuple[int, int, int]  # PCI domain, bus, device

_RECORD = re.compile(rb"^(?P<pri>\d+),\d+,\d+,[^;]*;")
_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2})(?:\.[0-7])?\):"
    r" (?P<xid>\d{1,6}),\s*(?P<rest>.*)"
)
_SXID = re.compile(
    r"(?P<switch>nvidia-nvswitch\d{1,4}): SXid \(PCI:(?P<pci>[0-9A-Fa-f:.]{1,32})\):"
    r" (?P<sxid>\d{1,6}),\s*(?P<rest>.*)"
)


@dataclass
class KmsgStats:
    """What the reader saw; the agent logs it and tests read it."""

    records: int = 0
    xid: int = 0
    sxid: int = 0
    malformed: int = 0  # no kmsg prefix, an Xid/SXid line of unknown shape, or too long
    unmapped: int = 0  # an Xid for a PCI address NVML does not know


def pci_key(text: str) -> PciKey | None:
    """`0000:18:00` or `00000000:18:00.0` -> (0, 0x18, 0)."""
    parts = text.split(".")[0].split(":")
    if len(parts) != 3:
        return None
    try:
        domain, bus, device = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return domain, bus, device


class KmsgParser:
    """Turns kmsg records into health signals; knows GPUs by PCI address."""

    def __init__(self, pci_map: Callable[[], dict[PciKey, int]]) -> None:
        self._pci_map = pci_map
        self._gpus: dict[PciKey, int] | None = None
        self.stats = KmsgStats()

    def parse(self, line: bytes) -> HealthSignal | None:
        """The signal in one record, or None (another message, a continuation, malformed)."""
        if line.startswith((b" ", b"\t")) or not line.strip():
            return None  # a continuation (KEY=value) of the record before
        self.stats.records += 1
        head = _RECORD.match(line)
        if head is None:
            self.stats.malformed += 1
            return None
        # Only the kernel's own records (facility 0): anyone may write a `user` record
        # to /dev/kmsg, and a forged "NVRM: Xid ... 79" would start a reboot ladder.
        if int(head["pri"]) >> 3 != 0:
            return None
        message = line[head.end() :].decode("utf-8", "replace").rstrip("\n")
        if "NVRM: Xid" in message:
            return self._xid(message)
        if "SXid" in message and "nvswitch" in message:
            return self._sxid(message)
        return None

    def _xid(self, message: str) -> HealthSignal | None:
        m = _XID.match(message)  # the driver's line starts so; a quote inside another is not it
        key = pci_key(m["pci"]) if m else None
        if m is None or key is None:
            self.stats.malformed += 1
            return None
        gpu = self._gpu(key)
        if gpu is None:
            self.stats.unmapped += 1
            log.warning(
                "kernel log XID for PCI %s, which NVML does not know: %s", m["pci"], message
            )
            return None
        self.stats.xid += 1
        data = {"gpu": gpu, "xid": int(m["xid"]), "message": m["rest"][:MAX_MESSAGE]}
        return HealthSignal("xid", data, SOURCE)

    def _sxid(self, message: str) -> HealthSignal | None:
        m = _SXID.match(message)
        if m is None:
            self.stats.malformed += 1
            return None
        rest = m["rest"]
        severity = rest.split(",", 1)[0].strip().lower()
        if severity not in ("fatal", "non-fatal"):
            return None  # a detail line of an SXid already reported
        self.stats.sxid += 1
        data = {
            "switch": m["switch"],
            "pci": m["pci"],
            "sxid": int(m["sxid"]),
            "fatal": severity == "fatal",
            "message": rest[:MAX_MESSAGE],
        }
        return HealthSignal("sxid", data, SOURCE)

    def prime(self) -> None:
        """Learn the GPUs' addresses now, while they answer (XID 79 means one stopped)."""
        self._gpus = self._pci_map()

    def _gpu(self, key: PciKey) -> int | None:
        if self._gpus is None:
            self.prime()
        known = self._gpus or {}
        if key not in known:  # a GPU may have appeared since: ask again, forget none
            known = self._gpus = {**known, **self._pci_map()}
        return known.get(key)


class KmsgReader:
    """Follows a kernel log (or a file or FIFO shaped like one) in a thread."""

    def __init__(self, path: Path, parser: KmsgParser, from_end: bool = True) -> None:
        self.path = path
        self.parser = parser
        self.from_end = from_end
        self._partial = b""
        self._skipping = False  # inside a line longer than MAX_LINE
        self.ready = threading.Event()  # open and at the end: what comes now is read

    @property
    def pending(self) -> int:
        """Bytes of a record read but not yet ended by its newline."""
        return len(self._partial)

    def follow(self, halt: threading.Event, emit: Callable[[HealthSignal], None]) -> None:
        """Read until `halt`, calling `emit` per signal; an unreadable log is logged once."""
        self.parser.prime()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            log.warning("kernel log %s not readable (%s): XIDs come from NVML only", self.path, exc)
            return
        try:
            if self.from_end:
                with contextlib.suppress(OSError):  # a FIFO cannot seek: it has no past
                    os.lseek(fd, 0, os.SEEK_END)
            self.ready.set()
            while not halt.is_set():
                for line in self._read(fd):
                    signal = self.parser.parse(line)
                    if signal is not None:
                        emit(signal)
        finally:
            os.close(fd)

    def _read(self, fd: int) -> list[bytes]:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if not ready:
            return []
        try:
            chunk = os.read(fd, 8192)
        except BlockingIOError:
            return []
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # records overwritten before we read them
                log.warning("kernel log overran; some records were lost")
                return []
            raise
        if not chunk:  # end of a regular file, or a FIFO without a writer: wait for more
            time.sleep(0.2)
            return []
        return self.lines(chunk)

    def lines(self, chunk: bytes) -> list[bytes]:
        """Complete lines in `chunk` after what was left over; over-long ones are dropped."""
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        out = []
        for line in complete:
            if self._skipping:  # the tail of an over-long line, counted when it began
                self._skipping = False
                continue
            if len(line) > MAX_LINE:
                self.parser.stats.malformed += 1
                continue
            out.append(line)
        if len(self._partial) > MAX_LINE:
            if not self._skipping:
                self.parser.stats.malformed += 1
            self._skipping, self._partial = True, b""
        return out
