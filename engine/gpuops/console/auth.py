"""Who is looking at the console, and whether a form they sent came from it.

Three ways in, in this order: a reverse proxy's user header (believed only when the
request also carries the proxy's shared secret: an address proves nothing, any local
process has 127.0.0.1), `Authorization: Bearer TOKEN`, and the session cookie that
logging in with a token sets. The cookie is `user|expiry|session|HMAC` under a key made
at start: a restart logs everyone out, and no secret is written anywhere. Logging out
ends the session here, not only in the browser: a copy of the cookie acts no more. A wrong token or
proxy secret is a failed login: counted per client, and past the limit refused (429).

Actions are POSTs. A cookie or a proxy header rides along with any request the browser
makes, so such a POST must come from the console's own pages: its Origin (or Referer)
names this host, and it carries the per-user form token. A bearer token is sent only by
whoever holds it, so it needs neither.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CollectorRegistry

from gpuops.clock import Clock
from gpuops.console.throttle import Failure, LoginThrottle
from gpuops.settings import ConsoleSettings

log = logging.getLogger(__name__)

COOKIE = "gpuops_console"
MAX_TOKEN_CHARS = 512
MAX_USER_CHARS = 64


class Via(StrEnum):
    """How a viewer was identified."""

    NONE = "none"
    PROXY = "proxy"
    BEARER = "bearer"
    SESSION = "session"


@dataclass(frozen=True, slots=True)
class Viewer:
    """The person behind a request (`user` empty: nobody logged in)."""

    user: str = ""
    via: Via = Via.NONE
    session: str = ""  # the session cookie's id (Via.SESSION): its forms' token is its own

    @property
    def known(self) -> bool:
        """Whether someone is logged in."""
        return bool(self.user)


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(errors="replace"), expected.encode(errors="replace"))


def is_loopback(bind: str) -> bool:
    """Whether `host:port` listens on loopback only (no host: the server's 127.0.0.1)."""
    host = bind.rpartition(":")[0].strip("[]") or "127.0.0.1"
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name may resolve to any address: not loopback


def is_loopback_host(host: str) -> bool:
    """Whether a request's Host (`name[:port]`) names this machine's loopback."""
    try:
        name = urlsplit(f"//{host}").hostname or ""
    except ValueError:
        return False
    return name == "localhost" or is_loopback(f"[{name}]:0")


def anonymous_read(settings: ConsoleSettings, bind: str) -> bool:
    """Whether pages may be read without a login, on a server bound to `bind`."""
    if settings.login_required or settings.anonymous_read == "never":
        return False
    return settings.anonymous_read == "always" or is_loopback(bind)


class Auth:
    """Identifies viewers, guards forms, and throttles failed logins."""

    def __init__(
        self, settings: ConsoleSettings, clock: Clock, registry: CollectorRegistry
    ) -> None:
        self.settings, self.clock = settings, clock
        self._key = secrets.token_bytes(32)
        self._ended: dict[str, float] = {}  # sessions logged out, until their cookie expires
        self.throttle = LoginThrottle(
            clock, registry, settings.login_failures, settings.login_window_s
        )

    def user_for_token(self, token: str) -> str | None:
        """The user a login token belongs to, if any (constant-time per token)."""
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        found = None
        for entry in self.settings.tokens:
            if _same(token, entry.token.get_secret_value()):
                found = entry.user
        return found

    def viewer(self, request: web.Request) -> Viewer:
        """Who sent the request; HTTPTooManyRequests for a client past its failed logins."""
        header = self.settings.user_header
        if header and header in request.headers:
            return self._proxied(request, request.headers[header].strip())
        bearer = request.headers.get("Authorization", "")
        if bearer.startswith("Bearer "):
            return self._bearer(request, bearer[len("Bearer ") :].strip())
        found = self._session(request.cookies.get(COOKIE, ""))
        return Viewer(found[0], Via.SESSION, found[1]) if found else Viewer()

    def _proxied(self, request: web.Request, named: str) -> Viewer:
        # A user header without the secret is someone claiming to be the proxy: nobody,
        # and a failure, so the secret cannot be guessed at leisure either.
        if not self.from_proxy(request):
            self.refuse_if_throttled(request)
            self.failed(request, Failure.PROXY)
            return Viewer()
        if named and len(named) <= MAX_USER_CHARS and named.isprintable():
            return Viewer(named, Via.PROXY)
        return Viewer()

    def _bearer(self, request: web.Request, token: str) -> Viewer:
        self.refuse_if_throttled(request)
        user = self.user_for_token(token)
        if user is None:
            self.failed(request, Failure.BEARER)
            return Viewer()
        return Viewer(user, Via.BEARER)

    def from_proxy(self, request: web.Request) -> bool:
        """Whether the request carries the proxy's secret (and comes from a listed
        proxy address, where any are listed)."""
        s = self.settings
        if s.proxy_secret is None:
            return False
        if s.trusted_proxies and request.remote not in s.trusted_proxies:
            return False
        given = request.headers.get(s.proxy_secret_header, "")
        return bool(given) and _same(given, s.proxy_secret.get_secret_value())

    def client(self, request: web.Request) -> str:
        """Who to count failed logins against: the address the proxy saw, when the
        proxy's secret vouches for its X-Forwarded-For, else the peer's address."""
        if self.from_proxy(request):
            hops = request.headers.get("X-Forwarded-For", "").split(",")
            seen = hops[-1].strip()[:64]  # the proxy appends the address it saw
            if seen:
                return seen
        return request.remote or "unknown"

    def refuse_if_throttled(self, request: web.Request) -> None:
        """HTTPTooManyRequests, with Retry-After, for a client past its failed logins."""
        client = self.client(request)
        wait = self.throttle.wait_s(client)
        if wait:
            raise web.HTTPTooManyRequests(
                text=f"too many failed logins from {client}: try again in {wait}s",
                headers={"Retry-After": str(wait)},
            )

    def failed(self, request: web.Request, via: Failure) -> None:
        """Count (and log) one failed login of the request's client."""
        self.throttle.failed(self.client(request), via)

    def secure(self, request: web.Request) -> bool:
        """Whether the session cookie must be Secure: the browser reached us over TLS."""
        if self.settings.cookie_secure == "always" or request.secure:
            return True
        forwarded = request.headers.get("X-Forwarded-Proto", "").strip().lower()
        return forwarded == "https" and self.from_proxy(request)

    def session_cookie(self, user: str, now: float | None = None) -> str:
        """The cookie value that logs `user` in until the session ends."""
        expires = int((self.clock.now() if now is None else now) + self.settings.session_s)
        body = f"{user}|{expires}|{secrets.token_hex(16)}"
        return f"{body}|{self._sign('session', body)}"

    def _session(self, value: str) -> tuple[str, str] | None:
        """(user, session id) of a cookie this process signed, unexpired and not ended."""
        parts = value.rsplit("|", 3)
        if len(parts) != 4:
            return None
        user, expires, session, mac = parts
        if not (user and expires.isdigit() and session and mac):
            return None
        if not _same(mac, self._sign("session", f"{user}|{expires}|{session}")):
            return None
        if int(expires) <= self.clock.now() or session in self._ended:
            return None
        return user, session

    def end_session(self, request: web.Request) -> None:
        """Log the request's session out: its cookie, or any copy of it, names nobody."""
        found = self._session(request.cookies.get(COOKIE, ""))
        now = self.clock.now()
        # Only a live session is remembered, until its cookie would have expired anyway.
        self._ended = {s: until for s, until in self._ended.items() if until > now}
        if found is not None:
            self._ended[found[1]] = now + self.settings.session_s

    def form_token(self, viewer: Viewer) -> str:
        """The hidden field every form of this viewer carries (one session's own, for a
        session: a token seen in one session is no good in the next)."""
        return self._sign("form", f"{viewer.user}|{viewer.session}")[:32]

    def form_refused(self, request: web.Request, viewer: Viewer, token: str) -> str | None:
        """Why a POST is not the console's own form (None: it is)."""
        if viewer.via is Via.BEARER:
            return None
        if not self.same_origin(request):
            return "the form did not come from this console (Origin/Referer)"
        if not _same(token, self.form_token(viewer)):
            return "stale or missing form token: reload the page"
        return None

    def same_origin(self, request: web.Request) -> bool:
        """Whether the request's Origin (or Referer) is this host."""
        source = request.headers.get("Origin") or request.headers.get("Referer") or ""
        try:
            return urlsplit(source).netloc == request.host
        except ValueError:
            return False

    def _sign(self, purpose: str, text: str) -> str:
        return hmac.new(self._key, f"{purpose}|{text}".encode(), hashlib.sha256).hexdigest()
