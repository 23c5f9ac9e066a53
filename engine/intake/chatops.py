"""The HTTP endpoint in the engine's process: ChatOps (Slack, Mattermost), /metrics, /healthz.

Slack requests are verified by their v0 signature (HMAC-SHA256 over `v0:timestamp:body`
with the signing secret, compared in constant time) and rejected when the timestamp is
more than five minutes off; Mattermost requests by their token. Anything unsigned,
forged or replayed gets 401 and is recorded; nothing else runs.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import aiohttp
from aiohttp import web

from engine.clock import Clock
from engine.commands import Caller, Commands
from engine.record.audit import Auditor
from engine.record.metrics import exposition
from engine.settings import ChatopsSettings

log = logging.getLogger(__name__)
Exposition = Callable[[], bytes]


def slack_signature(secret: str, timestamp: str, body: bytes) -> str:
    """The `X-Slack-Signature` Slack sends for this body."""
    base = f"v0:{timestamp}:".encode() + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


class ChatopsServer:
    """aiohttp application and its lifecycle."""

    def __init__(
        self,
        commands: Commands,
        settings: ChatopsSettings,
        auditor: Auditor,
        clock: Clock,
        metrics: Exposition | None = None,
        healthy: Callable[[], bool] | None = None,
    ) -> None:
        self.commands = commands
        self.settings = settings
        self.auditor = auditor
        self.clock = clock
        self.metrics = metrics
        self.healthy = healthy or (lambda: True)
        self.rejected = 0
        self.app = web.Application(client_max_size=64 * 1024)
        self.app.add_routes(
            [
                web.post("/chatops/slack", self.slack),
                web.post("/chatops/mattermost", self.mattermost),
                web.get("/metrics", self.get_metrics),
                web.get("/healthz", self.healthz),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, address: str) -> int:
        """Listen on `host:port` (port 0 picks one); returns the port."""
        host, _, port = address.rpartition(":")
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host or "127.0.0.1", int(port))
        await site.start()
        bound = int(self._runner.addresses[0][1])
        log.info("http on %s:%d (ChatOps, /metrics, /healthz)", host, bound)
        return bound

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _reject(self, request: web.Request, why: str) -> web.Response:
        self.rejected += 1
        peer = request.remote or "?"
        log.warning("rejected %s from %s: %s", request.path, peer, why)
        body = {"path": request.path, "peer": peer, "why": why}
        await self.auditor.note(self.clock.now(), "", f"chatops request rejected ({why})", body)
        return web.json_response({"error": why}, status=401)

    async def slack(self, request: web.Request) -> web.Response:
        secret = self.settings.slack_signing_secret
        body = await request.read()
        timestamp = request.headers.get("X-Slack-Request-Timestamp", "")
        signature = request.headers.get("X-Slack-Signature", "")
        if secret is None:
            return await self._reject(request, "slack is not configured")
        if not timestamp or not signature:
            return await self._reject(request, "unsigned")
        try:
            age = abs(self.clock.now() - float(timestamp))
        except ValueError:
            return await self._reject(request, "bad timestamp")
        if age > self.settings.max_skew_s:
            return await self._reject(request, "stale timestamp (replay?)")
        expected = slack_signature(secret.get_secret_value(), timestamp, body)
        if not hmac.compare_digest(expected, signature):
            return await self._reject(request, "bad signature")
        form = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
        caller = Caller(
            user=form.get("user_name") or form.get("user_id", ""),
            channel=form.get("channel_name") or form.get("channel_id", ""),
            platform="slack",
        )
        reply = await self.commands.run(form.get("text", ""), caller)
        if form.get("response_url"):
            await self._respond_later(form["response_url"], reply)
        return web.json_response({"response_type": "ephemeral", "text": reply})

    async def mattermost(self, request: web.Request) -> web.Response:
        if request.content_type == "application/json":
            form: dict[str, Any] = await request.json()
        else:
            form = {
                k: v[0]
                for k, v in parse_qs((await request.read()).decode(errors="replace")).items()
            }
        token = str(form.get("token", ""))
        if not token:
            return await self._reject(request, "missing token")
        if not any(
            hmac.compare_digest(token, t.get_secret_value())
            for t in self.settings.mattermost_tokens
        ):
            return await self._reject(request, "bad token")
        text = str(form.get("text", ""))
        trigger = str(form.get("trigger_word", ""))
        if trigger and text.startswith(trigger):  # outgoing webhooks repeat their trigger word
            text = text[len(trigger) :].strip()
        caller = Caller(
            user=str(form.get("user_name", "")),
            channel=str(form.get("channel_name", "")),
            platform="mattermost",
        )
        reply = await self.commands.run(text, caller)
        if form.get("response_url"):
            await self._respond_later(str(form["response_url"]), reply)
        return web.json_response({"text": reply, "response_type": "ephemeral"})

    async def _respond_later(self, url: str, reply: str) -> None:
        """Also post the answer to the response URL (slash commands may answer late)."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                await session.post(url, json={"text": reply})
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("response_url post failed: %s", type(exc).__name__)

    async def get_metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.Response(status=404)
        return web.Response(body=self.metrics(), content_type="text/plain", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.healthy()
        return web.json_response({"ok": ok}, status=200 if ok else 503)


def metrics_of(registry: Any) -> Exposition:
    """A callable for the server's /metrics from a prometheus registry."""
    return lambda: exposition(registry)
