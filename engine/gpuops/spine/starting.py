"""`/healthz` while `run` starts: degraded, saying what it waits for.

An executor started with its engines on a new NATS waits for the streams and buckets
they make (gpuops.bus.conn); the engine's own loops, and its HTTP server, start only
once they are there. Meanwhile a probe of `/healthz` gets a 503 naming the wait rather
than a refused connection, which a service manager cannot tell from a process that died.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gpuops.http import HttpServer
from gpuops.settings import HttpLimits


class Starting:
    """The HTTP address's `/healthz` until the engine's own server takes the address over."""

    def __init__(self, limits: HttpLimits | None = None) -> None:
        self.why = "connecting to NATS"
        self.limits = limits
        self._server: HttpServer | None = None

    def note(self, why: str) -> None:
        """What the start waits for now (gpuops.bus.conn.Waiting)."""
        self.why = why

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Never ready: the engine is not running yet."""
        return False, {"starting": self.why}

    async def serve(self, address: str | None) -> None:
        """Answer on `address` (host:port), if one is given."""
        if address:
            self._server = HttpServer(CollectorRegistry(), self.health, limits=self.limits)
            await self._server.start(address)

    async def stop(self) -> None:
        """Free the address for the engine's server."""
        if self._server is not None:
            await self._server.stop()
            self._server = None
