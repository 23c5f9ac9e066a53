"""Real Redfish services on loopback for facility readings: sushy-tools' static emulator
(`sushy-static`) serving the mockups in examples/redfish (an H200 server's BMC, a coolant
distribution unit with a pump and a leak detector) over HTTPS, with a certificate from a
CA made for this peer alone.

The static emulator reads a resource's `index.json` on every GET, so a test changes what
the service reports by writing the mockup's file (`Facility.set`), as a CDU's firmware
changes what it serves.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.peers.redfish import _certificates, _kill, _spawn, missing
from tests.support import free_port

MOCKUPS = Path(__file__).resolve().parents[2] / "examples" / "redfish"
START_S = 30.0


@dataclass(frozen=True, slots=True)
class Facility:
    """One running static emulator: its URL, its CA and its mockup directory."""

    root: Path
    mockup: Path
    port: int

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.root / "ca.pem"

    def get(self, path: str) -> dict[str, Any]:
        context = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(self.url + path, context=context, timeout=10) as answer:
            body: dict[str, Any] = json.load(answer)
        return body

    def set(self, resource: str, change: dict[str, Any]) -> None:
        """Merge `change` into a resource's document (`ThermalEquipment/CDUs/1`)."""
        path = self.mockup / resource / "index.json"
        doc = json.loads(path.read_text())
        doc.update(change)
        path.write_text(json.dumps(doc, indent=2))


def _wait(peer: Facility) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            peer.get("/redfish/v1")
            return
        time.sleep(0.2)
    log = (peer.root / "static.log").read_text(errors="replace")
    raise RuntimeError(f"sushy-static did not answer within {START_S:.0f}s:\n{log}")


@contextlib.contextmanager
def facility(root: Path, mockup: str) -> Iterator[Facility]:
    """`mockup` (server or cdu) served for the `with` block; stopped after."""
    why = missing()
    if why is not None:
        raise RuntimeError(why)
    root.mkdir(parents=True, exist_ok=True)
    served = root / "mockup"
    shutil.copytree(MOCKUPS / mockup, served)
    _certificates(root)
    peer = Facility(root, served, free_port())
    argv = [sys.executable, "-m", "sushy_tools.static.main", "-i", "127.0.0.1"]
    argv += ["-p", str(peer.port), "-m", str(served)]
    argv += ["-c", str(root / "server.pem"), "-k", str(root / "server.key")]
    _spawn(root, "static", argv)
    try:
        _wait(peer)
        yield peer
    finally:
        _kill(root / "static.pid")
