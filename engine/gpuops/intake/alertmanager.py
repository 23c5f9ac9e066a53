"""The Alertmanager webhook receiver: `POST /ingest/alertmanager`.

Alertmanager posts a group's alerts as one JSON document (webhook payload version 4).
The post must carry `Authorization: Bearer <sources.alertmanager.token>` (compared in
constant time); with no token configured every post is refused. The body is bounded
(`max_body_bytes`, above the app's 64 KiB: a group of a thousand alerts is megabytes)
and so is the number of alerts. A post that cannot be read is refused whole (400 with
the reason); Alertmanager does not retry a 4xx, and a retry would not fix it.

Each alert of a readable post becomes one `alert` event (source `alertmanager`, the raw
labels under `data.labels`) published to the bus like an agent's, so the engine's
intake, rules and safety stages take it like any other event. An alert whose labels
name no usable node is a dead letter with its reason; the rest of the batch goes on.

The node is the alert's target's (gpuops.inventory.targets, as for a scrape): the first of
`node_labels`, labels Prometheus sets (`instance`), found in the inventory by name or
`ansible_host`. The exporter's own host name label (`claim_label`, dcgm-exporter's
`Hostname`) is copied into the alert by Prometheus's rule but written by the exporter, so
a compromised node could name any host there: it is only checked against the target's
node, and an alert whose claim names another node is dead-lettered as `forged`.

Alertmanager repeats a firing alert every `repeat_interval` (hours; far past the events
stream's duplicate window), and a pair of Alertmanagers each send every notification.
A repeat is not a new decision: the event id is a hash of (fingerprint, status,
startsAt), and the last status seen per fingerprint is kept in KV (compare-and-set), so
a repeat is answered 2xx and not published again. The record is written after the
publish: a crash between the two publishes again under the same id, which JetStream
stores once within its window.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter as Tally
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from aiohttp import web
from nats.errors import Error as NatsError
from prometheus_client import CollectorRegistry, Counter
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from gpuops import subjects
from gpuops.bus.publish import Publisher
from gpuops.bus.store import KV, Store
from gpuops.clock import Clock, rfc3339
from gpuops.errors import EventError
from gpuops.intake.decode import MAX_EVENT_BYTES, MAX_FUTURE_S, dead_letter
from gpuops.inventory.targets import Targets
from gpuops.models import (
    EVENT_ADAPTER,
    MAX_ALERT_LABELS,
    AlertKey,
    AlertText,
    Event,
)
from gpuops.settings import AlertmanagerSettings
from gpuops.signing import same_secret

log = logging.getLogger(__name__)

PATH = "/ingest/alertmanager"
SOURCE = "alertmanager"


class Rejection(StrEnum):
    """Why a post was refused whole: the metric label and the answer's `error`."""

    NOT_CONFIGURED = "not_configured"
    MISSING_TOKEN = "missing_token"
    BAD_TOKEN = "bad_token"
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    TOO_MANY_ALERTS = "too_many_alerts"


STATUS = {
    Rejection.NOT_CONFIGURED: 503,
    Rejection.MALFORMED: 400,
    Rejection.TOO_LARGE: 413,
    Rejection.TOO_MANY_ALERTS: 413,
}  # the rest: 401


class Outcome(StrEnum):
    """What became of one alert of an accepted post."""

    PUBLISHED = "published"
    DUPLICATE = "duplicate"  # the same status for the same occurrence: not decided again
    STALE = "stale"  # older than what was seen (a retry that lost the race to its resolution)
    DEAD_LETTER = "dead_letter"


# --- the webhook payload (version 4) --------------------------------------------------


class _Payload(BaseModel):
    # Alertmanager may add fields; what gpuops reads is checked.
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


def _in_utc(value: datetime) -> datetime:
    """A time that is one in UTC: 0001-01-01T00:00:00+01:00 is a valid RFC 3339 text
    whose UTC year is 0, on which every later use of it (its id, its epoch) raises."""
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is outside the years 1 to 9999 in UTC") from None
    return value


AlertTime = Annotated[AwareDatetime, AfterValidator(_in_utc)]


class WebhookAlert(_Payload):
    """One alert as Alertmanager sends it."""

    status: Literal["firing", "resolved"]
    labels: dict[AlertKey, AlertText] = Field(max_length=MAX_ALERT_LABELS)
    annotations: dict[AlertKey, AlertText] = Field(
        default_factory=dict, max_length=MAX_ALERT_LABELS
    )
    starts_at: AlertTime = Field(alias="startsAt")
    ends_at: AlertTime | None = Field(default=None, alias="endsAt")
    # Alertmanager's are 16 hex digits; one KV key each, so nothing a key cannot hold.
    fingerprint: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")


class Webhook(_Payload):
    """The notification: a group's alerts (each read on its own, so one bad alert is
    a dead letter and not the whole group's loss)."""

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    group_key: str = Field(default="", alias="groupKey")
    truncated_alerts: int = Field(default=0, ge=0, alias="truncatedAlerts")
    alerts: list[dict[str, Any]]


class AlertSeen(BaseModel):
    """The last notification taken for one alert fingerprint (KV, `alert.<fingerprint>`)."""

    model_config = ConfigDict(frozen=True)

    status: Literal["firing", "resolved"]
    starts_at: float
    event_id: str
    at: float


def judge(seen: AlertSeen | None, status: str, starts_at: float) -> Outcome:
    """Whether a notification is news, given the last one taken for its fingerprint."""
    if seen is None or starts_at > seen.starts_at:
        return Outcome.PUBLISHED  # first seen, or the alert fired again (a new occurrence)
    if starts_at < seen.starts_at:
        return Outcome.STALE
    if status == seen.status:
        return Outcome.DUPLICATE
    if seen.status == "resolved":
        return Outcome.STALE  # a firing retried after its own resolution was taken
    return Outcome.PUBLISHED


def event_id(fingerprint: str, status: str, starts_at: datetime) -> str:
    """The same id for every repeat of one alert's one status in one occurrence."""
    text = f"{fingerprint}|{status}|{rfc3339(starts_at.timestamp())}"
    return "am-" + hashlib.sha256(text.encode()).hexdigest()[:40]


def node_of(labels: dict[str, str], names: tuple[str, ...]) -> str | None:
    """The node an alert is about: the first of `names` it has (`instance` without port)."""
    for name in names:
        value = labels.get(name, "").strip()
        if name == "instance":
            value = _without_port(value)
        if value:
            return value
    return None


def _without_port(instance: str) -> str:
    host, sep, port = instance.rpartition(":")
    if sep and host and port.isdigit():
        return host.removeprefix("[").removesuffix("]")
    return instance


def gpu_of(value: str | None) -> int | None:
    """A GPU index from a label (dcgm-exporter's `gpu` is "0".."7"); else None."""
    if value is not None and value.isascii() and value.isdigit() and len(value) <= 6:
        return int(value)
    return None


def target_node(
    labels: dict[str, str], settings: AlertmanagerSettings, targets: Targets | None
) -> str:
    """The node an alert is about: its target's, as the inventory names it (a host the
    inventory lacks as the label says: the engine acts on no unknown host); EventError
    when no label names it, or the exporter's own claim names another node."""
    host = node_of(labels, settings.node_labels)
    if host is None:
        wanted = ", ".join(settings.node_labels)
        raise EventError("no_node", f"no node label: the alert has none of {wanted}")
    node = (targets.node_of(host) if targets is not None else None) or host
    label = settings.claim_label
    claim = labels.get(label, "").strip() if label else ""
    if claim and claim != node and (targets is None or not targets.agrees(node, {label: claim})):
        raise EventError(
            subjects.FORGED, f"its {label} label names {claim!r}, but its target {host!r} is {node}"
        )
    return node


def to_event(
    alert: WebhookAlert, settings: AlertmanagerSettings, now: float, targets: Targets | None = None
) -> Event:
    """The `alert` event for one alert; EventError when its node or name is missing or bad."""
    node = target_node(alert.labels, settings, targets)
    name = alert.labels.get("alertname", "")
    if not name:
        raise EventError("schema", "no alertname label")
    # A firing alert's endsAt is Alertmanager's timeout guess, or Go's zero time: no end.
    ends = alert.ends_at if alert.status == "resolved" else None
    raw = {
        "id": event_id(alert.fingerprint, alert.status, alert.starts_at),
        "kind": "alert",
        "node": node,
        "ts": rfc3339(now),  # an alert says what holds now: startsAt may be days old
        "source": SOURCE,
        "data": {
            "name": name,
            "status": alert.status,
            "labels": alert.labels,
            "annotations": alert.annotations,
            "fingerprint": alert.fingerprint,
            "gpu": gpu_of(alert.labels.get(settings.gpu_label)),
            "starts_at": alert.starts_at,
            "ends_at": ends,
        },
    }
    try:
        return EVENT_ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        reason = "bad_node" if any(e["loc"][-1] == "node" for e in exc.errors()) else "schema"
        raise EventError(reason, f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from exc


class Refused(EventError):
    """A post refused whole, with what to tell the sender."""

    def __init__(self, rejection: Rejection, message: str) -> None:
        super().__init__(rejection.value, message)
        self.rejection = rejection


def _read_payload(body: bytes, max_alerts: int) -> Webhook:
    try:
        payload = Webhook.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[:3]
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in first)
        raise Refused(Rejection.MALFORMED, why) from exc
    if len(payload.alerts) > max_alerts:
        raise Refused(
            Rejection.TOO_MANY_ALERTS,
            f"{len(payload.alerts)} alerts in one post, limit {max_alerts}: "
            "set max_alerts in Alertmanager's webhook_configs",
        )
    return payload


class AlertmanagerReceiver:
    """The `/ingest/alertmanager` route: authenticate, bound, read, dedupe, publish."""

    def __init__(
        self,
        settings: AlertmanagerSettings,
        publisher: Publisher,
        kv: KV,
        clock: Clock,
        registry: CollectorRegistry,
        targets: Targets,
        on_dead: Callable[[str], None] | None = None,
        max_future_s: float = MAX_FUTURE_S,
    ) -> None:
        self.settings, self.publisher, self.clock = settings, publisher, clock
        self.targets, self.max_future_s = targets, max_future_s
        self.seen: Store[AlertSeen] = Store(kv, AlertSeen, "alert")
        self.on_dead = on_dead
        self.rejections = Counter(
            "gpuops_alertmanager_rejections",
            "Alertmanager posts refused whole, by reason",
            ["reason"],
            registry=registry,
        )
        self.alerts = Counter(
            "gpuops_alertmanager_alerts",
            "Alerts received from Alertmanager, by what became of them",
            ["outcome"],
            registry=registry,
        )

    def mount(self, app: web.Application) -> None:
        """Add the route to the engine's HTTP application."""
        app.add_routes([web.post(PATH, self.ingest)])

    async def ingest(self, request: web.Request) -> web.Response:
        """One notification: each alert published once, or the post refused with why."""
        try:
            self._authenticate(request.headers.get("Authorization", ""))
            payload = _read_payload(await self._body(request), self.settings.max_alerts)
        except Refused as exc:
            return self._refuse(request, exc)
        if payload.truncated_alerts:
            self.alerts.labels("truncated").inc(payload.truncated_alerts)
            log.warning(
                "Alertmanager left %d alerts out of a post (its max_alerts)",
                payload.truncated_alerts,
            )
        tally: Tally[str] = Tally()
        try:
            for raw in payload.alerts:
                tally[(await self._one(raw)).value] += 1
        except (NatsError, TimeoutError) as exc:  # Alertmanager retries a 5xx
            log.warning("Alertmanager post not stored (%s): asking for a retry", exc)
            return web.json_response({"error": "bus_unavailable", "why": str(exc)}, status=503)
        return web.json_response({"alerts": len(payload.alerts), **tally})

    def _authenticate(self, header: str) -> None:
        token = self.settings.token
        if token is None:
            raise Refused(
                Rejection.NOT_CONFIGURED,
                "no token is configured for this receiver: set sources.alertmanager.token "
                "(GPUOPS_SOURCES__ALERTMANAGER__TOKEN)",
            )
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Refused(Rejection.MISSING_TOKEN, "Authorization: Bearer <token> is required")
        if not same_secret(given.strip(), token.get_secret_value()):
            raise Refused(Rejection.BAD_TOKEN, "the bearer token is not this receiver's")

    async def _body(self, request: web.Request) -> bytes:
        """The body, read up to the limit (the app-wide limit is for chat requests)."""
        limit = self.settings.max_body_bytes
        too_large = Refused(Rejection.TOO_LARGE, f"body over {limit} bytes")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.read(limit + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise too_large
        return b"".join(chunks)

    def _refuse(self, request: web.Request, exc: Refused) -> web.Response:
        self.rejections.labels(exc.reason).inc()
        log.warning("Alertmanager post from %s refused: %s", request.remote, exc.message)
        status = STATUS.get(exc.rejection, 401)
        return web.json_response({"error": exc.reason, "why": exc.message}, status=status)

    async def _one(self, raw: dict[str, Any]) -> Outcome:
        """Publish one alert unless it is a repeat; a dead letter when it cannot be read."""
        try:
            alert = WebhookAlert.model_validate(raw)
            event = to_event(alert, self.settings, self.clock.now(), self.targets)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            why = f"{'.'.join(map(str, first['loc'])) or 'alert'}: {first['msg']}"
            return await self._dead(raw, EventError("schema", why))
        except EventError as dead:
            return await self._dead(raw, dead)
        starts = alert.starts_at.timestamp()
        payload = event.model_dump_json().encode()
        try:
            self._check(starts, payload)
        except EventError as dead:  # before its KV record: it would shadow the true alert
            return await self._dead(raw, dead)
        seen, _ = await self.seen.get(alert.fingerprint)
        outcome = judge(seen, alert.status, starts)
        if outcome is Outcome.PUBLISHED:
            await self.publisher.publish(subjects.event("alert", event.node), payload, event.id)
            record = AlertSeen(
                status=alert.status, starts_at=starts, event_id=event.id, at=self.clock.now()
            )

            def newer(current: AlertSeen | None) -> AlertSeen | None:
                fresh = judge(current, alert.status, starts) is Outcome.PUBLISHED
                return record if fresh else None

            await self.seen.update(newer, alert.fingerprint)
        self.alerts.labels(outcome.value).inc()
        return outcome

    def _check(self, starts: float, payload: bytes) -> None:
        """What the engine's intake would refuse, refused here before anything is kept:
        a start far ahead of this clock (its KV record would make the true notifications
        of that alert look stale for as long), and an event past the intake's size (its
        labels' escapes and multi-byte text can be several times their characters)."""
        ahead = starts - self.clock.now()
        if ahead > self.max_future_s:
            raise EventError("future", f"startsAt is {ahead:.0f} s ahead of this clock")
        if len(payload) > MAX_EVENT_BYTES:
            raise EventError("too_large", f"{len(payload)} bytes > {MAX_EVENT_BYTES}")

    async def _dead(self, raw: dict[str, Any], dead: EventError) -> Outcome:
        body = json.dumps(raw, sort_keys=True, default=str).encode()
        log.warning("Alertmanager alert dead-lettered (%s): %s", dead.reason, dead.message)
        letter = dead_letter(dead.reason, dead.message, body, f"http:{PATH}", self.clock.now())
        msg_id = "dlq-am-" + hashlib.sha256(body).hexdigest()[:40]
        await self.publisher.publish(subjects.dlq(dead.reason), letter, msg_id)
        if self.on_dead is not None:
            self.on_dead(dead.reason)
        self.alerts.labels(Outcome.DEAD_LETTER.value).inc()
        return Outcome.DEAD_LETTER
