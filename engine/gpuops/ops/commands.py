"""The commands people give, from ChatOps or the CLI, with their permissions.

Every command works through the bus and its KV buckets, so it acts the same from a
chat, from a terminal, or from another replica. Each command that is allowed and well
formed is also published as a `chatops` event, so rules can match commands too: that
event is how `drain` and `undrain` reach the engine, which decides them through its
built-in rules and every safety stage (node lock, fleet breaker) like any other action.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError
from pydantic import BaseModel, ValidationError

from gpuops import subjects
from gpuops.bus.conn import Bus
from gpuops.bus.identity import ENGINE_ONLY_KINDS
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.store import Store
from gpuops.clock import Clock, SystemClock, rfc3339
from gpuops.decide.breaker import BreakerState
from gpuops.decide.correlate import correlation_store
from gpuops.decide.silence import parse_target, silence_span
from gpuops.decide.stores import Stores
from gpuops.errors import BusError, ConfigError, EngineError, StateUnreadable
from gpuops.inventory.hosts import Inventory
from gpuops.match.durations import format_duration
from gpuops.models import new_event, subject_for
from gpuops.ops.cmdwire import (
    CommandError,
    CommandReply,
    CommandRequest,
    CommandUsageError,
    Refused,
)
from gpuops.ops.heartbeat import EngineState, Heartbeats, engine_state
from gpuops.ops.power import USAGE as POWER_USAGE
from gpuops.ops.power import do_power
from gpuops.ops.staterepair import USAGE as STATE_USAGE
from gpuops.ops.staterepair import do_state, owner
from gpuops.power.config import PowerSettings
from gpuops.record.approvals import ApprovalStatus
from gpuops.record.audit import read_audit
from gpuops.record.episodes import episode_line, node_reason, read_open
from gpuops.record.nodestate import NodeState
from gpuops.record.unreadable import SHOWN, ModelOf
from gpuops.scale.lag import render_replicas, replica_view
from gpuops.settings import ChatopsSettings, Platform

FORCE = "--force"
MAX_REASON = 500  # characters of a person's reason (the console's form says the same)
T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asked (a principal such as `slack:T0123/U0456`, `cli:alice`), and where.

    `name` is what the person is called on their platform, kept beside the principal for
    people reading the audit; it is never compared with a grant (anyone may rename
    themselves to it).
    """

    principal: str
    channel: str = ""
    name: str = ""

    @classmethod
    def of(cls, platform: Platform, user: str, channel: str = "") -> Caller:
        """A console or CLI caller: the login or NATS user is the principal's name."""
        return cls(f"{platform}:{user}", channel, user)

    @property
    def platform(self) -> str:
        """Where the principal comes from: slack, mattermost, console or cli."""
        return self.principal.partition(":")[0]

    @property
    def label(self) -> str:
        """The principal, with the display name beside it when that says more."""
        shown = self.name and not self.principal.endswith(f":{self.name}")
        return f"{self.principal} ({self.name})" if shown else self.principal


class Access(StrEnum):
    """Who may run a command when settings do not name its users or channels."""

    READ_ONLY = "read-only"  # anyone who passed verification
    GRANTED = "granted"  # chat: nobody until settings grant it: these change things
    # Nobody, the CLI included, until settings grant it: what the engine then does in the
    # caller's name (publishing recorded events, which are decided) is its own word.
    GRANTED_ONLY = "granted-only"


Handler = Callable[["Commands", list[str], Caller], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Command:
    """One entry of the command table."""

    name: str
    handler: Handler
    usage: str
    access: Access
    # Published as a `chatops` event for rules to match (not `publish`: its arguments are
    # whole events, and what it sends is on the bus already).
    announced: bool = True


def allowed(command: Command, caller: Caller, settings: ChatopsSettings) -> str | None:
    """None if the caller may run the command, else why not.

    One table for chat and CLI. A CLI caller is a NATS user with credentials of its own,
    which a site hands out to operators only, so a command the table does not list is
    open to it; a listed command needs the principal in `users` (`channels` are chat's).
    A chat user is whoever can type in a channel: there, what changes things is closed
    until listed.
    """
    grant = settings.permissions.get(command.name)
    cli = caller.platform == "cli"
    if grant is None:
        if command.access is Access.READ_ONLY or (cli and command.access is Access.GRANTED):
            return None
        return f"'{command.name}' is not granted to anyone in settings"
    if grant.users and caller.principal not in grant.users:
        return f"{caller.label} may not run '{command.name}'"
    if grant.channels and not cli and caller.channel not in grant.channels:
        return f"'{command.name}' may not be run in channel {caller.channel!r}"
    return None


class Commands:
    """Carries out commands against the bus."""

    def __init__(
        self,
        bus: Bus,
        clock: Clock,
        inventory: Inventory | None,
        settings: ChatopsSettings,
        stores: Stores,
        drift_check: Callable[[str], Awaitable[str]] | None = None,
        power: PowerSettings | None = None,
        density: Callable[[float], str] | None = None,
        model_of: ModelOf | None = None,
        wall: Clock | None = None,
    ) -> None:
        """`inventory` None: the CLI's read-only use (status), which needs no inventory file.
        `wall`: the wall clock heartbeats are aged by (`clock` may run scaled, as the demo's)."""
        self.bus, self.clock, self.inventory, self.settings = bus, clock, inventory, settings
        self.power = power or PowerSettings()
        # The engine's own stores when it serves the commands; the CLI's over the same buckets.
        self.stores = stores
        self.control = stores.buckets.control
        self.auditor, self.approvals = stores.auditor, stores.approvals
        self.silences, self.breaker = stores.silences, stores.breaker
        self.states, self.episodes = stores.states, stores.episodes
        self.heartbeats = Heartbeats(self.control)
        self.drift_check = drift_check
        self.density = density
        self.model_of = model_of  # the engine's: which record each stored key holds
        self.wall = wall or SystemClock()

    @classmethod
    def over_bus(
        cls, bus: Bus, clock: Clock, inventory: Inventory | None, settings: ChatopsSettings
    ) -> Commands:
        """The commands of a process that runs no engine (the CLI): stores over the bus's
        buckets, as the engine's are; what only the engine can do says so."""
        return cls(
            bus, clock, inventory, settings, Stores.over(bus.buckets, JetStreamPublisher(bus.js))
        )

    def _known(self, node: str) -> bool:
        return self.inventory is not None and node in self.inventory

    async def run(self, text: str, caller: Caller, request_id: str | None = None) -> str:
        """Parse and carry out one command line; the reply for the person (errors too).

        `request_id`, derived from the chat request, becomes the chatops event's id: a
        replayed request that got past the HTTP layer is then stored once by JetStream.
        """
        try:
            return await self.execute(text, caller, request_id)
        except CommandError as exc:
            return str(exc)

    async def execute(self, text: str, caller: Caller, request_id: str | None = None) -> str:
        """Carry out one command line; the reply, or a CommandError saying why not
        (CommandUsageError when badly formed, Refused when not allowed)."""
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise CommandUsageError(f"cannot parse {text!r}: {exc}") from exc
        command = COMMANDS.get(words[0]) if words else None
        if command is None:
            raise CommandUsageError(help_text())
        args = words[1:]
        refused = allowed(command, caller, self.settings)
        if refused is not None:
            await self._note(args, f"refused {command.name} from {caller.label}: {refused}")
            raise Refused(f"refused: {refused}")
        try:
            reply = await command.handler(self, args, caller)
        except CommandUsageError as exc:
            raise CommandUsageError(f"{command.name}: {exc} (usage: {command.usage})") from exc
        except EngineError as exc:
            raise CommandError(f"{command.name}: {exc}") from exc
        # Published only once allowed and well formed: the engine acts on some of these.
        if command.announced:
            await self._publish(command.name, [a for a in args if a != FORCE], caller, request_id)
        first = reply.splitlines()[0] if reply else ""
        await self._note(args, f"{caller.label}: {_shown(text)} -> {first}")
        return reply

    async def answer(self, subject: str, payload: bytes) -> bytes:
        """The engine's answer to an operator's command request (see `ask_engine`).

        Who asked is the user in the subject, which the server lets no one else publish
        to; the payload carries only the arguments.
        """
        try:
            user, name = subjects.parse_command(subject)
            args = CommandRequest.model_validate_json(payload).args
        except (EngineError, ValidationError) as exc:
            return CommandReply(ok=False, kind="usage", text=f"bad command request: {exc}").dump()
        caller = Caller.of("cli", user)
        try:
            text = await self.execute(shlex.join([name, *args]), caller)
        except CommandError as exc:
            return CommandReply.refusing(exc).dump()
        return CommandReply(ok=True, kind="done", text=text).dump()

    async def _note(self, args: list[str], summary: str) -> None:
        node = args[0] if args and self._known(args[0]) else ""
        await self.auditor.note(self.clock.now(), node, summary)

    async def _publish(
        self, command: str, args: list[str], caller: Caller, request_id: str | None
    ) -> None:
        node = args[0] if args and self._known(args[0]) else "fleet"
        data = {
            "command": command,
            "args": args,
            "reason": " ".join(args[1:]),
            "user": caller.principal,
            "name": caller.name,
            "channel": caller.channel,
            "platform": caller.platform,
        }
        event = new_event("chatops", node, self.clock.now(), data, f"chatops:{caller.platform}")
        if request_id:
            event["id"] = request_id
        # Through the stores' publisher: the engine's, which signs it as the engine's own.
        await self.stores.auditor.publisher.publish(
            subject_for("chatops", node), json.dumps(event).encode(), event["id"]
        )

    def _node(self, args: list[str], n: int = 1) -> str:
        if len(args) < n:
            raise CommandUsageError("missing arguments")
        if not self._known(args[0]):
            raise CommandError(f"{args[0]!r} is not in the inventory")
        return args[0]

    # --- the commands: handlers of the table below -----------------------------------

    async def do_help(self, args: list[str], caller: Caller) -> str:
        return help_text()

    async def do_status(self, args: list[str], caller: Caller) -> str:
        return render_status(await self.status())

    async def status(self) -> dict[str, Any]:
        """The fleet: counts per state, nodes not healthy, breaker, approvals, silences,
        whether an engine is running (its heartbeat), and the stored records that do not
        decode (what this read met, and what the engine says it met)."""
        now = self.clock.now()
        engine = await self.engine(now)
        unreadable: list[StateUnreadable] = []
        states = await self._readable(self.states.store, unreadable)
        records = {r.node: r for r in states if self.inventory is None or r.node in self.inventory}
        counts = dict.fromkeys((s.value for s in NodeState), 0)
        for record in records.values():
            counts[record.state.value] += 1
        # Nodes never recorded are healthy; without an inventory file the engine's own
        # host count (its heartbeat) says how many there are.
        hosts = len(self.inventory.hosts) if self.inventory is not None else None
        if hosts is None and engine.beat is not None:
            hosts = engine.beat.hosts
        counts[NodeState.HEALTHY.value] += max((hosts or 0) - len(records), 0)
        episodes = await read_open(self.episodes)
        unhealthy = sorted(
            (
                {**r.model_dump(mode="json"), "reason": node_reason(r, episodes)}
                for r in records.values()
                if r.state is not NodeState.HEALTHY
            ),
            key=lambda r: r["since"],
        )
        approvals = [
            r.model_dump(mode="json", exclude={"match"})
            for r in await self._readable(self.approvals.store, unreadable)
            if r.status is ApprovalStatus.PENDING and r.expires > now
        ]
        silences = [
            s.model_dump()
            for s in await self._readable(self.silences.store, unreadable)
            if s.ends > now
        ]
        await self._readable(self.episodes, unreadable)  # named below; read_open skips them
        dry_run, dry_run_why = await self._dry_run(engine)
        return {
            "at": now,
            "engine": {
                "running": engine.running,
                "line": engine.line,
                "heartbeat": engine.beat.model_dump() if engine.beat else None,
            },
            "counts": counts,
            "unhealthy": unhealthy,
            "breaker": await self._breaker(),
            "approvals": approvals,
            "silences": silences,
            "episodes": [
                {**ep.model_dump(mode="json"), "id": ep.id, "line": episode_line(ep, now)}
                for ep in episodes
            ],
            "dry_run": dry_run,
            "dry_run_why": dry_run_why,
            "domain_episodes": await self._domain_episodes(now),
            "unreadable": self._unreadable_lines(unreadable, engine),
            "scale": await self._replicas(),
        }

    async def _domain_episodes(self, now: float) -> list[dict[str, Any]]:
        """Open domain episodes (gpuops.decide.correlate): one row each, however many
        nodes they hold."""
        out = []
        found, _ = await correlation_store(self.stores.buckets.control).readable()
        for key, record in found:
            if record.opened is None or now >= record.until:
                continue
            _, rule, kind, name = key.split(".", 3)
            out.append(
                {
                    "rule": rule,
                    "kind": kind,
                    "name": name,
                    "nodes": list(record.nodes),
                    "faulting": sorted(record.seen),
                    "opened": record.opened,
                    "until": record.until,
                    "applied": record.applied,
                }
            )
        return sorted(out, key=lambda e: e["opened"])

    async def _dry_run(self, engine: EngineState) -> tuple[bool, str]:
        """Whether every decision is a dry run, and why: the engine was started so (this
        process's own settings, or the running engine's heartbeat), or a person's switch."""
        switch = self.stores.dry_run
        flipped = switch.flipped if await switch.read() else None
        started = switch.configured or bool(engine.running and engine.beat and engine.beat.dry_run)
        why = ["engine started with --dry-run (settings dry_run)"] if started else []
        if flipped is not None and flipped.on:
            by = flipped.by or "someone"
            why.append(by if by.startswith("unreadable") else f"switched on by {by}")
        return bool(why), "; ".join(why)

    async def _readable(self, store: Store[T], unreadable: list[StateUnreadable]) -> list[T]:
        """The records of `store` that decode; those that do not go to `unreadable`."""
        found, bad = await store.readable()
        unreadable += bad
        return [record for _, record in found]

    async def _breaker(self) -> dict[str, Any]:
        """The breaker as stored; one that does not decode shows as what it means: open."""
        breaker, unreadable = await self.breaker.shown(self.stores.unreadable)
        shown = breaker.model_dump(mode="json")
        return {**shown, "unreadable": True} if unreadable else shown

    def _unreadable_lines(self, met: list[StateUnreadable], engine: EngineState) -> list[str]:
        """What this read met, what this process met before, and the engine's, once each."""
        for exc in met:
            self.stores.unreadable.note(exc)
        lines = [u.line() for u in self.stores.unreadable.entries()]
        if engine.beat is not None:
            lines += engine.beat.unreadable
        return list(dict.fromkeys(lines))

    async def _replicas(self) -> dict[str, Any]:
        """The engine replicas and their partitions (empty when it cannot be read)."""
        try:
            return await replica_view(self.bus.js, self.stores.buckets.leases)
        except (KeyError, BusError, JsError, NatsError, TimeoutError) as exc:
            return {"error": str(exc) or type(exc).__name__}

    async def engine(self, now: float) -> EngineState:
        """Whether an engine runs, from the heartbeats."""
        return engine_state(await self.heartbeats.all(), now, self.wall.now())

    async def do_history(self, args: list[str], caller: Caller) -> str:
        node = self._node(args)
        records = [r async for r in read_audit(self.bus.js, node)][-10:]
        return (
            "\n".join(f"{rfc3339(r.at)[:19]} {r.type}: {r.summary}" for r in records)
            or f"nothing for {node}"
        )

    async def do_drain(self, args: list[str], caller: Caller) -> str:
        # The chatops event published after this is the request: the engine's built-in
        # rule turns it into a decision, so the lock and the breaker apply.
        node = self._node(args, 2)
        reason = " ".join(args[1:]).strip()
        if not reason:
            raise CommandUsageError("say why")
        return f"drain of {node} requested: {reason} (the engine decides; see `status`)"

    async def do_undrain(self, args: list[str], caller: Caller) -> str:
        node = self._node(args)
        reason = " ".join(args[1:]).strip()
        said = f": {reason}" if reason else ""
        return f"undrain of {node} requested{said} (the engine decides; see `status`)"

    async def do_approve(self, args: list[str], caller: Caller) -> str:
        if not args:
            raise CommandUsageError("which approval?")
        record = await self.approvals.decide(args[0], True, caller.principal, self.clock.now())
        return f"approved {args[0]}: {record.summary}"

    async def do_deny(self, args: list[str], caller: Caller) -> str:
        if not args:
            raise CommandUsageError("which approval?")
        record = await self.approvals.decide(args[0], False, caller.principal, self.clock.now())
        return f"denied {args[0]}: {record.summary}"

    async def do_silence(self, args: list[str], caller: Caller) -> str:
        force = FORCE in args
        try:
            target, starts, ends, reason = silence_span(
                [a for a in args if a != FORCE], self.clock.now()
            )
            parse_target(target)
        except (ValueError, ConfigError) as exc:
            raise CommandUsageError(str(exc)) from exc
        if ends - starts > self.settings.max_silence_s:
            longest = format_duration(self.settings.max_silence_s)
            raise CommandUsageError(f"a silence lasts at most {longest} (chatops.max_silence_s)")
        if len(reason) > MAX_REASON:
            raise CommandUsageError(f"a reason is at most {MAX_REASON} characters")
        if not force:
            self._check_target(target)
        s = await self.silences.add(target, starts, ends, reason, caller.principal)
        return f"silence {s.id}: {s.target} for {format_duration(ends - starts)} ({s.reason})"

    def _check_target(self, target: str) -> None:
        """A silence of a node or group the inventory lacks is most likely a typo, which
        would silence nothing while the person believes it quiet: refused unless forced
        (a node about to join the fleet)."""
        kind, _, name = target.partition(":")
        inventory = self.inventory
        if kind == "node" and not self._known(name):
            missing = f"node {name!r} is not in the inventory"
        elif kind == "group" and (inventory is None or not inventory.group_hosts(name)):
            missing = f"group {name!r} is not in the inventory"
        elif kind == "label" and not self._labelled(name):
            missing = f"no host of the inventory has {name}"
        else:
            return
        raise CommandError(f"{missing}: check the name, or add {FORCE} to silence it anyway")

    def _labelled(self, label: str) -> bool:
        key, _, want = label.partition("=")
        hostvars = self.inventory.hostvars.values() if self.inventory is not None else ()
        return any(key in hv and str(hv[key]) == want for hv in hostvars)

    async def do_unsilence(self, args: list[str], caller: Caller) -> str:
        if not args:
            raise CommandUsageError("which silence?")
        if not await self.silences.remove(args[0]):
            raise CommandError(f"no silence {args[0]!r}")
        return f"silence {args[0]} removed"

    async def do_breaker(self, args: list[str], caller: Caller) -> str:
        targets = {"reset": BreakerState.CLOSED, "half-open": BreakerState.HALF_OPEN}
        if not args or args[0] not in targets:
            raise CommandUsageError("reset or half-open?")
        await self.breaker.set_state(
            targets[args[0]], f"{args[0]} by {caller.principal}", self.clock.now(), caller.principal
        )
        return f"breaker {targets[args[0]].value.replace('_', '-')}"

    async def do_dry_run(self, args: list[str], caller: Caller) -> str:
        if not args or args[0] not in ("on", "off"):
            raise CommandUsageError("on or off?")
        await self.stores.dry_run.flip(args[0] == "on", caller.principal)
        return f"dry-run {args[0]}"

    async def do_drift_check(self, args: list[str], caller: Caller) -> str:
        if self.drift_check is None:
            raise CommandError(
                "drift checks run in the engine; ask it (ChatOps) or use `gpuops drift-check`"
            )
        return await self.drift_check(args[0] if args else "all")

    async def do_publish(self, args: list[str], caller: Caller) -> str:
        """Publish recorded events (one JSON line each) as the engine, in the caller's
        name: the engine signs them, so they are decided, and the audit says who sent
        them. A line that is not a valid event goes to its kind's subject all the same,
        where the intake dead-letters it and says why."""
        if not args:
            raise CommandUsageError("give one or more events, one JSON object each")
        routed = [(line.encode(), *recorded_subject(line.encode())) for line in args]
        for _data, subject, _id in routed:
            kind, _node = subjects.parse_event(subject)
            if kind in NOT_PUBLISHABLE:
                raise Refused(
                    f"{kind} events are not published in anyone's name: a command, a drift "
                    "check, an alert or a validation probe comes from its own sender"
                )
        for data, subject, msg_id in routed:
            await self.stores.auditor.publisher.publish(subject, data, msg_id)
        await self.auditor.note(
            self.clock.now(),
            "",
            f"{caller.principal} published {len(args)} recorded events",
            {"published_by": caller.principal, "events": len(args)},
        )
        return f"published {len(args)} events"

    async def do_power(self, args: list[str], caller: Caller) -> str:
        return await do_power(
            args, caller.principal, self.control, self.power, self.inventory, self.clock.now()
        )

    async def do_state(self, args: list[str], caller: Caller) -> str:
        if args[:1] == ["repair"] and len(args) > 3:  # a rewrite: the record's own grant too
            needs = owner(args[1], args[2])
            refused = allowed(COMMANDS[needs], caller, self.settings) if needs else None
            if refused is not None:
                raise CommandError(f"repairing {args[1]}/{args[2]} needs '{needs}': {refused}")
        return await do_state(args, self.stores.buckets, self.stores.unreadable, self.model_of)

    async def do_density(self, args: list[str], caller: Caller) -> str:
        if self.density is None:
            raise CommandError(
                "the engine keeps the utilisation: ask it (ChatOps) or `gpuops report density`"
            )
        return self.density(_percent(args[0]) if args else DENSITY_THRESHOLD)


DENSITY_THRESHOLD = 10.0  # percent p95 utilisation over a day, as rules/density.yml


# What the engine publishes as its own is decided like its own word: never a person's
# command, a drift report, an alert, or a probe (a node's answer to its validation).
NOT_PUBLISHABLE = ENGINE_ONLY_KINDS | {"probe"}


# A command line in an audit note: room for a whole reason and the words before it (a
# line longer than this was not typed by a person: it is cut, with a marker).
MAX_SHOWN = MAX_REASON + 300


def _shown(text: str, limit: int = MAX_SHOWN) -> str:
    """A command line as the audit note shows it: whole, or cut with a marker."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def recorded_subject(line: bytes) -> tuple[str, str | None]:
    """Where a recorded event goes (its kind's and node's subject) and its message id.
    The intake validates it there, and dead-letters a line that is not an event."""
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        raw = None
    if not isinstance(raw, dict):
        return subject_for("unknown", "unknown"), None
    msg_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    return subject_for(str(raw.get("kind", "unknown")), str(raw.get("node", "unknown"))), msg_id


def _percent(text: str) -> float:
    try:
        value = float(text.removesuffix("%"))
    except ValueError:
        raise CommandUsageError(f"{text!r} is not a percentage") from None
    if not 0 < value <= 100:
        raise CommandUsageError(f"{text!r}: a threshold is between 0 and 100%")
    return value


_R, _G = Access.READ_ONLY, Access.GRANTED
COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("status", Commands.do_status, "status", _R),
        Command("history", Commands.do_history, "history NODE", _R),
        Command("drain", Commands.do_drain, "drain NODE REASON", _G),
        Command("undrain", Commands.do_undrain, "undrain NODE [REASON]", _G),
        Command("approve", Commands.do_approve, "approve ID", _G),
        Command("deny", Commands.do_deny, "deny ID", _G),
        Command("silence", Commands.do_silence, "silence TARGET DURATION REASON", _G),
        Command("unsilence", Commands.do_unsilence, "unsilence ID", _G),
        Command("breaker", Commands.do_breaker, "breaker reset|half-open", _G),
        Command("drift-check", Commands.do_drift_check, "drift-check [GROUP]", _G),
        Command("dry-run", Commands.do_dry_run, "dry-run on|off", _G),
        Command("power", Commands.do_power, POWER_USAGE, _G),
        Command("density", Commands.do_density, "density [THRESHOLD%]", _R),
        Command("state", Commands.do_state, STATE_USAGE, _G, False),
        Command(
            "publish", Commands.do_publish, "publish EVENT-JSON...", Access.GRANTED_ONLY, False
        ),
        Command("help", Commands.do_help, "help", _R),
    )
}


def help_text() -> str:
    """Every command's usage, from the table."""
    return "commands: " + "; ".join(c.usage for c in COMMANDS.values())


def render_status(s: dict[str, Any]) -> str:
    """The status as lines of text for chat and terminal."""
    lines = [s["engine"]["line"]]
    lines.append("nodes: " + (", ".join(f"{k} {v}" for k, v in s["counts"].items() if v) or "-"))
    for r in s["unhealthy"]:
        lines.append(
            f"  {r['node']}: {r['state']} since {rfc3339(r['since'])[:19]} ({r.get('why', '')})"
        )
    b = s["breaker"]
    closed = b["state"] == BreakerState.CLOSED.value
    lines.append(f"breaker: {b['state']}" + ("" if closed else f" ({b.get('why')})"))
    for a in s["approvals"]:
        lines.append(f"approval {a['id']}: {a['summary']}")
    for x in s["silences"]:
        lines.append(
            f"silence {x['id']}: {x['target']} until {rfc3339(x['ends'])[:19]} ({x['reason']})"
        )
    for d in s.get("domain_episodes", []):
        lines.append(
            f"domain episode: {d['rule']} on {d['kind']} {d['name']} ({len(d['nodes'])} nodes: "
            f"{', '.join(d['nodes'])}), node remediations held until {rfc3339(d['until'])[:19]}"
        )
    episodes = s.get("episodes", [])
    lines.append(f"open episodes: {len(episodes)}")
    lines += [f"  {ep['line']}" for ep in episodes[:20]]
    lines.append(dry_run_line(s))
    for line in s.get("unreadable", [])[:SHOWN]:
        lines.append(f"unreadable state: {line}")
    scale = s.get("scale", {})
    if "error" in scale:
        lines.append(f"replicas: unknown ({scale['error']})")
    elif scale:
        lines += render_replicas(scale)
    return "\n".join(lines)


def dry_run_line(s: dict[str, Any]) -> str:
    """`dry-run: on (why)` or `dry-run: off`, from a status."""
    if not s["dry_run"]:
        return "dry-run: off"
    why = s.get("dry_run_why")
    return f"dry-run: on ({why})" if why else "dry-run: on"
