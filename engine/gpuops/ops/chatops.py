"""ChatOps requests: verification, parsing and dispatch to the command table.

Slack requests are verified by their v0 signature (HMAC-SHA256 over `v0:timestamp:body`
with the signing secret, compared in constant time); the timestamp must be an integer
within `max_skew_s` of the clock, and a signature already seen within that window is a
replay. Mattermost requests are verified by their token. Anything unsigned, forged,
replayed or malformed is refused (401, or 400 for a body that cannot be read), counted
in /metrics by reason, and summarised in the audit at most once per interval, so a flood
of junk cannot flood the audit trail. A reply is posted to a request's `response_url`
only when its host is on the platform's allow-list.

The routes are mounted on the engine's HTTP server (`gpuops.http`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
from collections import Counter as Tally
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from enum import StrEnum
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp import web
from nats.errors import Error as NatsError
from prometheus_client import CollectorRegistry, Counter

from gpuops.clock import Clock
from gpuops.ops.commands import Caller, Commands
from gpuops.record.audit import Auditor
from gpuops.settings import ChatopsSettings
from gpuops.signing import same_secret

log = logging.getLogger(__name__)
TIMESTAMP = re.compile(r"[0-9]{1,12}")  # ASCII digits only: no sign, no "nan", no "1e9"


class Rejection(StrEnum):
    """Why a request was refused: the metric label and the audit summary's key."""

    NOT_CONFIGURED = "not_configured"
    UNSIGNED = "unsigned"
    BAD_TIMESTAMP = "bad_timestamp"
    STALE = "stale_timestamp"
    BAD_SIGNATURE = "bad_signature"
    REPLAYED = "replayed"
    REPLAY_CACHE_FULL = "replay_cache_full"
    MALFORMED = "malformed"
    MISSING_TOKEN = "missing_token"
    BAD_TOKEN = "bad_token"


STATUS = {Rejection.MALFORMED: 400, Rejection.REPLAY_CACHE_FULL: 503}  # the rest: 401


def slack_signature(secret: str, timestamp: str, body: bytes) -> str:
    """The `X-Slack-Signature` Slack sends for this body."""
    base = f"v0:{timestamp}:".encode() + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def parse_timestamp(value: str) -> int | None:
    """A request timestamp: whole seconds in ASCII digits, else None."""
    return int(value) if TIMESTAMP.fullmatch(value) else None


def response_url_allowed(url: str, hosts: Iterable[str]) -> bool:
    """Whether `url` is plain http(s) to one of `hosts` (no credentials in it)."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:
        return False
    return (
        parts.scheme in ("https", "http")
        and parts.username is None
        and host in {h.lower() for h in hosts}
    )


class SeenSignatures:
    """Signatures accepted within the skew window; a second use is a replay.

    A request whose timestamp is older than the window is refused as stale, so an entry
    can be forgotten once its timestamp leaves the window. When full, new requests are
    refused: forgetting a live entry would let it be replayed.
    """

    def __init__(self, window_s: float, cap: int) -> None:
        self.window_s, self.cap = window_s, cap
        self._seen: OrderedDict[str, int] = OrderedDict()

    def admit(self, signature: str, stamp: int, now: float) -> Rejection | None:
        """Remember the signature; a rejection if it was seen or there is no room."""
        self._expire(now)
        if signature in self._seen:
            return Rejection.REPLAYED
        if len(self._seen) >= self.cap:
            return Rejection.REPLAY_CACHE_FULL
        self._seen[signature] = stamp
        return None

    def _expire(self, now: float) -> None:
        # Insertion order is nearly timestamp order; an out-of-order entry only lingers.
        while self._seen:
            stamp = next(iter(self._seen.values()))
            if now - stamp <= self.window_s:
                return
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


class Rejections:
    """Refused requests: a counter by reason, and one audit summary per interval at most."""

    def __init__(
        self, auditor: Auditor, clock: Clock, registry: CollectorRegistry, interval_s: float
    ) -> None:
        self.auditor, self.clock, self.interval_s = auditor, clock, interval_s
        self.counter = Counter(
            "gpuops_chatops_rejections",
            "ChatOps requests refused, by reason",
            ["reason"],
            registry=registry,
        )
        self._pending: Tally[str] = Tally()
        self._totals: Tally[str] = Tally()
        self._last_note = float("-inf")
        self._last_from: dict[str, str] = {}

    @property
    def total(self) -> int:
        """Requests refused since start."""
        return sum(self._totals.values())

    async def add(self, reason: Rejection, request: web.Request) -> None:
        """Count one refusal; audit the pending ones if the interval has passed."""
        self.counter.labels(reason.value).inc()
        self._totals[reason.value] += 1
        self._pending[reason.value] += 1
        self._last_from = {"path": request.path, "peer": request.remote or "?"}
        log.debug("rejected %s from %s: %s", request.path, request.remote, reason.value)
        await self.flush()

    async def flush(self, force: bool = False) -> None:
        """Write the pending counts as one note, unless one was written within the interval."""
        now = self.clock.now()
        if not self._pending or (not force and now - self._last_note < self.interval_s):
            return
        # Taken before the await, so a concurrent request starts the next summary.
        counts, self._pending, self._last_note = dict(self._pending), Tally(), now
        listed = ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items()))
        summary = f"chatops requests rejected: {sum(counts.values())} ({listed})"
        log.warning("%s; last from %s", summary, self._last_from.get("peer"))
        # Totals since start ride along: a summary lost while NATS was away (or stored
        # although its ack never came) leaves the next one right, with nothing resent.
        body = {"rejected": counts, "total": dict(self._totals), "last": self._last_from}
        try:
            await self.auditor.note(now, "", summary, body)
        except (NatsError, TimeoutError) as exc:  # the refusal stands; the metric counted it
            log.warning("chatops rejection summary not written: %s", exc)

    async def flush_every(self) -> None:
        """Flush on a timer, so the last refusals of a burst reach the audit too."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()


class Chatops:
    """The `/chatops/slack` and `/chatops/mattermost` routes."""

    def __init__(
        self,
        commands: Commands,
        settings: ChatopsSettings,
        auditor: Auditor,
        clock: Clock,
        registry: CollectorRegistry,
    ) -> None:
        self.commands, self.settings, self.clock = commands, settings, clock
        self.seen = SeenSignatures(settings.max_skew_s, settings.replay_cache_size)
        self.rejections = Rejections(auditor, clock, registry, settings.rejection_note_interval_s)
        self.refused_urls = Counter(
            "gpuops_chatops_response_url_refused",
            "Replies not posted because the response_url host is not allowed",
            registry=registry,
        )

    def mount(self, app: web.Application) -> None:
        """Add the routes, and the timer that writes rejection summaries, to the app."""
        app.add_routes(
            [
                web.post("/chatops/slack", self.slack),
                web.post("/chatops/mattermost", self.mattermost),
            ]
        )
        app.cleanup_ctx.append(self._summaries)

    async def _summaries(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.rejections.flush_every())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.rejections.flush(force=True)

    async def _reject(self, request: web.Request, reason: Rejection) -> web.Response:
        await self.rejections.add(reason, request)
        return web.json_response({"error": reason.value}, status=STATUS.get(reason, 401))

    async def slack(self, request: web.Request) -> web.Response:
        """A Slack slash command."""
        body = await request.read()
        verified = self._verify_slack(request, body)
        if isinstance(verified, Rejection):
            return await self._reject(request, verified)
        form = _form(body)
        caller = Caller(
            user=form.get("user_name") or form.get("user_id", ""),
            channel=form.get("channel_name") or form.get("channel_id", ""),
            platform="slack",
        )
        reply = await self.commands.run(form.get("text", ""), caller, verified)
        await self._respond_later(form.get("response_url"), reply, "slack")
        return web.json_response({"response_type": "ephemeral", "text": reply})

    def _verify_slack(self, request: web.Request, body: bytes) -> str | Rejection:
        """The request's event id when it is signed, fresh and new; else why not."""
        secret = self.settings.slack_signing_secret
        timestamp = request.headers.get("X-Slack-Request-Timestamp", "")
        signature = request.headers.get("X-Slack-Signature", "")
        if secret is None:
            return Rejection.NOT_CONFIGURED
        if not timestamp or not signature:
            return Rejection.UNSIGNED
        stamp = parse_timestamp(timestamp)
        if stamp is None:
            return Rejection.BAD_TIMESTAMP
        now = self.clock.now()
        if abs(now - stamp) > self.settings.max_skew_s:
            return Rejection.STALE
        expected = slack_signature(secret.get_secret_value(), timestamp, body)
        if not same_secret(signature, expected):
            return Rejection.BAD_SIGNATURE
        replayed = self.seen.admit(signature, stamp, now)
        if replayed is not None:
            return replayed
        # A hash of the signature, not the signature: the id is readable on the bus.
        return "chatops-slack-" + hashlib.sha256(signature.encode()).hexdigest()[:40]

    async def mattermost(self, request: web.Request) -> web.Response:
        """A Mattermost slash command or outgoing webhook (form or JSON)."""
        body = await request.read()
        form = _mattermost_form(request.content_type, body)
        if form is None:
            return await self._reject(request, Rejection.MALFORMED)
        refused = self._verify_mattermost(form.get("token", ""))
        if refused is not None:
            return await self._reject(request, refused)
        text = form.get("text", "")
        trigger = form.get("trigger_word", "")
        if trigger and text.startswith(trigger):  # outgoing webhooks repeat their trigger word
            text = text[len(trigger) :].strip()
        caller = Caller(
            user=form.get("user_name", ""),
            channel=form.get("channel_name", ""),
            platform="mattermost",
        )
        # No signature here: the body and its timestamp (the receipt second when it has
        # none) name the request, so a resent one is stored once on the bus.
        stamp = form.get("timestamp") or str(int(self.clock.now()))
        digest = hashlib.sha256(body + b"\n" + stamp.encode()).hexdigest()[:40]
        reply = await self.commands.run(text, caller, "chatops-mattermost-" + digest)
        await self._respond_later(form.get("response_url"), reply, "mattermost")
        return web.json_response({"text": reply, "response_type": "ephemeral"})

    def _verify_mattermost(self, token: str) -> Rejection | None:
        tokens = self.settings.mattermost_tokens
        if not tokens:
            return Rejection.NOT_CONFIGURED
        if not token:
            return Rejection.MISSING_TOKEN
        if not any(same_secret(token, t.get_secret_value()) for t in tokens):
            return Rejection.BAD_TOKEN
        return None

    async def _respond_later(self, url: str | None, reply: str, platform: str) -> None:
        """Also post the answer to the response URL (slash commands may answer late)."""
        if not url:
            return
        s = self.settings
        hosts = s.slack_response_hosts if platform == "slack" else s.mattermost_response_hosts
        if not response_url_allowed(url, hosts):
            self.refused_urls.inc()
            log.warning("%s response_url to a host not allowed: not posted", platform)
            return
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                # No redirects: an allowed host must not hand the post on elsewhere.
                session.post(url, json={"text": reply}, allow_redirects=False),
            ):
                pass
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("response_url post failed: %s", type(exc).__name__)


def _form(body: bytes) -> dict[str, str]:
    """A urlencoded body's first value per field (lenient: bad bytes are replaced)."""
    return {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}


def _mattermost_form(content_type: str, body: bytes) -> dict[str, str] | None:
    """The request's fields as strings, or None when the body is not a readable object."""
    if content_type != "application/json":
        return _form(body)
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nesting too deep
        return None
    if not isinstance(raw, dict):
        return None
    return {
        k: str(v) for k, v in raw.items() if isinstance(v, str | int) and not isinstance(v, bool)
    }
