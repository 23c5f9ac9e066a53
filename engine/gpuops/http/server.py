"""The engine's HTTP server: `/metrics`, `/healthz`, and routes mounted by other parts
(ChatOps mounts `/chatops/slack` and `/chatops/mattermost`).

It knows nothing of the engine: the metrics come from a Prometheus registry and the
health from a callable, so it sits below every part that serves something over HTTP.

What a client may hold is bounded (settings.HttpLimits): aiohttp's keep-alive timer
closes a connection whose request headers have not all come within `read_timeout_s`
of its opening or of the previous answer, a middleware closes one whose body has not
all come within `read_timeout_s` of its headers, and past `max_connections` open at
once a new connection is answered 503 and closed (aiohttp has no such cap).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter, generate_latest

from gpuops.settings import HttpLimits

log = logging.getLogger(__name__)

# (ok, detail): an ok answer carries the detail; a degraded one gives it as `why`.
Health = Callable[[], tuple[bool, dict[str, Any]]]
# Adds routes (and their startup/cleanup contexts) to the application.
Mount = Callable[[web.Application], None]
MAX_BODY = 64 * 1024  # chat requests are small; anything larger is refused by aiohttp
BUSY = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpServer:
    """The aiohttp application and its lifecycle."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Health,
        mounts: Sequence[Mount] = (),
        limits: HttpLimits | None = None,
    ) -> None:
        self.registry = registry
        self.health = health
        self.limits = limits or HttpLimits()
        deadline = body_deadline(self.limits.read_timeout_s)
        self.app = web.Application(client_max_size=MAX_BODY, middlewares=[deadline])
        self.app.add_routes([web.get("/metrics", self.metrics), web.get("/healthz", self.healthz)])
        for mount in mounts:
            mount(self.app)
        self.refused = Counter(
            "gpuops_http_connections_refused",
            "Connections answered 503 and closed at once: http_limits.max_connections were open",
            registry=registry,
        )
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None

    async def start(self, address: str) -> int:
        """Listen on `host:port` (port 0 picks one); returns the port."""
        host, _, port = address.rpartition(":")
        # The keep-alive timer runs from a connection's opening and from each answer, and
        # closes it while no whole request has come: the bound on headers (and on idling).
        runner = web.AppRunner(
            self.app, access_log=None, keepalive_timeout=self.limits.read_timeout_s
        )
        await runner.setup()
        assert runner.server is not None  # set up above
        self._runner = runner
        gate = Gate(runner.server, self.limits.max_connections, self.refused.inc)
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(gate, host or "127.0.0.1", int(port))
        bound = int(self._listener.sockets[0].getsockname()[1])
        log.info("http on %s:%d", host or "127.0.0.1", bound)
        return bound

    async def stop(self) -> None:
        """Stop listening (mounted parts run their cleanup)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def metrics(self, request: web.Request) -> web.Response:
        """The registry in the Prometheus text format."""
        body = generate_latest(self.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        """200 `{"status": "ok", ...detail}`, or 503 `{"status": "degraded", "why": detail}`."""
        ok, detail = self.health()
        if ok:
            return web.json_response({**detail, "status": "ok"})
        return web.json_response({"status": "degraded", "why": detail}, status=503)


def body_deadline(timeout_s: float) -> Middleware:
    """A middleware closing a request's connection when its body has not all come within
    `timeout_s` of its headers (a handler reading it would otherwise wait forever)."""

    @web.middleware
    async def deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        timer = asyncio.get_running_loop().call_later(timeout_s, _cut_short, request)
        try:
            return await handler(request)
        finally:
            timer.cancel()

    return deadline


def _cut_short(request: web.Request) -> None:
    if not request.content.is_eof() and request.transport is not None:
        log.warning("http: closed %s: its request body was still coming", request.remote)
        request.transport.close()


class Gate:
    """The listener's protocol factory: aiohttp's handler for each new connection while
    fewer than `cap` are open, else one that answers 503 and closes at once."""

    def __init__(self, server: web.Server, cap: int, on_refused: Callable[[], None]) -> None:
        self.server, self.cap, self.on_refused = server, cap, on_refused
        # Counted here, not from the server's own list: a burst of connections is
        # accepted before any of them reaches aiohttp's connection_made.
        self.open = 0

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            self.on_refused()
            return _Busy()
        self.open += 1
        return _Counted(self.server(), self)


class _Busy(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(BUSY)
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's handler for one connection, uncounted from its gate when it closes."""

    def __init__(self, inner: asyncio.Protocol, gate: Gate) -> None:
        self.inner, self.gate = inner, gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.open -= 1
        self.inner.connection_lost(exc)
