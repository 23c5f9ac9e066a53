"""The engine's HTTP server: `/metrics`, `/healthz`, and routes mounted by other parts
(ChatOps mounts `/chatops/slack` and `/chatops/mattermost`).

It knows nothing of the engine: the metrics come from a Prometheus registry and the
health from a callable, so it sits below every part that serves something over HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

# (ok, detail): an ok answer carries the detail; a degraded one gives it as `why`.
Health = Callable[[], tuple[bool, dict[str, Any]]]
# Adds routes (and their startup/cleanup contexts) to the application.
Mount = Callable[[web.Application], None]
MAX_BODY = 64 * 1024  # chat requests are small; anything larger is refused by aiohttp


class HttpServer:
    """The aiohttp application and its lifecycle."""

    def __init__(
        self, registry: CollectorRegistry, health: Health, mounts: Sequence[Mount] = ()
    ) -> None:
        self.registry = registry
        self.health = health
        self.app = web.Application(client_max_size=MAX_BODY)
        self.app.add_routes([web.get("/metrics", self.metrics), web.get("/healthz", self.healthz)])
        for mount in mounts:
            mount(self.app)
        self._runner: web.AppRunner | None = None

    async def start(self, address: str) -> int:
        """Listen on `host:port` (port 0 picks one); returns the port."""
        host, _, port = address.rpartition(":")
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port))
        await site.start()
        bound = int(self._runner.addresses[0][1])
        log.info("http on %s:%d", host or "127.0.0.1", bound)
        return bound

    async def stop(self) -> None:
        """Stop listening (mounted parts run their cleanup)."""
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
