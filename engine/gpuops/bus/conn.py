"""The NATS connection, the streams and the KV buckets gpuops uses."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.errors import Error as JsError
from nats.js.kv import KeyValue

from gpuops import subjects
from gpuops.bus.auth import (
    Credentials,
    Role,
    ensure_credentials,
    known_nodes,
    node_credentials,
    operators,
    read_credentials,
    server_config,
)
from gpuops.bus.buckets import BUCKETS, LEASES_KEY, Buckets
from gpuops.bus.client import connect_forever as connect_forever
from gpuops.bus.client import first_connect
from gpuops.bus.embedded import announce, new_server, remembered_url, store_dir, url_file
from gpuops.bus.natsjwt import creds_name
from gpuops.bus.partitions import events_transform, telemetry_transform
from gpuops.bus.server import EmbeddedNats
from gpuops.errors import BusError
from gpuops.settings import NatsSettings

log = logging.getLogger(__name__)

TELEMETRY = "GPUOPS_TELEMETRY"
EVENTS = "GPUOPS_EVENTS"
ACTIONS = "GPUOPS_ACTIONS"
AUDIT = "GPUOPS_AUDIT"
DLQ = "GPUOPS_DLQ"

_DAY = 86400.0
STREAMS: tuple[StreamConfig, ...] = (
    # Samples are replaced seconds later; keep little and drop the oldest.
    StreamConfig(
        name=TELEMETRY,
        # Exactly one node token: the stream stores it under its partition (below).
        subjects=[subjects.TELEMETRY],
        retention=RetentionPolicy.LIMITS,
        max_age=600.0,
        max_bytes=1 << 30,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
    ),
    StreamConfig(
        name=EVENTS,
        subjects=[subjects.EVENTS],
        retention=RetentionPolicy.LIMITS,
        max_age=7 * _DAY,
        # Covers ChatOps's 5-minute signature window: a replayed command is stored once.
        duplicate_window=600.0,
        storage=StorageType.FILE,
    ),
    # A work queue: each intent is removed once an executor acks it.
    StreamConfig(
        name=ACTIONS,
        subjects=[subjects.ACTIONS],
        retention=RetentionPolicy.WORK_QUEUE,
        duplicate_window=600.0,
        storage=StorageType.FILE,
    ),
    StreamConfig(
        name=AUDIT,
        subjects=[subjects.AUDIT],
        retention=RetentionPolicy.LIMITS,
        max_age=90 * _DAY,
        # A decision's record is written by the engine and again, from its intent, by the
        # executor (in case the engine died first): one copy is stored. The window is the
        # settings' (nats.audit_dedupe_s, at least the oldest intent an executor runs).
        storage=StorageType.FILE,
    ),
    # Anyone who can publish can fill it: capped (nats.dlq_*), the oldest dropped first.
    StreamConfig(
        name=DLQ,
        subjects=[subjects.DLQ],
        retention=RetentionPolicy.LIMITS,
        max_age=14 * _DAY,
        max_bytes=1 << 30,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
    ),
)


# What a connection sets up: the engine creates streams and buckets (and brings them to
# this configuration); the executor and the CLI open the buckets the engine made; an
# agent only publishes, so it touches no JetStream API at all.
# "join" opens what is there and creates it only when missing (a CLI on a new NATS), so
# a user without the right to change streams can join one an engine set up.
Setup = Literal["create", "open", "join", "none"]
_EMBEDDED_SETUP: dict[Role, Setup] = {
    "engine": "create",
    "executor": "open",
    "cli": "open",
    "source": "none",
}


@dataclass(slots=True)
class Bus:
    """A connected client, its JetStream context and the KV buckets."""

    nc: Client
    js: JetStreamContext
    kv: dict[str, KeyValue]
    url: str
    # The NATS user this connection authenticated as ("" when the server asked for none).
    user: str = ""
    # The supervised embedded server when this process started it (for health reports).
    server: EmbeddedNats | None = None
    # An engine's second, small connection for its leases and heartbeat: a renewal must
    # not wait behind the bulk of publishes and deliveries on this one (`_laned`).
    lane: Bus | None = None

    @property
    def connected(self) -> bool:
        """Whether this connection (and its lane, if any) is connected now."""
        return self.nc.is_connected and (self.lane is None or self.lane.nc.is_connected)

    @property
    def buckets(self) -> Buckets:
        """The KV buckets by purpose."""
        return Buckets.of(self.kv)

    async def close(self) -> None:
        """Flush what is pending and disconnect (the lane is closed by who made it)."""
        if self.nc.is_closed:
            return
        with contextlib.suppress(NatsError, TimeoutError):
            await self.nc.flush(timeout=5)
        await self.nc.close()


def user_of(cfg: NatsSettings, credentials: Credentials | None) -> str:
    """The NATS user a connection is: the embedded server's generated one, the configured
    `nats.user`, or the name in the `nats.creds` file's JWT (a site's operator mode); ""
    when there is none (a server without users)."""
    if credentials is not None:
        return credentials.user
    if cfg.user:
        return cfg.user
    if cfg.creds is not None:
        try:
            return creds_name(cfg.creds.read_text())
        except OSError as exc:
            raise BusError(f"cannot read nats.creds {cfg.creds}: {exc}") from exc
    return ""


async def connect(
    url: str,
    cfg: NatsSettings | None = None,
    name: str = "gpuops",
    *,
    setup: Setup = "create",
    credentials: Credentials | None = None,
    buffer: bool = True,
    patience_s: float | None = None,
    waiting: Waiting | None = None,
    role: Role = "engine",
) -> Bus:
    """Connect, then set up JetStream as `setup` says (create streams and buckets by default).

    The first connect is bounded by `cfg.connect_timeout_s` (a BusError after it); once
    connected, the client reconnects forever on its own. The set-up is tried again while
    JetStream does not answer, for `patience_s` (default: `cfg.connect_timeout_s`);
    `waiting` is told each time why it waits (a starting `run`'s /healthz says it).
    `role` names the inbox prefix, the only one its user may subscribe.
    """
    cfg = cfg or NatsSettings()
    user = user_of(cfg, credentials)
    # An operator's replies come to their own inbox (with no user, the server checks none).
    inbox = subjects.operator_inbox(user) if role == "cli" and user else subjects.inbox_of(role)
    nc = await first_connect(url, cfg, name, credentials, buffer=buffer, inbox=inbox)
    js = nc.jetstream(timeout=10)
    try:
        patience = patience_s or cfg.connect_timeout_s
        kv = await _set_up_patiently(js, cfg, setup, patience, waiting or _quiet)
    except BusError:
        await nc.close()
        raise
    except (JsError, NatsError, TimeoutError) as exc:
        await nc.close()
        raise BusError(f"cannot set up JetStream at {url} ({setup}): {exc}") from exc
    return Bus(nc=nc, js=js, kv=kv, url=url, user=user)


# Told why a set-up waits: the text a starting `run` shows in /healthz.
Waiting = Callable[[str], None]


def _quiet(why: str) -> None:
    """A set-up nobody asked to hear about."""


async def _set_up_patiently(
    js: JetStreamContext, cfg: NatsSettings, setup: Setup, patience_s: float, waiting: Waiting
) -> dict[str, KeyValue]:
    """`_set_up`, tried again while JetStream does not answer in time (a cluster whose
    members are electing a leader, or catching up after one came back, or too busy) for
    `patience_s`; a refusal (an error answer) is not tried again."""
    deadline = asyncio.get_running_loop().time() + patience_s
    told = False
    while True:
        try:
            return await _set_up(js, cfg, setup)
        except _NotMadeYet as missing:
            # Another role makes them (the engine): started together, this one waits.
            if asyncio.get_running_loop().time() >= deadline:
                raise BusError(
                    f"a KV bucket is still missing after {patience_s:g} s ({missing}): "
                    "is an engine (`gpuops run`, role all or engine) running on this NATS?"
                ) from None
            waiting(f"waiting for the engine to make the streams and KV buckets ({missing})")
            if not told:
                log.info("waiting for the engine to make the KV buckets (%s)", missing)
                told = True
            await asyncio.sleep(1.0)
        except (TimeoutError, NoRespondersError, ServiceUnavailableError) as exc:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            waiting(f"waiting for JetStream to answer its set-up ({type(exc).__name__})")
            log.warning("JetStream did not answer (%s); setting up again", type(exc).__name__)
            await asyncio.sleep(1.0)


async def _set_up(js: JetStreamContext, cfg: NatsSettings, setup: Setup) -> dict[str, KeyValue]:
    if setup == "none":
        return {}
    if setup == "create":
        await ensure_streams(js, cfg)
        return {name: await ensure_bucket(js, c, cfg) for name, c in BUCKETS.items()}
    try:
        return {name: await js.key_value(c.bucket) for name, c in BUCKETS.items()}
    except BucketNotFoundError as exc:
        if setup == "join":
            return await _set_up(js, cfg, "create")
        raise _NotMadeYet(str(exc)) from exc


class _NotMadeYet(Exception):
    """A bucket the engine makes is not there yet (`open` waits for it)."""


def stream_configs(cfg: NatsSettings | None = None) -> list[StreamConfig]:
    """The streams with the replicas and size limits of the settings."""
    cfg = cfg or NatsSettings()
    limits: dict[str, dict[str, Any]] = {
        EVENTS: {
            "max_bytes": cfg.events_max_bytes,
            "subject_transform": events_transform(cfg.partitions).as_dict(),
        },
        TELEMETRY: {
            "subject_transform": telemetry_transform(cfg.partitions).as_dict(),
            "storage": cfg.telemetry_storage,
            "num_replicas": cfg.telemetry_replicas or cfg.replicas,
            "max_bytes": cfg.telemetry_max_bytes,
        },
        AUDIT: {
            "max_bytes": cfg.audit_max_bytes,
            "max_age": cfg.audit_max_age_s,
            # JetStream refuses a window longer than the stream keeps its records.
            "duplicate_window": min(cfg.audit_dedupe_s, cfg.audit_max_age_s),
        },
        DLQ: {"max_bytes": cfg.dlq_max_bytes, "max_age": cfg.dlq_max_age_s},
    }
    return [
        StreamConfig.from_response(
            {
                **base.as_dict(),
                "num_replicas": cfg.replicas,
                **_limits(limits.get(base.name or "", {})),
            }
        )
        for base in STREAMS
    ]


def _limits(values: dict[str, Any]) -> dict[str, Any]:
    # as_dict() speaks the server's units: max_age and duplicate_window in nanoseconds.
    out = dict(values)
    for span in ("max_age", "duplicate_window"):
        if span in out:
            out[span] = int(out[span] * 1_000_000_000)
    return out


# A cluster that has just formed may refuse a replicated stream for a moment (its peers
# not all known yet: "insufficient resources", "no suitable peers"); creating one is
# tried again for this long before the refusal is reported.
PLACEMENT_WAIT_S = 30.0


async def ensure_streams(js: JetStreamContext, cfg: NatsSettings | None = None) -> None:
    """Create each stream, or bring an existing one to this configuration."""
    for config in stream_configs(cfg):
        await _ensure_stream(js, config)


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    deadline = asyncio.get_running_loop().time() + PLACEMENT_WAIT_S
    while True:
        try:
            await js.add_stream(config)
            return
        except BadRequestError as refused:
            try:
                await js.update_stream(config)  # it exists with another configuration
                return
            except NotFoundError:
                # It does not exist: the add was refused for another reason.
                if asyncio.get_running_loop().time() >= deadline:
                    raise BusError(
                        f"cannot create stream {config.name}: {refused.description}"
                    ) from refused
                log.info("stream %s refused (%s); trying again", config.name, refused.description)
                await asyncio.sleep(0.5)
            except APIError as kept:  # it exists, and cannot become this configuration
                raise BusError(_not_updated(config, kept.description)) from kept


def _not_updated(config: StreamConfig, why: str | None) -> str:
    """Why a stream that exists could not take the settings' configuration."""
    text = f"stream {config.name} exists and cannot take the configured settings: {why}"
    if config.name == TELEMETRY:
        # Telemetry is replaced within seconds: dropping the stream loses nothing a
        # rule needs for longer than a window; the engines make it again at start.
        text += (
            " (JetStream cannot change a stream's storage in place: stop the engines, "
            f"`nats stream rm {TELEMETRY}`, and start them with the new nats.telemetry_* "
            "settings)"
        )
    return text


async def ensure_bucket(
    js: JetStreamContext, config: KeyValueConfig, cfg: NatsSettings | None = None
) -> KeyValue:
    """Open a KV bucket, creating it the first time.

    The leases bucket's entries expire `cfg.lease_s` after their last write, by the
    server's clock: a replica that stops renewing loses its partitions without anyone
    comparing clocks. A changed lease time is applied to the bucket that exists.
    """
    cfg = cfg or NatsSettings()
    leases = config.bucket == BUCKETS[LEASES_KEY].bucket
    try:
        bucket = await js.key_value(config.bucket)
    except BucketNotFoundError:
        config = KeyValueConfig(**{**config.__dict__, "replicas": cfg.replicas})
        if leases:
            config.ttl = cfg.lease_s
        return await js.create_key_value(config)
    if leases:
        await _keep_ttl(js, f"KV_{config.bucket}", cfg.lease_s)
    return bucket


async def _keep_ttl(js: JetStreamContext, stream: str, ttl: float) -> None:
    info = await js.stream_info(stream)
    if abs((info.config.max_age or 0) - ttl) > 1e-3:
        info.config.max_age = ttl
        await js.update_stream(info.config)


@asynccontextmanager
async def open_bus(
    cfg: NatsSettings,
    state_dir: Path,
    name: str = "gpuops",
    role: Role = "engine",
    *,
    stopped_store: bool = False,
    waiting: Waiting | None = None,
) -> AsyncIterator[Bus]:
    """The configured NATS, or a running engine's embedded one, or a new embedded one.

    On the embedded server the role's generated credentials are used (and its
    permissions apply); a configured URL uses the configured credentials. The CLI never
    starts a server others could use (`join_bus`): one with no engine behind it would
    answer questions about a fleet that nobody watches. `stopped_store` lets a reader of
    the record (history) open a stopped engine's store instead, privately. An engine's
    bus has its lane (`Bus.lane`); `waiting` hears why the set-up waits, if it does.
    """
    bus: Bus | None
    if role == "cli" and stopped_store and _stopped(cfg, state_dir):
        async with _read_store(cfg, state_dir, name) as reader:
            yield reader
        return
    if role == "cli":
        bus = await join_bus(cfg, state_dir, name)
    elif cfg.url:
        # Only the engine creates streams and buckets; an executor's user may not. `run`
        # waits for a cluster that is up but not answering yet (a service starting with
        # its cluster, replicas all setting up at once).
        bus = await connect(
            cfg.url,
            cfg,
            name,
            setup=_EMBEDDED_SETUP[role],
            buffer=role != "engine",
            patience_s=cfg.setup_timeout_s,
            waiting=waiting,
            role=role,
        )
    else:
        bus = await _join_embedded(cfg, state_dir, name, role, waiting)
    if bus is None:
        async with (
            _own_embedded(cfg, state_dir, name, role) as own,
            _laned(own, cfg, state_dir, name, role) as laned,
        ):
            yield laned
        return
    try:
        async with _laned(bus, cfg, state_dir, name, role) as laned:
            yield laned
    finally:
        await bus.close()


@asynccontextmanager
async def _laned(
    bus: Bus, cfg: NatsSettings, state_dir: Path, name: str, role: Role
) -> AsyncIterator[Bus]:
    """An engine's bus with its lane: a second connection, as the same user, that carries
    only the leases and the heartbeat. On the bus's own connection a renewal would queue
    behind the bulk of what a loaded engine publishes and fetches after a restart, and a
    lease could run out while NATS is up. It sends now or not at all, as the bus does."""
    if role != "engine":
        yield bus
        return
    credentials = None if cfg.url else read_credentials(state_dir, "engine")
    lane = await connect(
        bus.url,
        cfg,
        f"{name}-leases",
        setup="open",  # the bus made them a moment ago
        credentials=credentials,
        buffer=False,
        patience_s=cfg.setup_timeout_s,
    )
    try:
        yield dataclasses.replace(bus, lane=lane)
    finally:
        await lane.close()


async def join_bus(cfg: NatsSettings, state_dir: Path, name: str = "gpuops-cli") -> Bus:
    """A command's connection: the configured URL, else the one the running engine wrote.

    A BusError says which URL, why it did not answer, and what to do.
    """
    url, credentials, origin = cli_endpoint(cfg, state_dir)
    # A configured NATS may be new: its streams and buckets are made as the engine would.
    setup: Setup = "open" if origin is not None else "join"
    try:
        return await connect(url, cfg, name, setup=setup, credentials=credentials, role="cli")
    except BusError as exc:
        if origin is None:
            raise
        raise BusError(
            f"{exc}; the URL is from {origin}: is `gpuops run --state-dir {state_dir}` "
            "still running? (or pass --nats URL)"
        ) from exc


def cli_endpoint(cfg: NatsSettings, state_dir: Path) -> tuple[str, Credentials | None, Path | None]:
    """The URL a command connects to, its credentials, and the file the URL came from.

    The state dir's operator credentials are only ever sent to the URL its own engine
    wrote: a configured URL without configured credentials may be someone else's server.
    """
    own = bool(cfg.user or cfg.token or cfg.creds or cfg.nkeys_seed)
    marker = url_file(state_dir)
    try:
        written = marker.read_text().strip() if marker.exists() else ""
    except OSError as exc:
        if cfg.url:
            return cfg.url, None, None
        raise BusError(
            f"cannot read {marker} ({exc.strerror}): pass --nats URL and your NATS user "
            "(GPUOPS_NATS__USER, GPUOPS_NATS__PASSWORD)"
        ) from exc
    if cfg.url:
        mine = cfg.url == written and not own
        return cfg.url, read_credentials(state_dir, "cli") if mine else None, None
    if not written:
        raise BusError(
            f"no engine running on state dir {state_dir} (it has no nats.url) and no NATS "
            f"URL configured: start `gpuops run --state-dir {state_dir}`, or pass --nats URL"
        )
    return written, None if own else read_credentials(state_dir, "cli"), marker


def _stopped(cfg: NatsSettings, state_dir: Path) -> bool:
    """No URL to join, but a store an engine left in the state dir."""
    return not cfg.url and not url_file(state_dir).exists() and store_dir(state_dir).is_dir()


@asynccontextmanager
async def _read_store(cfg: NatsSettings, state_dir: Path, name: str) -> AsyncIterator[Bus]:
    """A stopped engine's store behind a private server: a new port, no nats.url, gone
    when the reader is done, so no agent or engine takes it for the engine's."""
    server = EmbeddedNats(
        store_dir(state_dir),
        config_text=server_config(
            ensure_credentials(state_dir), operators(state_dir), known_nodes(state_dir)
        ),
    )
    async with server:
        credentials = read_credentials(state_dir, "cli")
        bus = await connect(
            server.url, cfg, name, setup="open", credentials=credentials, role="cli"
        )
        try:
            yield bus
        finally:
            await bus.close()


async def _join_embedded(
    cfg: NatsSettings, state_dir: Path, name: str, role: Role, waiting: Waiting | None = None
) -> Bus | None:
    """A connection to another process's embedded server on this state dir, if it answers."""
    url = url_file(state_dir).read_text().strip() if url_file(state_dir).exists() else None
    if not url:
        return None
    # A URL left by an engine that died answers nothing: find out quickly, then start one.
    quick = cfg.model_copy(update={"connect_timeout_s": min(cfg.connect_timeout_s, 2.0)})
    try:
        credentials = read_credentials(state_dir, role)
        return await connect(
            url,
            quick,
            name,
            setup=_EMBEDDED_SETUP[role],
            credentials=credentials,
            buffer=role != "engine",
            waiting=waiting,
            role=role,
        )
    except BusError as exc:
        log.info("no running embedded nats-server at %s (%s); starting one", url, exc)
        url_file(state_dir).unlink(missing_ok=True)
        return None


@asynccontextmanager
async def _own_embedded(
    cfg: NatsSettings, state_dir: Path, name: str, role: Role
) -> AsyncIterator[Bus]:
    """Start a supervised embedded server, set it up as the engine, connect as `role`."""
    server = new_server(state_dir, cfg.embedded_port)
    async with server:
        announce(state_dir, server)
        log.info("embedded nats-server at %s (store %s)", server.url, server.store_dir)
        try:
            engine = read_credentials(state_dir, "engine")
            bus = await connect(server.url, cfg, name, credentials=engine, buffer=role != "engine")
            if role != "engine":
                await bus.close()
                bus = await connect(
                    server.url,
                    cfg,
                    name,
                    setup=_EMBEDDED_SETUP[role],
                    credentials=read_credentials(state_dir, role),
                    role=role,
                )
            bus.server = server
            try:
                yield bus
            finally:
                await bus.close()
        finally:
            url_file(state_dir).unlink(missing_ok=True)


def agent_endpoint(
    cfg: NatsSettings, state_dir: Path, node: str | None = None
) -> tuple[str, Credentials | None]:
    """Where a node's agent (or, with no node, a source) connects: the configured URL,
    else this state dir's embedded server as the node's own user (or the source user)."""
    if cfg.url:
        return cfg.url, None
    url = remembered_url(state_dir)
    if url is None:
        raise BusError(
            f"no NATS URL: pass --nats URL, or run `gpuops run` with state dir {state_dir}"
        )
    if node is None:
        return url, read_credentials(state_dir, "source")
    return url, node_credentials(state_dir, node)
