"""One frozen settings object, from a YAML file, then `GPUOPS_*` environment, then flags."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuops import shipped
from gpuops.errors import ConfigError
from gpuops.models import DomainKind
from gpuops.power.config import PowerSettings


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/gpuops`, or `~/.local/state/gpuops`."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpuops"


def checkout_root() -> Path:
    """The folder holding the shipped rules/ and playbooks/ (a checkout, or the wheel's copy).

    Kept for callers that want the shipped copies; defaults use `shipped.locate`.
    """
    return shipped.root()


def _site_or_shipped(part: str) -> Path:
    return shipped.locate(part).path


# Shared secrets people configure (console and Alertmanager tokens, ChatOps secrets, the
# proxy's secret) are guessed online, one request at a time: 24 characters of
# `openssl rand -hex 24` (48) are far out of reach, a short word is not.
MIN_SECRET_CHARS = 24


def _long_enough(secret: SecretStr) -> SecretStr:
    if len(secret.get_secret_value()) < MIN_SECRET_CHARS:
        raise ValueError(
            f"too short: a shared secret needs at least {MIN_SECRET_CHARS} characters "
            "(make one with `openssl rand -hex 24`)"
        )
    return secret


# A secret that someone could guess over HTTP: refused when shorter than MIN_SECRET_CHARS.
StrongSecret = Annotated[SecretStr, AfterValidator(_long_enough)]


def _site_inventory() -> Path:
    # Never the shipped example: its hosts are made up, and `gpuops simulate` writes here.
    return shipped.site_dir() / "inventories" / "sim"


# A node lock's lease, and so the oldest intent an executor runs (`safety.lock_lease_s`).
LOCK_LEASE_S = 1800.0


class NatsSettings(BaseModel):
    """How to reach NATS; with no `url`, gpuops starts an embedded nats-server."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = None
    user: str | None = None
    password: SecretStr | None = None
    token: SecretStr | None = None
    nkeys_seed: Path | None = None
    creds: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    replicas: int = Field(default=1, ge=1, le=5)
    # Telemetry is replaced by the next sample within seconds: a site may keep it cheaper
    # than health events, intents and audit (which stay file storage at `replicas`):
    # in memory, and with fewer replicas (docs/operations.md, "Sizing").
    telemetry_storage: Literal["file", "memory"] = "file"
    telemetry_replicas: int | None = Field(default=None, ge=1, le=5, description="None: replicas")
    telemetry_max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # A command's first connect gives up after this long (a wrong URL must not hang it);
    # once connected, long-running roles reconnect for as long as NATS is away.
    connect_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # Connected, `run` waits this long for JetStream to answer its set-up (a cluster
    # still electing its leaders, or too busy to answer in time) before it gives up;
    # a command waits `connect_timeout_s`.
    setup_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    # The embedded server's port; unset, it keeps the one it had (STATE/nats/port).
    embedded_port: int | None = Field(default=None, ge=1, le=65535)
    # Caps of the streams that would otherwise grow without bound: the oldest records go
    # first when a cap is reached (the audit trail keeps its newest 8 GiB / 90 days).
    audit_max_bytes: int = Field(default=8 << 30, ge=1 << 20)
    audit_max_age_s: float = Field(default=90 * 86400.0, gt=0)
    events_max_bytes: int = Field(default=4 << 30, ge=1 << 20)
    # Dead letters come from whoever can publish, so a flood of bad events must not fill
    # the store: the newest 1 GiB / 14 days stay, for a person to look at.
    dlq_max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    dlq_max_age_s: float = Field(default=14 * 86400.0, gt=0)
    # How long the audit stream remembers a record's message id: a decision's record is
    # written by the engine and again by the executor that claims its intent, which may
    # be as old as `safety.lock_lease_s`. `Settings` raises it to that (never lower).
    audit_dedupe_s: float = Field(default=LOCK_LEASE_S, ge=600)
    # Telemetry and health events are split by node into this many partitions (NATS's
    # subject mapping); engine replicas share them out. Every replica must agree, and it
    # is set once: at least the most replicas you will run (docs/operations.md).
    partitions: int = Field(default=8, ge=1, le=1024)
    # A replica owns a partition while it renews its lease; one that stops renewing loses
    # its partitions to the others this long after its last renewal.
    lease_s: float = Field(default=10.0, ge=2, le=300)


class IdentitySettings(BaseModel):
    """Who may publish what: every message's publisher is proved (docs/deploy.md, Identity)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Refuse (dead-letter as `forged`) messages that carry no publisher MAC. Turn it off
    # only while a site moves its agents to keys: a wrong MAC, or a publisher that may
    # not speak for the node, is refused either way.
    required: bool = True
    # The engine's identity key, from which every publisher's key is derived
    # (default STATE/keys/identity.key, made on first start).
    key_file: Path | None = None
    # An agent's or a source's own key (default STATE/creds/publishers/<identity>.key,
    # which the engine writes for each inventory node on its own state dir).
    publisher_key: Path | None = None


class DomainBudget(BaseModel):
    """How many nodes of one failure domain may lose capacity within the window: at most
    `nodes`, and at most `share` of the domain's hosts (rounded up); always at least one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int | None = Field(default=None, ge=1)
    share: float | None = Field(default=None, gt=0, le=1)

    def limit(self, size: int) -> int:
        """The budget of a domain of `size` hosts."""
        found = [size]
        if self.nodes is not None:
            found.append(self.nodes)
        if self.share is not None:
            found.append(math.ceil(size * self.share))
        return max(1, min(found))


# Two nodes of a rack at a time (and half of a smaller one), half a PDU, a quarter of a
# cooling loop, a leaf switch or an NVLink domain: more at once is a domain fault, not N
# node faults, and remediating node by node would empty the domain (docs/operations.md).
DEFAULT_DOMAIN_BUDGETS: dict[DomainKind, DomainBudget] = {
    "rack": DomainBudget(nodes=2, share=0.5),
    "pdu": DomainBudget(share=0.5),
    "cooling_loop": DomainBudget(share=0.25),
    "leaf_switch": DomainBudget(share=0.25),
    "nvlink_domain": DomainBudget(share=0.25),
}


class SafetySettings(BaseModel):
    """The decide stages' numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stale_after_s: float = Field(default=900.0, gt=0)
    equivalence_window_s: float = Field(default=1800.0, ge=0)
    # Also the oldest an intent may be when an executor runs it (gpuops.act.executor).
    lock_lease_s: float = Field(default=LOCK_LEASE_S, gt=0)
    attempt_cap: int = Field(default=5, ge=1)
    attempt_window_s: float = Field(default=7 * 86400.0, gt=0)
    breaker_share: float = Field(default=0.05, gt=0, le=1)
    breaker_absolute: int = Field(default=20, ge=1)
    # A small fleet may still lose this many nodes (never more than half of it): 5% of
    # 11 nodes is one, which would stop automation at the second fault.
    breaker_floor: int = Field(default=2, ge=1)
    breaker_window_s: float = Field(default=600.0, gt=0)
    # Budgets per failure-domain kind (gpuops.inventory.domains), on top of the breaker,
    # over their own window; a kind left out is not budgeted ({} turns them all off).
    domain_budgets: dict[DomainKind, DomainBudget] = Field(
        default_factory=lambda: dict(DEFAULT_DOMAIN_BUDGETS)
    )
    domain_window_s: float = Field(default=600.0, gt=0)
    approval_timeout_s: float = Field(default=1800.0, gt=0)
    # A node in `validating` whose probe never answers goes to a person after this long.
    validation_timeout_s: float = Field(default=900.0, gt=0)
    # The gate back into service: the grade of diagnostics (diagnose.yml: 1 quick, 2
    # medium, 3 deep) the return after a remediation runs first and must pass; 0 for none.
    validation_grade: int = Field(default=1, ge=0, le=3)


class NotificationSettings(BaseModel):
    """Episodes and grouping: what people are told, and how often (Alertmanager's ideas)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repeat_interval_s: float = Field(default=4 * 3600.0, gt=0)
    resolve_after_s: float = Field(default=300.0, gt=0)
    group_wait_s: float = Field(default=10.0, ge=0)
    group_interval_s: float = Field(default=60.0, ge=0)
    storm_nodes: int = Field(default=10, ge=1)


class WebhookSettings(BaseModel):
    """An incoming webhook for notifications (the URL is a secret)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["slack", "mattermost"] = "slack"
    url: SecretStr
    channel: str | None = None


# A principal is who asked, qualified by where: a chat's user id within its team (a name
# can be changed by its owner, or taken by someone else; an id cannot), the console's
# login, the CLI's NATS user. One person on two platforms is two principals.
Platform = Literal["slack", "mattermost", "console", "cli"]
_CHAT_ID = r"[A-Za-z0-9_.-]{1,64}"
_PRINCIPAL = re.compile(
    rf"(?:slack|mattermost):{_CHAT_ID}/{_CHAT_ID}|console:[A-Za-z0-9._@-]{{1,64}}"
    r"|cli:[A-Za-z0-9_-]{1,64}"
)
PRINCIPAL_FORMS = (
    "slack:TEAM_ID/USER_ID, mattermost:TEAM_ID/USER_ID, console:USER or cli:NATS_USER"
    " (e.g. slack:T0123/U0456 or cli:alice)"
)


def principal(platform: Platform, *parts: str) -> str | None:
    """`platform:team/user` (chat) or `platform:user`, or None when a part is missing or
    holds what no id does (a `/` in a user id must not shift it into another team)."""
    text = f"{platform}:" + "/".join(parts)
    return text if _PRINCIPAL.fullmatch(text) else None


class Permission(BaseModel):
    """Who may run a ChatOps command: principals and channels (empty: anyone / anywhere)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    users: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()

    @field_validator("users")
    @classmethod
    def _qualified(cls, users: tuple[str, ...]) -> tuple[str, ...]:
        # A bare name meant "this name on any platform": whoever took that display name
        # in any chat got the grant. Refused, so no site keeps one by accident.
        for user in users:
            if not _PRINCIPAL.fullmatch(user):
                raise ValueError(f"{user!r} is not a principal: write {PRINCIPAL_FORMS}")
        return users


# The most a Slack timestamp may differ from the clock: the replay bucket keeps each
# request id for twice this (a request may be early or late by the skew), whatever
# `max_skew_s` is set to.
MAX_SKEW_S = 900.0


class ChatopsSettings(BaseModel):
    """Slack and Mattermost: how requests are verified, who may do what, where to notify."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slack_signing_secret: StrongSecret | None = None
    # The Slack app's id (Basic Information): set, a request naming another app is refused.
    slack_app_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9]{1,32}$")
    mattermost_tokens: tuple[StrongSecret, ...] = ()
    max_skew_s: float = Field(default=300.0, gt=0, le=MAX_SKEW_S)
    # Commands without an entry are open to anyone who passed verification, except the
    # ones that change things, which default to nobody until listed here.
    permissions: dict[str, Permission] = Field(default_factory=dict)
    webhooks: tuple[WebhookSettings, ...] = ()
    # A request's `response_url` is only ever posted to these hosts: anything else would
    # let whoever can send a request make the engine POST wherever they like.
    slack_response_hosts: tuple[str, ...] = ("hooks.slack.com",)
    mattermost_response_hosts: tuple[str, ...] = Field(
        default=(), description="the Mattermost server's host name(s)"
    )
    # Refused requests are counted in /metrics; the audit gets one summary per interval.
    rejection_note_interval_s: float = Field(default=60.0, gt=0)
    # The longest silence a person may set: one mistyped `9999d` would otherwise stop
    # automation on its target for good, with nothing in view to say so.
    max_silence_s: float = Field(default=30 * 86400.0, gt=0)


class DriftSchedule(BaseModel):
    """One scheduled drift check: when (cron, time zone) and over which hosts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "nightly"
    cron: str = "0 3 * * *"
    timezone: str = "UTC"
    group: str = "all"


class DriftSettings(BaseModel):
    """Drift checks: schedules, batches, forks, and how late a missed slot may still run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedules: tuple[DriftSchedule, ...] = ()
    batch_size: int = Field(default=50, ge=1)
    forks: int = Field(default=10, ge=1)
    grace_s: float = Field(default=3600.0, ge=0)
    # The site's topology manifests (every *.yml, one per SKU: `gpuops topology learn`
    # writes them); each checked host is held to its `gpu_sku`'s. None: not compared.
    topology_dir: Path | None = None


class ExecutorSettings(BaseModel):
    """How intents become playbook runs: batches, forks, and the evidence each run leaves.

    Intents for the same playbook, ref and vars (all but the per-host data: rule, node,
    gpu, event ids, reason) that are ready together run as one ansible-runner call over
    their hosts. A run costs about a second of controller CPU to start, so a storm on 200
    nodes in batches of 50 starts 4 runs instead of 200. `max_parallel_runs` (above)
    bounds the runs in flight.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(default=50, ge=1, le=1000, description="most hosts in one run")
    forks: int = Field(default=10, ge=1, le=200, description="hosts a run works on at once")
    # How long the first intent of a batch waits for others: a storm's intents are
    # written over a few pipeline ticks, one remediation pays this once.
    gather_window_s: float = Field(default=0.5, ge=0, le=30)
    # Each run's artifacts (stdout, job events, rc, command) stay under STATE/runs/<run id>;
    # the oldest go first past either limit.
    evidence_max_age_s: float = Field(default=14 * 86400.0, gt=0)
    evidence_max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # A run gets PATH, HOME, LANG, LC_*, TMPDIR, SSH_AUTH_SOCK, ANSIBLE_PRIVATE_KEY_FILE of
    # the executor's environment and these names too (shell patterns: "PROXY_*"); nothing
    # else of it reaches Ansible or the evidence (docs/deploy.md#secrets).
    env_allow: tuple[str, ...] = ()
    # SSH host keys: strict refuses a host whose key is not in known_hosts; accept-new, for
    # onboarding, records a new host's key and still refuses a changed one.
    host_key_checking: Literal["strict", "accept-new"] = "strict"
    known_hosts: Path | None = Field(default=None, description="default: STATE/ssh/known_hosts")


class ConsoleToken(BaseModel):
    """A console login: whoever holds the token acts as `user` (under the ChatOps table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    user: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._@-]+$")
    token: StrongSecret


class ConsoleSettings(BaseModel):
    """The web console on the engine's HTTP address: who may look, who may act (docs/console.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    # Who may read without logging in: on a loopback bind only ("loopback": whoever can
    # reach it is on this host), "always" (a site that wants an open read-only console
    # on its network) or "never". `login_required: true` is "never".
    anonymous_read: Literal["loopback", "always", "never"] = "loopback"
    login_required: bool = False
    tokens: tuple[ConsoleToken, ...] = ()
    # A reverse proxy that authenticates people names them in this header. It is believed
    # only on requests that also carry `proxy_secret` in `proxy_secret_header`: an address
    # proves nothing (any process on the proxy's host, or in its pod, shares it).
    user_header: str | None = Field(default=None, max_length=64)
    proxy_secret: StrongSecret | None = None
    proxy_secret_header: str = Field(default="X-Gpuops-Proxy-Secret", min_length=1, max_length=64)
    # Optional, on top of the secret: the proxies' own addresses.
    trusted_proxies: tuple[str, ...] = ()
    session_s: float = Field(default=8 * 3600.0, gt=0, le=30 * 86400.0)
    # "auto": Secure when the request came over TLS, or through the proxy (its secret
    # matched) with X-Forwarded-Proto: https. "always": for a site whose TLS is elsewhere.
    cookie_secure: Literal["auto", "always"] = "auto"
    # Failed logins (a wrong token, bearer or proxy secret) per client: past this many in
    # the window, the client gets 429 until the oldest one leaves it.
    login_failures: int = Field(default=5, ge=1, le=1000)
    login_window_s: float = Field(default=60.0, gt=0, le=86400.0)
    push_s: float = Field(default=2.0, ge=0.2, le=60, description="live update period")
    max_streams: int = Field(default=32, ge=1, le=1000, description="live pages at once")

    @model_validator(mode="after")
    def _proxy_header_needs_its_secret(self) -> ConsoleSettings:
        if self.user_header and self.proxy_secret is None:
            raise ValueError(
                "user_header is set but proxy_secret is not: the proxy must also send a "
                "shared secret (console.proxy_secret, in console.proxy_secret_header), or "
                "anyone who reaches the engine could name any user (docs/console.md)"
            )
        return self


class PrometheusSourceSettings(BaseModel):
    """`gpuops ingest prometheus`: where to read DCGM fields, how often, and its bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    targets: tuple[str, ...] = Field(default=(), description="dcgm-exporter /metrics URLs")
    prometheus: str | None = Field(default=None, description="a Prometheus server's base URL")
    interval_s: float = Field(default=10.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0, le=300, description="per target and scrape")
    # A Prometheus query answer is about 170 KB per 8-GPU node with every mapped field.
    max_bytes: int = Field(default=64 << 20, ge=1024, description="largest answer read")
    max_series: int = Field(default=100_000, ge=1, description="series kept per answer")
    # The node a series speaks for is its scrape target's (a `--target` URL's host, or
    # Prometheus's `instance`), found in the inventory; never a label the exporter writes.
    # The exporter's own host name label is only checked against it ("" checks nothing:
    # dcgm-exporter in a pod without the host network names the pod).
    node_label: str = Field(default="Hostname", description="the exporter's claim, checked")
    # Read through Prometheus: a label its relabelling sets on every target (with
    # honor_labels false the exporter cannot set it) names the node instead of `instance`.
    target_label: str | None = Field(default=None, min_length=1, description="e.g. node")
    gpu_label: str = "gpu"
    # Label matchers added to the Prometheus query, to shard a fleet over several sources.
    selector: str = Field(default="", max_length=1000, description='e.g. job="dcgm",rack=~"a.*"')
    spool_max: int = Field(default=10_000, ge=1, description="xid events held while NATS is away")
    # Telemetry as the agents send it: 2 (static facts in a keyframe, readings as arrays,
    # gpuops.bus.wire) or 1 (every field, JSON) for an engine older than v2.
    telemetry_format: Literal[1, 2] = 2


class RedfishTarget(BaseModel):
    """One Redfish service to read: a server's BMC or a cooling unit's, and the inventory
    host it speaks for (the events' node; a CDU is a host too, in its loop)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str = Field(min_length=1, max_length=253)
    url: str = Field(pattern=r"^https?://[^/\s]+$", description="https://bmc:443, no path")
    user: str = Field(default="", max_length=128)
    password_file: Path | None = None
    # The CA that signed the service's certificate: required for https (the Redfish client
    # would otherwise not check the certificate at all).
    ca: Path | None = None

    @model_validator(mode="after")
    def _checked(self) -> RedfishTarget:
        if self.url.startswith("https://") and self.ca is None:
            raise ValueError(f"{self.url}: https needs `ca` (the CA that signed its certificate)")
        return self


class RedfishSourceSettings(BaseModel):
    """`gpuops ingest redfish`: facility readings from BMCs and cooling units, and bounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    targets: tuple[RedfishTarget, ...] = ()
    interval_s: float = Field(default=30.0, gt=0)
    timeout_s: float = Field(default=10.0, gt=0, le=300, description="per request")
    max_bytes: int = Field(default=1 << 20, ge=1024, description="largest document read")
    max_documents: int = Field(default=256, ge=1, description="documents read per target a poll")


class AlertmanagerSettings(BaseModel):
    """The Alertmanager webhook receiver, `POST /ingest/alertmanager` (docs/sources.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token: StrongSecret | None = Field(
        default=None,
        description="the bearer token Alertmanager sends; unset, the route refuses every post",
    )
    # Labels Prometheus (or the site's relabelling) sets on a target's series: an exporter
    # cannot write them (honor_labels: false keeps its own as exported_<name>). Never one
    # an exporter writes, such as dcgm-exporter's Hostname: that is `claim_label`.
    node_labels: tuple[str, ...] = Field(
        default=("instance",),
        min_length=1,
        description="the first of these labels an alert has names its node (instance: no port)",
    )
    claim_label: str = Field(
        default="Hostname",
        max_length=128,
        description="the exporter's own host name label: checked against the node (: none)",
    )
    gpu_label: str = Field(default="gpu", min_length=1)
    # Alertmanager batches a group's alerts into one post: more than the app's 64 KiB, bounded.
    max_body_bytes: int = Field(default=4 << 20, ge=64 << 10, le=64 << 20)
    max_alerts: int = Field(default=1000, ge=1, le=100_000)


class HttpLimits(BaseModel):
    """What a client may hold of the engine's HTTP server (ChatOps, console, receiver)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A client that opens connections and sends its request a byte at a time would hold
    # each forever: its headers must arrive within this of the connection opening (or of
    # the previous answer; an idle kept-alive connection is closed after it too), and its
    # body within this of its headers, else the connection is closed.
    read_timeout_s: float = Field(default=15.0, gt=0, le=300, description="per request")
    # Past it a new connection is answered 503 and closed at once (each holds a file
    # descriptor, and the process has a few thousand).
    max_connections: int = Field(default=256, ge=1, le=16_384, description="open at once")


class SourcesSettings(BaseModel):
    """Sources of events besides gpuops's own agent (docs/sources.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prometheus: PrometheusSourceSettings = PrometheusSourceSettings()
    redfish: RedfishSourceSettings = RedfishSourceSettings()
    alertmanager: AlertmanagerSettings = AlertmanagerSettings()


class Settings(BaseModel):
    """Everything the engine needs to run; built once, never mutated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: Path = Field(default_factory=default_state_dir)
    # The site's (./rules, ./playbooks) when the current directory has them, else shipped.
    rules_dir: Path = Field(default_factory=lambda: _site_or_shipped("rules"))
    playbooks_dir: Path = Field(default_factory=lambda: _site_or_shipped("playbooks"))
    inventory: Path = Field(default_factory=_site_inventory)
    nats: NatsSettings = NatsSettings()
    identity: IdentitySettings = IdentitySettings()
    role: Literal["all", "engine", "executor"] = "all"
    dry_run: bool = False
    safety: SafetySettings = SafetySettings()
    notifications: NotificationSettings = NotificationSettings()
    chatops: ChatopsSettings = ChatopsSettings()
    drift: DriftSettings = DriftSettings()
    power: PowerSettings = PowerSettings()  # budgets and the controller (docs/power.md)
    console: ConsoleSettings = ConsoleSettings()
    sources: SourcesSettings = SourcesSettings()
    http: str | None = Field(default=None, description="host:port for ChatOps, /metrics, /healthz")
    http_limits: HttpLimits = HttpLimits()
    run_timeout_s: float = Field(default=900.0, gt=0)
    # A run whose executor has not renewed its claim for this long is taken as interrupted
    # (the executor died): the node goes to a person, or a retry-safe playbook runs again.
    run_claim_stale_s: float = Field(default=90.0, ge=2)
    max_parallel_runs: int = Field(default=4, ge=1, le=256, description="runs in flight")
    executor: ExecutorSettings = ExecutorSettings()
    intake_batch: int = Field(default=256, ge=1, le=10_000)
    # After a telemetry batch that was not full, wait this long before the next pull, so
    # samples gather into batches instead of a pull, a handling and an ack for every few
    # (health events never wait: their intakes do not linger). 0 pulls again at once.
    intake_linger_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="telemetry: pause after a batch that was not full (fewer, larger batches)",
    )
    tick_s: float = Field(default=1.0, gt=0)
    rules_poll_s: float = Field(default=2.0, gt=0, description="how often rule files are checked")
    max_future_skew_s: float = Field(
        default=300.0,
        gt=0,
        description="events dated further ahead of the engine's clock are dead-lettered (future)",
    )
    signing_key: Path | None = Field(
        default=None, description="intent signing key shared by engine and executors"
    )
    replica_id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="this engine replica's name (default: host name and state dir)",
    )

    @model_validator(mode="before")
    @classmethod
    def _audit_dedupe_covers_intents(cls, data: Any) -> Any:
        """The audit's duplicate window is at least the oldest an intent may run at
        (`safety.lock_lease_s`), or the executor's copy of a decision's record, written
        when it claims the intent, is stored twice. Derived here, once, for every role
        that sets the streams up from these settings."""
        if not isinstance(data, dict):
            return data
        try:
            safety = SafetySettings.model_validate(data.get("safety", {}))
            nats = NatsSettings.model_validate(data.get("nats", {}))
        except ValidationError:
            return data  # validation proper says what is wrong, and where
        if nats.audit_dedupe_s >= safety.lock_lease_s:
            return data
        return {**data, "nats": nats.model_copy(update={"audit_dedupe_s": safety.lock_lease_s})}


def secret_values(model: object) -> frozenset[str]:
    """The value of every SecretStr in the settings (to keep them out of run evidence)."""
    if isinstance(model, SecretStr):
        return frozenset({model.get_secret_value()})
    if isinstance(model, BaseModel):
        return secret_values([getattr(model, name) for name in type(model).model_fields])
    if isinstance(model, dict):
        return secret_values(list(model.values()))
    if isinstance(model, tuple | list):
        return frozenset[str]().union(*(secret_values(item) for item in model))
    return frozenset()


_ENV_PREFIX = "GPUOPS_"


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    """`GPUOPS_DRY_RUN=1` -> dry_run; `GPUOPS_NATS__URL=...` -> nats.url; a value that
    starts with `{` or `[` is JSON (`GPUOPS_SAFETY__DOMAIN_BUDGETS='{}'` turns them off)."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(_ENV_PREFIX) or name == "GPUOPS_CONFIG":
            continue
        path = name[len(_ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(name, value)
    return out


def _env_value(name: str, value: str) -> Any:
    if not value.lstrip().startswith(("{", "[")):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name}: not JSON ({exc})") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_settings(
    config: Path | None = None,
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Build the settings; file < environment < flags. Unknown keys are errors.

    The file is `config`, else GPUOPS_CONFIG, else the site's ./gpuops.yml if there is one.
    """
    env = dict(os.environ if environ is None else environ)
    path = config or (Path(env["GPUOPS_CONFIG"]) if env.get("GPUOPS_CONFIG") else None)
    path = path or shipped.site_settings()
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read settings file {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"settings file {path} must be a mapping")
        data = loaded
    data = _merge(data, _from_env(env))
    data = _merge(data, {k: v for k, v in (flags or {}).items() if v is not None})
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
