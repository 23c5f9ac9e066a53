"""Failed logins, per client, in a sliding window: past the limit the client waits.

A console token is guessed one request at a time, so the guesses a client may make are
what bounds the attack: `limit` failures in `window_s`, then 429 with Retry-After until
the oldest leaves the window. Every failure is logged with its source and counted in
`gpuops_console_login_failures_total{via}`; refusals in
`gpuops_console_logins_throttled_total`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter

from gpuops.clock import Clock

log = logging.getLogger(__name__)

# Clients remembered at once. Past it, those whose failures all left the window go, then
# the longest-remembered: a flood from many addresses costs bounded memory, at worst a
# forgotten client gets a fresh window.
MAX_CLIENTS = 10_000


class Failure(StrEnum):
    """What failed: the metric label."""

    FORM = "form"  # the login form's token
    BEARER = "bearer"  # an Authorization: Bearer token
    PROXY = "proxy"  # the user header without the proxy's secret


class LoginThrottle:
    """Failures per client; `wait_s` says how long a client must wait (0: it may try)."""

    def __init__(
        self, clock: Clock, registry: CollectorRegistry, limit: int, window_s: float
    ) -> None:
        self.clock, self.limit, self.window_s = clock, limit, window_s
        self._failed: dict[str, deque[float]] = {}
        self.failures = Counter(
            "gpuops_console_login_failures",
            "Console logins refused (wrong token, bearer or proxy secret), by what was tried",
            ["via"],
            registry=registry,
        )
        self.throttled = Counter(
            "gpuops_console_logins_throttled",
            "Console login attempts refused unread: too many failures from the client",
            registry=registry,
        )

    def wait_s(self, client: str) -> int:
        """Whole seconds until `client` may try again (0: now); counts a refusal."""
        times = self._recent(client)
        if len(times) < self.limit:
            return 0
        self.throttled.inc()
        return max(1, math.ceil(times[0] + self.window_s - self.clock.now()))

    def failed(self, client: str, via: Failure) -> None:
        """Remember, log and count one failure of `client`."""
        times = self._recent(client)
        if not times:
            self._make_room()
        times.append(self.clock.now())
        self._failed[client] = times
        self.failures.labels(via.value).inc()
        log.warning(
            "console login failed from %s (%s), %d in %.0fs",
            client,
            via.value,
            len(times),
            self.window_s,
        )

    def _recent(self, client: str) -> deque[float]:
        times = self._failed.get(client, deque())
        horizon = self.clock.now() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            self._failed.pop(client, None)
        return times

    def _make_room(self) -> None:
        if len(self._failed) < MAX_CLIENTS:
            return
        for client in list(self._failed):
            self._recent(client)
        while len(self._failed) >= MAX_CLIENTS:  # all recent: the longest-known goes
            del self._failed[next(iter(self._failed))]
