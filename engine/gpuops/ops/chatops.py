"""ChatOps requests: verification, identity, parsing and dispatch to the command table.

Slack requests are verified by their v0 signature (HMAC-SHA256 over `v0:timestamp:body`
with the signing secret, compared in constant time); the timestamp must be an integer
within `max_skew_s` of the clock, and the request must name the configured app when
one is set. Mattermost requests are verified by their token. Who asked is a principal
made of the platform, the team id and the user id (`slack:T0123/U0456`): a user name
can be changed or taken, so it is shown beside the principal and never authorises.

A request is served once across every engine sharing the bus: its id (Slack: from its
signature; Mattermost: its `trigger_id`, an outgoing webhook's `post_id`, else its
body) is created in the replay bucket, and whoever finds it there already refuses the
request as a replay. Anything unsigned, forged, replayed or malformed is refused (401,
or 400 for a body that cannot be read), counted in /metrics by reason, and summarised
in the audit at most once per interval, so a flood of junk cannot flood the audit
trail. A reply is posted to a request's `response_url` only when its host is on the
platform's allow-list.

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
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp import web
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError
from prometheus_client import CollectorRegistry, Counter

from gpuops.bus.store import KV, kv_key
from gpuops.clock import Clock
from gpuops.errors import BusError
from gpuops.ops.commands import Caller, Commands
from gpuops.record.audit import Auditor
from gpuops.settings import ChatopsSettings, principal
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
    REPLAY_UNCHECKED = "replay_unchecked"
    WRONG_APP = "wrong_app"
    NO_PRINCIPAL = "no_principal"
    MALFORMED = "malformed"
    MISSING_TOKEN = "missing_token"
    BAD_TOKEN = "bad_token"


STATUS = {
    Rejection.MALFORMED: 400,
    Rejection.NO_PRINCIPAL: 400,
    # The replay bucket did not answer: refused, since serving could serve a replay.
    Rejection.REPLAY_UNCHECKED: 503,
}  # the rest: 401


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


class SeenRequests:
    """Request ids served, in the replay bucket shared by every engine on the bus.

    The bucket's create is atomic on the server, so of two engines given the same
    request one creates its key and serves it, the other finds it and refuses it. Keys
    expire by the bucket's TTL, which outlasts any request's freshness window.
    """

    def __init__(self, kv: KV, clock: Clock) -> None:
        self.kv, self.clock = kv, clock

    async def admit(self, request_id: str) -> Rejection | None:
        """Remember the request; a rejection if it was served before or cannot be checked."""
        stamp = str(self.clock.now()).encode()  # for whoever reads the bucket: when first seen
        try:
            created = await self.kv.cas(kv_key(request_id), stamp, 0)
        except (BusError, JsError, NatsError, TimeoutError) as exc:
            log.warning("replay bucket unavailable, request refused: %s", exc)
            return Rejection.REPLAY_UNCHECKED
        return None if created is not None else Rejection.REPLAYED


@dataclass(frozen=True, slots=True)
class Verified:
    """A request that passed verification: who sent it, and its id on the bus."""

    caller: Caller
    request_id: str


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
        replay: KV,
    ) -> None:
        """`replay` is the bus's replay bucket, shared with every engine that serves chat."""
        self.commands, self.settings, self.clock = commands, settings, clock
        self.seen = SeenRequests(replay, clock)
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
        refused = self._verify_slack(request, body)
        if refused is not None:
            return await self._reject(request, refused)
        form = _form(body)
        verified = await self._admit(self._slack_request(request, form))
        if isinstance(verified, Rejection):
            return await self._reject(request, verified)
        reply = await self.commands.run(form.get("text", ""), verified.caller, verified.request_id)
        await self._respond_later(form.get("response_url"), reply, "slack")
        return web.json_response({"response_type": "ephemeral", "text": reply})

    def _verify_slack(self, request: web.Request, body: bytes) -> Rejection | None:
        """None when the request is signed and fresh; else why not."""
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
        if abs(self.clock.now() - stamp) > self.settings.max_skew_s:
            return Rejection.STALE
        expected = slack_signature(secret.get_secret_value(), timestamp, body)
        if not same_secret(signature, expected):
            return Rejection.BAD_SIGNATURE
        return None

    def _slack_request(self, request: web.Request, form: dict[str, str]) -> Verified | Rejection:
        """Who sent a signed Slack request, and its id; or why it is refused."""
        app = self.settings.slack_app_id
        if app is not None and form.get("api_app_id") != app:
            # The secret may sign for another app too (a copy, a test app): not ours to serve.
            return Rejection.WRONG_APP
        who = principal("slack", form.get("team_id", ""), form.get("user_id", ""))
        if who is None:
            return Rejection.NO_PRINCIPAL
        channel = form.get("channel_name") or form.get("channel_id", "")
        caller = Caller(who, channel, form.get("user_name", ""))
        # A hash of the signature, not the signature: the id is readable on the bus.
        signature = request.headers["X-Slack-Signature"]
        return Verified(caller, "chatops-slack-" + _digest(signature.encode()))

    async def _admit(self, verified: Verified | Rejection) -> Verified | Rejection:
        """The request if no engine has served it yet; else why it is refused.

        Checked last, once all else passed, so that a refused request takes no id.
        """
        if isinstance(verified, Rejection):
            return verified
        return await self.seen.admit(verified.request_id) or verified

    async def mattermost(self, request: web.Request) -> web.Response:
        """A Mattermost slash command or outgoing webhook (form or JSON)."""
        body = await request.read()
        form = _mattermost_form(request.content_type, body)
        if form is None:
            return await self._reject(request, Rejection.MALFORMED)
        refused = self._verify_mattermost(form.get("token", ""))
        verified = await self._admit(refused or _mattermost_request(form, body))
        if isinstance(verified, Rejection):
            return await self._reject(request, verified)
        text = form.get("text", "")
        trigger = form.get("trigger_word", "")
        if trigger and text.startswith(trigger):  # outgoing webhooks repeat their trigger word
            text = text[len(trigger) :].strip()
        reply = await self.commands.run(text, verified.caller, verified.request_id)
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


def _mattermost_request(form: dict[str, str], body: bytes) -> Verified | Rejection:
    """Who sent a Mattermost request with a good token, and its id; or why it is refused.

    Mattermost signs nothing: the id is what it gives each request, a slash command's
    `trigger_id` or an outgoing webhook's `post_id`; a sender with neither is known by
    its body, so the same body is served once within the replay bucket's TTL.
    """
    who = principal("mattermost", form.get("team_id", ""), form.get("user_id", ""))
    if who is None:
        return Rejection.NO_PRINCIPAL
    caller = Caller(who, form.get("channel_name", ""), form.get("user_name", ""))
    if form.get("trigger_id"):
        named = b"trigger_id\n" + form["trigger_id"].encode()
    elif form.get("post_id"):
        named = b"post_id\n" + form["post_id"].encode()
    else:
        named = b"body\n" + body
    return Verified(caller, "chatops-mattermost-" + _digest(named))


def _digest(data: bytes) -> str:
    """A request id's text: 40 hex digits of SHA-256 (fits a KV key and a Nats-Msg-Id)."""
    return hashlib.sha256(data).hexdigest()[:40]


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
