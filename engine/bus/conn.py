"""The NATS connection, the streams and the KV buckets gpuops uses."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, BucketNotFoundError
from nats.js.errors import Error as JsError
from nats.js.kv import KeyValue

from engine.bus.server import EmbeddedNats
from engine.errors import BusError
from engine.settings import NatsSettings

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
        subjects=["gpuops.telemetry.>"],
        retention=RetentionPolicy.LIMITS,
        max_age=600.0,
        max_bytes=1 << 30,
        discard=DiscardPolicy.OLD,
        storage=StorageType.FILE,
    ),
    StreamConfig(
        name=EVENTS,
        subjects=["gpuops.events.>"],
        retention=RetentionPolicy.LIMITS,
        max_age=7 * _DAY,
        duplicate_window=120.0,
        storage=StorageType.FILE,
    ),
    # A work queue: each intent is removed once an executor acks it.
    StreamConfig(
        name=ACTIONS,
        subjects=["gpuops.actions.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        duplicate_window=600.0,
        storage=StorageType.FILE,
    ),
    StreamConfig(
        name=AUDIT,
        subjects=["gpuops.audit.>"],
        retention=RetentionPolicy.LIMITS,
        max_age=90 * _DAY,
        storage=StorageType.FILE,
    ),
    StreamConfig(
        name=DLQ,
        subjects=["gpuops.dlq.>"],
        retention=RetentionPolicy.LIMITS,
        max_age=14 * _DAY,
        storage=StorageType.FILE,
    ),
)

BUCKETS: dict[str, KeyValueConfig] = {
    "claims": KeyValueConfig(bucket="gpuops_claims", history=1, ttl=30 * _DAY),
    "cooldowns": KeyValueConfig(bucket="gpuops_cooldowns", history=1, ttl=30 * _DAY),
    "nodes": KeyValueConfig(bucket="gpuops_nodes", history=5),
    "locks": KeyValueConfig(bucket="gpuops_locks", history=1),
    # silences, approvals, the breaker, runtime switches such as dry-run
    "control": KeyValueConfig(bucket="gpuops_control", history=5),
    # remediation history per node: attempt counts and ladder rungs (survives restarts)
    "history": KeyValueConfig(bucket="gpuops_history", history=1, ttl=30 * _DAY),
}


@dataclass(slots=True)
class Bus:
    """A connected client, its JetStream context and the KV buckets."""

    nc: Client
    js: JetStreamContext
    kv: dict[str, KeyValue]
    url: str

    async def close(self) -> None:
        """Flush what is pending and disconnect."""
        if not self.nc.is_closed:
            await self.nc.flush(timeout=5)
            await self.nc.close()


def _tls(cfg: NatsSettings) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=str(cfg.tls_ca) if cfg.tls_ca else None)
    if cfg.tls_cert:
        ctx.load_cert_chain(str(cfg.tls_cert), str(cfg.tls_key) if cfg.tls_key else None)
    return ctx


def connect_options(cfg: NatsSettings) -> dict[str, Any]:
    """Keyword arguments for nats.connect from the settings (secrets unwrapped only here)."""
    opts: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 1}
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


async def connect(url: str, cfg: NatsSettings | None = None, name: str = "gpuops") -> Bus:
    """Connect, then create the streams and buckets if they are missing."""
    cfg = cfg or NatsSettings()

    async def _error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    try:
        nc = await nats.connect(
            url, name=name, error_cb=_error, connect_timeout=5, **connect_options(cfg)
        )
    except (OSError, NatsError, TimeoutError) as exc:
        raise BusError(f"cannot connect to NATS at {url}: {exc}") from exc
    js = nc.jetstream(timeout=10)
    try:
        await ensure_streams(js, cfg.replicas)
        kv = {name: await ensure_bucket(js, c, cfg.replicas) for name, c in BUCKETS.items()}
    except (JsError, NatsError, TimeoutError) as exc:
        await nc.close()
        raise BusError(f"cannot set up JetStream at {url}: {exc}") from exc
    return Bus(nc=nc, js=js, kv=kv, url=url)


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> None:
    """Create each stream, or bring an existing one to this configuration."""
    for base in STREAMS:
        config = StreamConfig.from_response({**base.as_dict(), "num_replicas": replicas})
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


async def ensure_bucket(js: JetStreamContext, config: KeyValueConfig, replicas: int) -> KeyValue:
    """Open a KV bucket, creating it the first time."""
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        config.replicas = replicas
        return await js.create_key_value(config)


def url_file(state_dir: Path) -> Path:
    """Where a running engine with an embedded server writes its NATS URL."""
    return state_dir / "nats.url"


@asynccontextmanager
async def open_bus(cfg: NatsSettings, state_dir: Path, name: str = "gpuops") -> AsyncIterator[Bus]:
    """The configured NATS, or a running engine's embedded one, or a new embedded one."""
    url = cfg.url or await _running_embedded(state_dir)
    if url:
        bus = await connect(url, cfg, name)
        try:
            yield bus
        finally:
            await bus.close()
        return
    server = EmbeddedNats(state_dir / "nats")
    async with server:
        marker = url_file(state_dir)
        marker.write_text(server.url)
        log.info("embedded nats-server at %s (store %s)", server.url, server.store_dir)
        try:
            bus = await connect(server.url, cfg, name)
            try:
                yield bus
            finally:
                await bus.close()
        finally:
            marker.unlink(missing_ok=True)


async def _running_embedded(state_dir: Path) -> str | None:
    """The URL of another process's embedded server on this state dir, if it answers."""
    marker = url_file(state_dir)
    if not marker.exists():
        return None
    url = marker.read_text().strip()
    try:
        nc = await nats.connect(
            url, connect_timeout=1, max_reconnect_attempts=0, allow_reconnect=False
        )
    except (OSError, NatsError, TimeoutError):
        marker.unlink(missing_ok=True)
        return None
    await nc.close()
    return url
