"""Users and permissions of the embedded nats-server: one user per role, one per node.

Each role may publish and subscribe only what its loops need, and each node's agent
only its own node's subjects, so that a stolen agent password cannot speak for another
node, queue an intent (`gpuops.actions.>`), rewrite state (`$KV.>`) or
reshape a stream through the JetStream API. Each operator (the CLI) is a user of its
own, and may publish commands only on `gpuops.cmd.<its user>.>`: the engine reads who
asked from that subject. JetStream subjects name the stream in a
fixed token, and permission wildcards match whole tokens only, so the stream names are
spelt out. A site running its own NATS gives each node its own user instead (see
docs/operations.md).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpuops import subjects
from gpuops.bus.buckets import BUCKETS, FACTS_KEY, LEASES_KEY, REPLAY_KEY
from gpuops.bus.identity import ENGINE_ONLY_KINDS
from gpuops.bus.reader import READER_SLOTS
from gpuops.errors import BusError
from gpuops.signing import create_private

Role = Literal["engine", "executor", "source", "cli"]
ROLES: tuple[Role, ...] = ("engine", "executor", "source", "cli")

ACTIONS = "GPUOPS_ACTIONS"
AUDIT = "GPUOPS_AUDIT"
# The executors' shared durable consumer of the actions work queue.
EXECUTOR_DURABLE = "gpuops-executor"
# Engine replicas' leases: only engines write them; the others read them (status).
LEASES = BUCKETS[LEASES_KEY].bucket
# ChatOps request ids seen: only engines write them. Another role that could delete one
# would let a captured request be served again; the others only open the bucket.
REPLAY = BUCKETS[REPLAY_KEY].bucket
# Nodes' static telemetry facts: what rules compare readings with (thresholds, limits).
# Only engines learn them, from samples whose publisher they proved.
FACTS = BUCKETS[FACTS_KEY].bucket
ENGINE_ONLY = (LEASES, REPLAY, FACTS)
KV_BUCKETS = tuple(c.bucket for c in BUCKETS.values() if c.bucket not in ENGINE_ONLY)
# What in the control bucket only the engine writes, for people (through its commands)
# or its own stages: an executor that could write an approval would have the engine
# decide it again as a person's (a drain for an event that never happened), and a
# dry-run switch, silence, breaker, budget or override would steer what the engine does.
# The executor writes its heartbeat there, and nothing else.
ENGINE_CONTROL = tuple(
    f"$KV.{BUCKETS['control'].bucket}.{prefix}.>"
    for prefix in (
        "approval",
        "silence",
        "breaker",
        "switch",
        "domain",
        "correlate",
        "power",
        "drift",
    )
)


@dataclass(frozen=True, slots=True)
class Permissions:
    """What one role may publish and subscribe."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    # Lets a role answer requests sent to it (the probe reply) without `_INBOX.>` publish:
    # only a message it received, so only under its own subscriptions (its own inbox).
    allow_responses: bool = field(default=True)


def _look(stream: str) -> list[str]:
    """JetStream API subjects to look up a stream and read single messages of it."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    ]


def _read_stream(stream: str) -> list[str]:
    """Read a stream through unnamed ephemeral consumers of the reader's own (the server
    names them: gpuops.bus.reader), pulled and acked. Only for streams where no role
    keeps a durable consumer (the audit trail, dead letters, KV buckets): on the others a
    create naming that durable in its body would change it (`_watch_stream`). This bare
    subject is kept for them on purpose: the server refuses a durable on it, where the
    named form (`CREATE.<stream>.*`, no prefix can be granted) would let a reader leave
    durables that fill the stream's consumer limit for good. No role but the engine may
    make a durable, delete, pause or move one."""
    return [
        *_look(stream),
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
    ]


def _watch_stream(stream: str) -> list[str]:
    """Read a stream the engine's partitions consume (events, telemetry): through
    consumers of the readers' own fixed names only (gpuops.bus.reader.READER_SLOTS),
    made, pulled and deleted by name. The engine's are named by partition and epoch, and
    a create request that names one (on the bare `CREATE.<stream>`, in its body, or on
    `CREATE.<stream>.<name>`) changes that consumer in place: its filter, its
    redeliveries. Permissions match whole tokens, so a name prefix cannot be granted:
    the names are spelt out. Never a durable's pull or ack."""
    out = [
        *_look(stream),
        f"$JS.API.CONSUMER.INFO.{stream}.*",  # read-only: how far a read has come
        f"$JS.API.CONSUMER.NAMES.{stream}",  # read-only: `gpuops status`'s partition lag
    ]
    for name in READER_SLOTS:
        out += [
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{name}",
        ]
    return out


def _own_durable(stream: str, name: str) -> list[str]:
    """Make, read and ack one named durable consumer (the executors' work queue)."""
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{name}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}",
        f"$JS.API.CONSUMER.INFO.{stream}.{name}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
        f"$JS.ACK.{stream}.{name}.>",
    ]


def _kv(buckets: Iterable[str], writable: Iterable[str]) -> list[str]:
    """Read every bucket given; put, delete and compare-and-set on the writable ones."""
    out: list[str] = []
    for bucket in buckets:
        out += _read_stream(f"KV_{bucket}")
    return out + [f"$KV.{bucket}.>" for bucket in writable]


def _own_inbox(role: Role) -> tuple[str, ...]:
    """Replies to a role's requests and its pull deliveries: under its own prefix only
    (gpuops.subjects.inbox_of), never another user's."""
    return (subjects.inbox_within(subjects.inbox_of(role)),)


# Ordered-consumer flow control.
_FLOW = ["$JS.FC.>"]

PERMISSIONS: dict[Role, Permissions] = {
    "engine": Permissions(
        publish=(subjects.EVERYTHING, "$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "_INBOX.>"),
        subscribe=(subjects.EVERYTHING, *_own_inbox("engine")),
    ),
    "executor": Permissions(
        publish=(
            subjects.AUDIT,
            subjects.PROBE_REQUESTS,
            subjects.events_of("diagnostics"),  # what its graded runs measured
            "$JS.API.INFO",
            *_own_durable(ACTIONS, EXECUTOR_DURABLE),
            *_read_stream(AUDIT),
            *_kv((*KV_BUCKETS, *ENGINE_ONLY), KV_BUCKETS),
            *_FLOW,
        ),
        subscribe=_own_inbox("executor"),
        deny_publish=ENGINE_CONTROL,
    ),
    # A source (the Prometheus source) reports about many nodes: it may publish any
    # node's telemetry and health events, and the engine checks each message's publisher
    # (gpuops.bus.identity). Commands, drift reports and alerts are not a source's to
    # send: a forged `drain`, drift or alert event would be decided like a person's, the
    # baseline check's or Alertmanager's (the engine's receiver publishes those). It
    # dead-letters the series it refuses (nothing acts on the dead-letter stream).
    "source": Permissions(
        publish=(
            subjects.TELEMETRY,
            subjects.EVENTS,
            *(subjects.dlq(reason) for reason in subjects.SOURCE_REFUSALS),
        ),
        # Agents on Kubernetes share this user until a site gives each node its own
        # (JWT): they hear probe requests here. A request holds no secret, and the
        # probe's answer is an event only the node's own key can sign. Those agents ask
        # under their node's inbox prefix (they cannot tell the shared user from their own).
        subscribe=(
            subjects.AGENT_REQUESTS,
            *_own_inbox("source"),
            subjects.inbox_within(subjects.NODE_INBOXES),
        ),
        deny_publish=tuple(subjects.events_of(kind) for kind in sorted(ENGINE_ONLY_KINDS)),
    ),
    # An operator (the CLI) reads everything it shows; everything it changes (silences,
    # approvals, the breaker, drains, dry-run, recorded events, drift checks) it asks
    # the engine for on its own command subject (see `operator_permissions`), so it
    # writes no state, no event and no audit record itself: identity and grants apply.
    "cli": Permissions(
        publish=(
            "$JS.API.INFO",
            "$JS.API.STREAM.NAMES",
            "$JS.API.STREAM.LIST",
            *_read_stream(AUDIT),
            *_watch_stream("GPUOPS_EVENTS"),
            *_watch_stream("GPUOPS_TELEMETRY"),  # gpuops export
            *_read_stream("GPUOPS_DLQ"),
            *_kv((*KV_BUCKETS, *ENGINE_ONLY), ()),
            *_FLOW,
        ),
        # Each operator's own inbox is added by `operator_permissions`.
        subscribe=(subjects.AGENT_REQUESTS,),
        deny_publish=(subjects.ACTIONS, subjects.events_of("chatops"), subjects.ALL_COMMANDS),
    ),
}

# The default operator's user name on a new state dir (creds/cli.json).
DEFAULT_OPERATOR = "operator"
_USER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def node_user(node: str) -> str:
    """A node's NATS user name on the embedded server."""
    return f"node:{subjects.token(node)}"


def check_user_name(name: str) -> str:
    """An operator's user name: one subject token, since it names their command subject."""
    if not _USER_NAME.fullmatch(name):
        raise BusError(
            f"operator user name {name!r}: use 1 to 64 letters, digits, '_' or '-' "
            "(it is a NATS subject token: gpuops.cmd.<user>.>)"
        )
    return name


def operator_permissions(user: str) -> Permissions:
    """The CLI's permissions for one operator: its own command subject and inbox,
    nobody else's.

    The engine takes the user from the subject a command arrives on, and the server lets
    only this user publish there: that is what makes the identity unforgeable.
    """
    base = PERMISSIONS["cli"]
    own = subjects.commands_of(check_user_name(user))
    return Permissions(
        publish=(*base.publish, own),
        subscribe=(*base.subscribe, subjects.inbox_within(subjects.operator_inbox(user))),
        deny_publish=tuple(d for d in base.deny_publish if d != subjects.ALL_COMMANDS),
    )


def node_permissions(node: str) -> Permissions:
    """One node's agent: its own node's telemetry and health events (not the kinds only
    the engine makes), and its own probe requests.

    `node` may be `subjects.USER_NAME`: in a user JWT, nats-server fills it in with the
    user's name, so one list serves every node and a node's user cannot speak for another.
    """
    return Permissions(
        publish=(subjects.telemetry(node), subjects.events_from(node)),
        subscribe=(
            subjects.agent_requests_to(node),
            subjects.inbox_within(subjects.node_inbox(node)),
        ),
        deny_publish=tuple(subjects.events_of(kind) for kind in sorted(ENGINE_ONLY_KINDS)),
    )


@dataclass(frozen=True, slots=True)
class Credentials:
    """One role's user and password on the embedded server."""

    user: str
    password: str


def private_dir(path: Path) -> Path:
    """Create `path` (and parents) and make it 0700: it holds passwords or leads to them."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path


def creds_dir(state_dir: Path) -> Path:
    """Where each role's credentials live (0700)."""
    return state_dir / "creds"


def ensure_credentials(state_dir: Path) -> dict[Role, Credentials]:
    """Every role's credentials, generated the first time and kept (agents reuse them)."""
    private_dir(state_dir)
    folder = private_dir(creds_dir(state_dir))
    out: dict[Role, Credentials] = {}
    for role in ROLES:
        path = folder / f"{role}.json"
        if not path.exists():
            user = DEFAULT_OPERATOR if role == "cli" else role
            _write_private(path, {"user": user, "password": secrets.token_urlsafe(32)})
        path.chmod(0o600)
        out[role] = read_credentials(state_dir, role)
    return out


def nodes_dir(state_dir: Path) -> Path:
    """Where each node's NATS credentials live (one JSON file per node, 0600)."""
    return creds_dir(state_dir) / "nodes"


def ensure_node_credentials(state_dir: Path, nodes: Iterable[str]) -> dict[str, Credentials]:
    """Each node's own NATS user, generated the first time and kept; by node token."""
    folder = private_dir(nodes_dir(state_dir))
    out: dict[str, Credentials] = {}
    for node in nodes:
        path = folder / f"{subjects.token(node)}.json"
        if not path.exists():
            _write_private(path, {"user": node_user(node), "password": secrets.token_urlsafe(32)})
        out[subjects.token(node)] = _read_file(path, f"node {node}")
    return out


def known_nodes(state_dir: Path) -> dict[str, Credentials]:
    """Every node user the state dir holds (the embedded server's config names them all)."""
    folder = nodes_dir(state_dir)
    if not folder.is_dir():
        return {}
    return {path.stem: _read_file(path, "node") for path in sorted(folder.glob("*.json"))}


def node_credentials(state_dir: Path, node: str) -> Credentials:
    """One node's NATS credentials from the state dir (the engine writes them)."""
    path = nodes_dir(state_dir) / f"{subjects.token(node)}.json"
    if not path.exists():
        raise BusError(
            f"node {node!r} has no NATS user on state dir {state_dir} ({path}): the engine "
            "makes one for each node of its inventory; is the node in it, and was the "
            "engine started since it was added?"
        )
    return _read_file(path, f"node {node}")


def operators_dir(state_dir: Path) -> Path:
    """Where a site puts the credentials of more operator users (one JSON file each)."""
    return creds_dir(state_dir) / "operators"


def operators(state_dir: Path) -> list[Credentials]:
    """The operator users a site added, each checked; a bad file is an error, not skipped."""
    folder = operators_dir(state_dir)
    if not folder.is_dir():
        return []
    return [_read_file(path, "operator") for path in sorted(folder.glob("*.json"))]


def read_credentials(state_dir: Path, role: Role) -> Credentials:
    """One role's credentials from the state dir."""
    return _read_file(creds_dir(state_dir) / f"{role}.json", role)


def _read_file(path: Path, role: str) -> Credentials:
    try:
        raw = json.loads(path.read_text())
        return Credentials(user=str(raw["user"]), password=str(raw["password"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BusError(
            f"cannot read the {role} credentials of the embedded NATS ({path}: {exc}); "
            "start `gpuops run` on this state dir first, or configure a NATS URL"
        ) from exc


def _write_private(path: Path, data: dict[str, str]) -> None:
    """Make a credentials file once: of replicas starting together, the first one's
    password stands and the others read it."""
    create_private(path, json.dumps(data))


def server_config(
    creds: dict[Role, Credentials],
    extra: Iterable[Credentials] = (),
    nodes: dict[str, Credentials] | None = None,
) -> str:
    """The `authorization` block of nats-server.conf for these credentials.

    Passwords are in plain text: nats-server accepts them so, and the file is 0600 in a
    0700 directory owned by the user who also holds the credential files.
    """
    users = [
        _user_block(creds[role], permissions_of(role, creds[role].user))
        for role in ROLES
        if role in creds
    ]
    users += [_user_block(cred, operator_permissions(cred.user)) for cred in extra]
    users += [_user_block(cred, node_permissions(tok)) for tok, cred in (nodes or {}).items()]
    names = [c.user for c in creds.values()] + [c.user for c in extra]
    names += [c.user for c in (nodes or {}).values()]
    if len(set(names)) != len(names):
        raise BusError(f"two credential files name the same NATS user: {sorted(names)}")
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


def permissions_of(role: Role, user: str) -> Permissions:
    """What `user` in `role` may do (a `cli` user: the operator's, with its own subject)."""
    return operator_permissions(user) if role == "cli" else PERMISSIONS[role]


def _user_block(cred: Credentials, perms: Permissions) -> str:
    publish: dict[str, list[str]] = {"allow": list(perms.publish)}
    if perms.deny_publish:
        publish["deny"] = list(perms.deny_publish)
    block = {
        "user": cred.user,
        "password": cred.password,
        "permissions": {
            "publish": publish,
            "subscribe": {"allow": list(perms.subscribe)},
            **({"allow_responses": True} if perms.allow_responses else {}),
        },
    }
    # JSON is valid nats-server config syntax, and quotes every `$` subject safely.
    return "    " + json.dumps(block)
