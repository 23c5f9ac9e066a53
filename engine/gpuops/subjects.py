"""Every NATS subject gpuops uses, built and parsed in one place.

    gpuops.telemetry.<node>           samples (stream GPUOPS_TELEMETRY)
    gpuops.events.<kind>.<node>       health events (stream GPUOPS_EVENTS)
    gpuops.actions.<node>             intents (work queue GPUOPS_ACTIONS)
    gpuops.audit.<node>               the audit trail (`_fleet` for records about no node)
    gpuops.dlq.<reason>               dead letters
    gpuops.agent.<node>.probe         a request to a node's agent to run its probe
    gpuops.cmd.<user>.<command>       an operator's command to the engine (request/reply;
                                      only <user> may publish there)
    _INBOX.<role>.>                   a role's replies and deliveries (its own inbox)
    _INBOX.cli.<user>.>               one operator's replies and deliveries (their own)
    _INBOX.node.<node>.>              a node's agent's replies (its own inbox)

A node name becomes one subject token: anything but letters, digits, `_` and `-` turns
into `_`. Two names that differ only there (`gpu.a1` and `gpu_a1`) share a token, so an
inventory may not hold both (gpuops.inventory.hosts checks).
"""

from __future__ import annotations

import re

from gpuops.errors import EventError

PREFIX = "gpuops"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def token(name: str) -> str:
    """A node name (or kind) as one NATS subject token."""
    return _UNSAFE.sub("_", name)


# nats-server puts the connected user's JWT `name` here (a subject template): one
# permission list then limits each node's user to its own subjects. Every builder of a
# node's subject leaves it whole, for the server to fill.
USER_NAME = "{{name()}}"


def _node(node: str) -> str:
    return node if node == USER_NAME else token(node) or "unknown"


def telemetry(node: str) -> str:
    """Where a node's samples are published."""
    return f"{PREFIX}.telemetry.{_node(node)}"


def event(kind: str, node: str) -> str:
    """Where an event is published: telemetry and health events have their own streams."""
    if kind == "telemetry":
        return telemetry(node)
    return f"{PREFIX}.events.{token(kind) or 'unknown'}.{_node(node)}"


def action(node: str) -> str:
    """Where intents for a node go (the actions work queue)."""
    return f"{PREFIX}.actions.{_node(node)}"


def audit(node: str) -> str:
    """The audit subject of a node; records about no node go to `_fleet`."""
    return f"{PREFIX}.audit.{token(node) if node else '_fleet'}"


def dlq(reason: str) -> str:
    """Where dead letters with this reason go."""
    return f"{PREFIX}.dlq.{token(reason) or 'unknown'}"


def probe_request(node: str) -> str:
    """Where a node's agent listens for a probe request."""
    return f"{PREFIX}.agent.{_node(node)}.probe"


def command(user: str, name: str) -> str:
    """Where an operator's command goes; the server lets only `user` publish there."""
    return f"{PREFIX}.cmd.{token(user) or 'unknown'}.{token(name) or 'unknown'}"


COMMANDS = f"{PREFIX}.cmd.*.*"

# Filters and permission patterns of the shapes above (`*` is one token, `>` the rest):
# streams, consumers and NATS users are all written from these, never from text.
EVERYTHING = f"{PREFIX}.>"
TELEMETRY_PREFIX = f"{PREFIX}.telemetry."  # what every telemetry subject starts with
TELEMETRY = f"{PREFIX}.telemetry.*"  # as an agent publishes it: one node token
EVENTS = f"{PREFIX}.events.*.*"  # as published: kind and node
TELEMETRY_ALL = f"{PREFIX}.telemetry.>"  # as published or as stored (under a partition)
EVENTS_ALL = f"{PREFIX}.events.>"
ACTIONS = f"{PREFIX}.actions.>"
AUDIT = f"{PREFIX}.audit.>"
DLQ = f"{PREFIX}.dlq.>"
PROBE_REQUESTS = f"{PREFIX}.agent.*.probe"
AGENT_REQUESTS = f"{PREFIX}.agent.*.>"
ALL_COMMANDS = f"{PREFIX}.cmd.>"
# The dead letters `gpuops ingest prometheus` writes, as the agent's user, about a target
# it refused (gpuops.sources.binding): a forged node, a target that is no inventory host.
FORGED, UNKNOWN_TARGET = "forged", "unknown_target"
SOURCE_REFUSALS = (FORGED, UNKNOWN_TARGET)


def events_of(kind: str) -> str:
    """Every node's events of one kind, as published."""
    return f"{PREFIX}.events.{token(kind) or 'unknown'}.*"


def events_from(node: str) -> str:
    """A node's health events of every kind (`node` may be USER_NAME)."""
    return f"{PREFIX}.events.*.{_node(node)}"


def agent_requests_to(node: str) -> str:
    """Every request to one node's agent (`node` may be USER_NAME)."""
    return f"{PREFIX}.agent.{_node(node)}.>"


# Replies (JetStream acks and API answers, KV reads, probe answers) and pull deliveries
# come to the asker's inbox. Each user subscribes only under its own prefix: one that
# could subscribe `_INBOX.>` would read another's intents and, as the receiver of a
# delivery may answer it, ack or terminate them.
INBOX = "_INBOX"


def inbox_of(role: str) -> str:
    """The inbox prefix of a role's connections (`nats.connect(inbox_prefix=...)`)."""
    return f"{INBOX}.{token(role)}"


def operator_inbox(user: str) -> str:
    """The inbox prefix of one operator's connections: a command's answer or a read's
    deliveries are that person's, not every operator's."""
    return f"{inbox_of('cli')}.{token(user)}"


def node_inbox(node: str) -> str:
    """The inbox prefix of one node's agent (`node` may be USER_NAME)."""
    return f"{INBOX}.node.{_node(node)}"


# Every node's agent's inbox (the source user that agents share until each has its own).
NODE_INBOXES = f"{INBOX}.node.*"


def inbox_within(prefix: str) -> str:
    """Every inbox under a prefix: what its user may subscribe."""
    return f"{prefix}.>"


def commands_of(user: str) -> str:
    """Every command subject of one operator (the only ones that user may publish)."""
    return f"{PREFIX}.cmd.{token(user) or 'unknown'}.>"


def stored_telemetry_at(partition: str, node: str) -> str:
    """A sample's subject as the telemetry stream stores it (tokens, or transform parts)."""
    return f"{PREFIX}.telemetry.{partition}.{node}"


def stored_event_at(partition: str, kind: str, node: str) -> str:
    """An event's subject as the events stream stores it (tokens, or transform parts)."""
    return f"{PREFIX}.events.{partition}.{kind}.{node}"


def telemetry_partition(partition: int) -> str:
    """The filter of one partition's samples as the telemetry stream stores them."""
    return stored_telemetry_at(str(partition), "*")


def events_partition(partition: int) -> str:
    """The filter of one partition's events as the events stream stores them."""
    return stored_event_at(str(partition), "*", "*")


def is_action(subject: str) -> bool:
    """Whether `subject` is an intent's (the actions work queue)."""
    parts = subject.split(".")
    return len(parts) == 3 and parts[:2] == [PREFIX, "actions"]


def is_checked(subject: str) -> bool:
    """Whether the intake checks the publisher of `subject` (telemetry, health events)."""
    return subject.startswith(TELEMETRY_PREFIX) or is_event(subject)


def is_event(subject: str) -> bool:
    """Whether `subject` is a health event's, as published or as stored."""
    parts = subject.split(".")
    return len(parts) in (4, 5) and parts[:2] == [PREFIX, "events"]


def parse_command(subject: str) -> tuple[str, str]:
    """(user, command) of a command subject; EventError("subject_mismatch") otherwise."""
    parts = subject.split(".")
    if len(parts) == 4 and parts[:2] == [PREFIX, "cmd"] and parts[2] and parts[3]:
        return parts[2], parts[3]
    raise EventError("subject_mismatch", f"subject {subject!r} is not {PREFIX}.cmd.<user>.<name>")


def parse_event(subject: str) -> tuple[str, str]:
    """(kind, node token) of an intake subject; EventError("subject_mismatch") otherwise.

    Only the exact shapes count: a subject with an extra or missing token names no node,
    and a check that skipped such subjects would let one node speak for another. The
    streams store a message under its partition (`gpuops.telemetry.<p>.<node>`,
    `gpuops.events.<p>.<kind>.<node>`, see gpuops.bus.partitions): both shapes are read.
    """
    parts = subject.split(".")
    stored = {"telemetry": 4, "events": 5}.get(parts[1] if len(parts) > 1 else "")
    if len(parts) == stored and parts[2].isdigit():
        del parts[2]  # the partition the stream stored it under
    if len(parts) == 3 and parts[:2] == [PREFIX, "telemetry"] and parts[2]:
        return "telemetry", parts[2]
    if len(parts) == 4 and parts[:2] == [PREFIX, "events"] and parts[2] and parts[3]:
        return parts[2], parts[3]
    raise EventError(
        "subject_mismatch",
        f"subject {subject!r} is not {PREFIX}.telemetry.<node> or {PREFIX}.events.<kind>.<node>",
    )


def stored_telemetry(node: str) -> str:
    """The subject filter of a node's samples as the stream stores them (any partition)."""
    return stored_telemetry_at("*", _node(node))


def stored_events(kind: str, node: str) -> str:
    """The subject filter of a node's events of a kind as stored (`*` for any kind)."""
    kind = kind if kind == "*" else token(kind) or "unknown"
    return stored_event_at("*", kind, node if node == "*" else _node(node))
