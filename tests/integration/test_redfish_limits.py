"""The Redfish source's bounds against a real HTTP server on loopback that answers
the service root with far more than `max_bytes`: with an honest Content-Length, with
none (the body ends when the connection does), and with a small Content-Length that a
chunked body overrides. The client gives up at the limit; it never buffers the body.
A BMC that trickles its answer is given up at the end of the poll, and a read still
running keeps its target from being read again (one thread a target, not one a poll)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.errors import SourceError
from gpuops.inventory.hosts import Inventory
from gpuops.settings import RedfishSourceSettings, RedfishTarget
from gpuops.sources.redfish import CHUNK, Reading, RedfishSource, read_target

MAX_BYTES = 1 << 20
BODY = 64 * MAX_BYTES  # what the server would send, were it read
PIECE = b" " * CHUNK  # JSON whitespace: the body is well-formed as far as it goes


@dataclass
class Flood:
    """A server answering every GET with BODY bytes, framed as `framing` says; `sent`
    counts what it got onto the socket before the client hung up."""

    framing: str
    port: int = 0
    sent: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _handler(flood: Flood) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if flood.framing == "honest":
                self.send_header("Content-Length", str(BODY))
            elif flood.framing == "lying":  # chunked framing overrides the length
                self.send_header("Content-Length", "100")
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(BODY // CHUNK):
                    frame = b"%x\r\n%s\r\n" % (CHUNK, PIECE) if flood.framing == "lying" else PIECE
                    self.wfile.write(frame)
                    flood.sent += CHUNK
            except OSError:  # the client hung up: what it did not read is never sent
                pass
            finally:
                self.close_connection = True
                flood.done.set()

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def flood(framing: str) -> Iterator[Flood]:
    """A Flood serving on a loopback port for the `with` block."""
    f = Flood(framing)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(f))
    server.daemon_threads = True
    # A small send buffer: the server's count is then close to what the client took.
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK)
    f.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("framing", ["honest", "none", "lying"])
def test_a_body_past_max_bytes_is_refused_without_being_buffered(framing: str) -> None:
    with flood(framing) as f:
        cfg = RedfishSourceSettings(max_bytes=MAX_BYTES, timeout_s=10)
        tracemalloc.start()
        try:
            with pytest.raises(SourceError) as caught:
                read_target(RedfishTarget(node="cdu-a", url=f.url), cfg)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert f.done.wait(10), "the server saw the client hang up"
    err = caught.value
    assert err.reason == "too_large" and err.target == f.url
    assert f"max_bytes ({MAX_BYTES} bytes)" in str(err) and "/redfish/v1" in str(err)
    # The client held at most the limit and a chunk (1 MiB + 64 KiB), not the 64 MiB.
    assert peak < 2 * MAX_BYTES + 4 * CHUNK, f"peak {peak} bytes"
    # And it stopped reading there: the server could not send much past it (the rest of
    # the slack is the kernel's socket buffers on loopback).
    assert f.sent < BODY // 4, f"the server sent {f.sent} bytes"
    if framing == "honest":  # refused on its Content-Length, before the body
        assert str(BODY) in str(err)


@contextlib.contextmanager
def trickle(length: int, every_s: float) -> Iterator[Flood]:
    """A BMC answering every GET with a JSON body of `length` bytes, one byte each
    `every_s`: each read comes in within any timeout, the whole body never soon."""
    f = Flood("trickle")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(length))
            self.end_headers()
            try:
                for _ in range(length):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    f.sent += 1
                    if f.done.wait(every_s):
                        break
            except OSError:
                pass
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    f.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f
    finally:
        f.done.set()
        server.shutdown()
        server.server_close()


def test_a_bmc_trickling_its_answer_is_given_up_at_the_end_of_the_poll() -> None:
    # 4 KiB at a byte every 0.2 s would hold the read for 14 minutes; each byte comes
    # well within the 5 s timeout. The poll's interval (1 s) bounds the whole read.
    with trickle(4096, 0.2) as f:
        cfg = RedfishSourceSettings(interval_s=1, timeout_s=5)
        with pytest.raises(SourceError) as caught:
            read_target(RedfishTarget(node="cdu-a", url=f.url), cfg)
    assert caught.value.reason == "slow" and "not read within the poll" in str(caught.value)
    assert 0 < f.sent < 60, f"the read stopped near the interval, after {f.sent} bytes"


async def test_a_target_whose_last_read_goes_on_is_not_read_again_meanwhile() -> None:
    # A thread cannot be stopped: while a target's read is still running, each poll
    # says so instead of starting another thread behind it.
    release, calls = threading.Event(), []

    def stuck(target: RedfishTarget, cfg: RedfishSourceSettings) -> list[Reading]:
        calls.append(target.url)
        release.wait(30)
        return []

    target = RedfishTarget(node="cdu-a", url="http://127.0.0.1:9")
    cfg = RedfishSourceSettings(targets=(target,), interval_s=0.2)
    inventory = Inventory(Path("inv"), frozenset({"cdu-a"}), {}, {})
    source = RedfishSource(cfg, inventory, MemoryPublisher(), ManualClock(0.0), read=stuck)
    for _ in range(3):
        await source.poll_once()
    assert calls == [target.url], "one thread for the target, not one a poll"
    assert "still reading from the last poll" in source.failed[target.url]
    release.set()
    await asyncio.sleep(0.2)
    await source.poll_once()
    assert calls == [target.url] * 2, "read again once the last read ended"
    assert target.url not in source.failed
