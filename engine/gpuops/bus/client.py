"""A NATS client's connection: options from settings, a bounded first connect, and
reconnecting forever once connected (or, for an agent, from the start)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.errors import AuthorizationError, NoServersError, OutboundBufferLimitError
from nats.errors import Error as NatsError

from gpuops import subjects
from gpuops.bus.auth import Credentials
from gpuops.errors import BusError, LeaseLost
from gpuops.settings import NatsSettings

log = logging.getLogger(__name__)


def _tls(cfg: NatsSettings) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=str(cfg.tls_ca) if cfg.tls_ca else None)
    if cfg.tls_cert:
        ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key) if cfg.tls_key else None)
    return ctx


def servers(url: str) -> list[str]:
    """The seed servers of a NATS URL: one, or several separated by commas (the members of
    a cluster; once connected, the client also learns the others from the cluster)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def connect_options(
    cfg: NatsSettings, credentials: Credentials | None = None, inbox: str = subjects.INBOX
) -> dict[str, Any]:
    """Keyword arguments for nats.connect (secrets unwrapped only here).

    `credentials` (the embedded server's generated user) replace the configured ones.
    `inbox` is the user's own inbox prefix: its replies and deliveries come there, and
    the server lets it subscribe there only (gpuops.subjects.inbox_of).
    """
    opts: dict[str, Any] = {
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1,
        "inbox_prefix": inbox,
    }
    if credentials is not None:
        return {**opts, "user": credentials.user, "password": credentials.password}
    if cfg.user:
        opts["user"] = cfg.user
        opts["password"] = cfg.password.get_secret_value() if cfg.password else None
    if cfg.token:
        opts["token"] = cfg.token.get_secret_value()
    if cfg.nkeys_seed:
        opts["nkeys_seed"] = str(cfg.nkeys_seed)
    if cfg.creds:
        opts["user_credentials"] = str(cfg.creds)
    tls = _tls(cfg)
    if tls is not None:
        opts["tls"] = tls
    return opts


# What a client that sends now or not at all (an engine) keeps in its outbound buffer
# while connected: past it, a publisher waits for the buffer to be written to the socket
# (back-pressure), so a bulk of publishes cannot grow it without bound, nor put a lease
# renewal behind megabytes of them (those have a connection of their own as well).
PENDING_BYTES = 4 << 20


class NowOrNever(Client):
    """A client that publishes now or not at all: while away from NATS a publish fails at
    once (nats-py would keep it in its buffer, to send after the reconnect); connected,
    its buffer is bounded (PENDING_BYTES) and a publisher past it waits for the flush."""

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        """nats-py's publish, refused at once while not connected."""
        if not self.is_connected:
            raise OutboundBufferLimitError
        await super().publish(subject, payload, reply, headers)


def away(exc: BaseException) -> bool:
    """A call that failed only because the client is away from NATS (reconnecting, or
    its buffer full): worth trying again in a moment, not a fault of the caller's."""
    return isinstance(exc, OutboundBufferLimitError)


def transient(exc: BaseException) -> bool:
    """A failure of the bus rather than of the work: NATS slow, away, or a record too
    contended (compare-and-set lost every try); the same work may succeed a moment later.
    A lost lease is not one: the partition is another replica's now."""
    return isinstance(exc, BusError | NatsError | TimeoutError) and not isinstance(exc, LeaseLost)


class _ConnectErrors:
    """nats-py's error callback: kept quiet (the last one remembered) until the first
    connect succeeds, then logged as they change or once a minute."""

    def __init__(self, url: str) -> None:
        self.connected = False
        self.last: Exception | None = None
        self._report = _first_errors(url)

    async def record(self, exc: Exception) -> None:
        """The callback (nats-py takes only coroutine functions, not callable objects)."""
        if self.connected:
            await self._report(exc)
        else:
            self.last = exc


async def first_connect(
    url: str,
    cfg: NatsSettings,
    name: str,
    credentials: Credentials | None = None,
    *,
    buffer: bool = True,
    inbox: str = subjects.INBOX,
) -> Client:
    """A connected client, or a BusError saying why not, within `cfg.connect_timeout_s`.

    nats-py would retry a failing first connect forever (max_reconnect_attempts=-1),
    hiding a wrong URL; here each try is short and the tries stop at the deadline. A
    refused password is final at once, a refused connection after REFUSED_FOR_S (long
    enough for a supervised server's restart). Reconnecting forever is switched on
    once connected.
    """
    errors = _ConnectErrors(url)
    began = time.monotonic()
    opts = connect_options(cfg, credentials, inbox)
    opts.update(allow_reconnect=False, max_reconnect_attempts=1, reconnect_time_wait=0.2)
    if not buffer:
        # A deciding engine publishes now or not at all: a publish kept while NATS is away
        # and sent after it came back could land after its partition went to another
        # replica (docs/operations.md, "Engine replicas"). Connected, its buffer is bounded.
        opts["pending_size"] = PENDING_BYTES
    while True:
        left = began + cfg.connect_timeout_s - time.monotonic()
        nc = Client() if buffer else NowOrNever()
        try:
            # Each try (two connects, 0.2 s apart) ends within what is left. nats-py annotates the
            # timeout as int but hands it to asyncio.wait_for, which takes any seconds.
            wait: Any = min(2.0, max(left / 4, 0.2))
            await nc.connect(
                servers(url), name=name, error_cb=errors.record, connect_timeout=wait, **opts
            )
        except (OSError, ValueError, NatsError, TimeoutError) as exc:
            await _drop(nc)
            cause = errors.last if isinstance(exc, NoServersError) and errors.last else exc
            if _give_up(cause, time.monotonic() - began, cfg.connect_timeout_s):
                raise BusError(
                    f"cannot reach NATS at {url}: {_why(cause)} "
                    f"(after {time.monotonic() - began:.0f} s)"
                ) from exc
            await asyncio.sleep(0.5)
            continue
        errors.connected = True
        nc.options.update(allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=1)
        return nc


REFUSED_FOR_S = 2.0


def _give_up(cause: BaseException, spent: float, limit: float) -> bool:
    if isinstance(cause, AuthorizationError) or "authorization" in str(cause).lower():
        return True
    if isinstance(cause, ConnectionRefusedError):
        limit = min(limit, REFUSED_FOR_S)
    return spent + 0.5 >= limit


async def _drop(nc: Client) -> None:
    """Close a client whose first connect failed (it may hold a half-open socket)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 2)


def _why(exc: BaseException) -> str:
    """A failed connect in a few words."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "no answer (timed out)"
    if isinstance(exc, AuthorizationError):
        return "authorization violation (wrong user or password)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).strip() or type(exc).__name__


def _first_errors(url: str, every_s: float = 60.0) -> Callable[[Exception], Awaitable[None]]:
    """An error callback that logs a failure when it changes or once a minute, not on every
    retry of a long outage."""
    last_text, last_at = [""], [0.0]

    async def report(exc: Exception) -> None:
        text, now = f"{type(exc).__name__}: {exc}", time.monotonic()
        if text != last_text[0] or now - last_at[0] >= every_s:
            log.warning("nats at %s: %s (retrying)", url, text)
            last_text[0], last_at[0] = text, now

    return report


async def connect_forever(
    nc: Client, url: str, cfg: NatsSettings, credentials: Credentials | None, name: str, inbox: str
) -> None:
    """Connect `nc`, retrying until it works or the task is cancelled; reconnects after.
    `inbox`: the user's own inbox prefix (a node's agent's, or the source's)."""
    opts = connect_options(cfg, credentials, inbox)
    await nc.connect(
        servers(url),
        name=name,
        error_cb=_first_errors(url),
        connect_timeout=2,
        allow_reconnect=True,
        **opts,
    )
    log.info("connected to nats at %s", url)
