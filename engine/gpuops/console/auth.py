"""Who is looking at the console, and whether a form they sent came from it.

Three ways in, in this order: a reverse proxy's user header (believed only from the
`trusted_proxies` addresses), `Authorization: Bearer TOKEN`, and the session cookie that
logging in with a token sets. The cookie is `user|expiry|HMAC` under a key made at
start: a restart logs everyone out, and no secret is written anywhere.

Actions are POSTs. A cookie or a proxy header rides along with any request the browser
makes, so such a POST must come from the console's own pages: its Origin (or Referer)
names this host, and it carries the per-user form token. A bearer token is sent only by
whoever holds it, so it needs neither.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from aiohttp import web

from gpuops.settings import ConsoleSettings

COOKIE = "gpuops_console"
MAX_TOKEN_CHARS = 512


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

    @property
    def known(self) -> bool:
        """Whether someone is logged in."""
        return bool(self.user)


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(errors="replace"), expected.encode(errors="replace"))


class Auth:
    """Identifies viewers and guards forms."""

    def __init__(self, settings: ConsoleSettings) -> None:
        self.settings = settings
        self._key = secrets.token_bytes(32)

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
        """Who sent the request."""
        s = self.settings
        if s.user_header and request.remote in s.trusted_proxies:
            named = request.headers.get(s.user_header, "").strip()
            if named and len(named) <= 64 and named.isprintable():
                return Viewer(named, Via.PROXY)
        bearer = request.headers.get("Authorization", "")
        if bearer.startswith("Bearer "):
            user = self.user_for_token(bearer[len("Bearer ") :].strip())
            return Viewer(user, Via.BEARER) if user else Viewer()
        user = self._cookie_user(request.cookies.get(COOKIE, ""))
        return Viewer(user, Via.SESSION) if user else Viewer()

    def session_cookie(self, user: str, now: float | None = None) -> str:
        """The cookie value that logs `user` in until the session ends."""
        expires = int((time.time() if now is None else now) + self.settings.session_s)
        body = f"{user}|{expires}"
        return f"{body}|{self._sign('session', body)}"

    def _cookie_user(self, value: str) -> str | None:
        user, _, rest = value.partition("|")
        expires, _, mac = rest.partition("|")
        if not (user and expires.isdigit() and mac):
            return None
        if not _same(mac, self._sign("session", f"{user}|{expires}")):
            return None
        return user if int(expires) > time.time() else None

    def form_token(self, viewer: Viewer) -> str:
        """The hidden field every form of this viewer carries."""
        return self._sign("form", viewer.user)[:32]

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
