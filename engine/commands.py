"""The commands people give, from ChatOps or the CLI, with their permissions.

Every command works through the bus and its KV buckets, so it acts the same from a
chat, from a terminal, or from another replica. Each one is also published as a
`chatops` event, so rules can match commands too.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from engine.bus.conn import Bus
from engine.bus.publish import JetStreamPublisher
from engine.bus.store import NatsKV, Store
from engine.clock import Clock, rfc3339
from engine.decide.approval import ApprovalStatus, ApprovalStore
from engine.decide.breaker import BreakerState, BreakerStore
from engine.decide.silence import SilenceStore
from engine.errors import EngineError
from engine.inventory import Inventory
from engine.match.durations import format_duration, parse_duration
from engine.models import new_event, subject_for
from engine.record.audit import Auditor, read_audit
from engine.record.nodestate import NodeState, NodeStates
from engine.settings import ChatopsSettings

# Commands that only read may be used by anyone who passed verification; the others
# must be granted to users or channels in settings.
READ_ONLY = frozenset({"status", "history", "help"})
USAGE = {
    "status": "status",
    "history": "history NODE",
    "drain": "drain NODE REASON",
    "undrain": "undrain NODE",
    "approve": "approve ID",
    "deny": "deny ID",
    "silence": "silence TARGET DURATION REASON",
    "unsilence": "unsilence ID",
    "breaker": "breaker reset|half-open",
    "drift-check": "drift-check [GROUP]",
    "dry-run": "dry-run on|off",
    "help": "help",
}
DRY_RUN_KEY = "dry_run"


class Switch(BaseModel):
    """A runtime switch in the control bucket (dry-run)."""

    model_config = ConfigDict(frozen=True)

    on: bool
    by: str = ""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asked, and where."""

    user: str
    channel: str = ""
    platform: str = "cli"


class CommandError(EngineError):
    """A command that cannot be carried out; the message goes back to the person."""


def allowed(command: str, caller: Caller, settings: ChatopsSettings) -> str | None:
    """None if the caller may run the command, else why not."""
    if caller.platform == "cli":
        return None  # the shell's own access control stands in front of the CLI
    grant = settings.permissions.get(command)
    if grant is None:
        return None if command in READ_ONLY else f"'{command}' is not granted to anyone in settings"
    if grant.users and caller.user not in grant.users:
        return f"user {caller.user!r} may not run '{command}'"
    if grant.channels and caller.channel not in grant.channels:
        return f"'{command}' may not be run in channel {caller.channel!r}"
    return None


class Commands:
    """Carries out commands against the bus."""

    def __init__(
        self,
        bus: Bus,
        clock: Clock,
        inventory: Inventory,
        settings: ChatopsSettings,
        drift_check: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.bus, self.clock, self.inventory, self.settings = bus, clock, inventory, settings
        control = NatsKV(bus.kv["control"])
        self.auditor = Auditor(JetStreamPublisher(bus.js))
        self.approvals = ApprovalStore(control)
        self.silences = SilenceStore(control)
        self.breaker = BreakerStore(control)
        self.switches: Store[Switch] = Store(control, Switch, "switch")
        self.states = NodeStates(NatsKV(bus.kv["nodes"]))
        self.drift_check = drift_check

    async def run(self, text: str, caller: Caller) -> str:
        """Parse and carry out one command line; the reply for the person."""
        try:
            words = shlex.split(text)
        except ValueError as exc:
            return f"cannot parse {text!r}: {exc}"
        if not words or words[0] not in USAGE:
            return "commands: " + "; ".join(USAGE.values())
        command, args = words[0], words[1:]
        refused = allowed(command, caller, self.settings)
        if refused is not None:
            await self.auditor.note(
                self.clock.now(),
                "",
                f"refused {command} from {caller.user}@{caller.platform}: {refused}",
            )
            return f"refused: {refused}"
        try:
            reply = await getattr(self, "do_" + command.replace("-", "_"))(args, caller)
        except CommandError as exc:
            return f"{command}: {exc} (usage: {USAGE[command]})"
        except EngineError as exc:
            return f"{command}: {exc}"
        # Only a command that was allowed and valid becomes an event: rules act on it.
        await self._publish(command, args, caller)
        await self.auditor.note(
            self.clock.now(),
            args[0] if args and args[0] in self.inventory else "",
            f"{caller.user}@{caller.platform}: {text} -> {reply.splitlines()[0] if reply else ''}",
        )
        return str(reply)

    async def _publish(self, command: str, args: list[str], caller: Caller) -> None:
        node = args[0] if args and args[0] in self.inventory else "fleet"
        data = {
            "command": command,
            "args": args,
            "user": caller.user,
            "channel": caller.channel,
            "platform": caller.platform,
            "reason": " ".join(args[1:]),
        }
        event = new_event("chatops", node, self.clock.now(), data, f"chatops:{caller.platform}")
        await self.bus.js.publish(
            subject_for("chatops", node),
            json.dumps(event).encode(),
            headers={"Nats-Msg-Id": event["id"]},
        )

    def _node(self, args: list[str], n: int = 1) -> str:
        if len(args) < n:
            raise CommandError("missing arguments")
        if args[0] not in self.inventory:
            raise CommandError(f"{args[0]!r} is not in the inventory")
        return args[0]

    # --- the commands ---------------------------------------------------------------

    async def do_help(self, args: list[str], caller: Caller) -> str:
        return "commands: " + "; ".join(USAGE.values())

    async def do_status(self, args: list[str], caller: Caller) -> str:
        return render_status(await self.status())

    async def status(self) -> dict[str, Any]:
        """The fleet: counts per state, nodes not healthy, breaker, approvals, silences."""
        now = self.clock.now()
        records = {r.node: r for r in await self.states.all() if r.node in self.inventory}
        counts = dict.fromkeys((s.value for s in NodeState), 0)
        for node in self.inventory.hosts:
            record = records.get(node)
            counts[record.state.value if record else NodeState.HEALTHY.value] += 1
        unhealthy = sorted(
            (
                r.model_dump(mode="json")
                for r in records.values()
                if r.state is not NodeState.HEALTHY
            ),
            key=lambda r: r["since"],
        )
        breaker, _ = await self.breaker.get()
        approvals = [
            r.model_dump(mode="json", exclude={"match"})
            for r in await self.approvals.all()
            if r.status is ApprovalStatus.PENDING and r.expires > now
        ]
        silences = [s.model_dump() for s in await self.silences.all() if s.ends > now]
        dry, _ = await self.switches.get(DRY_RUN_KEY)
        return {
            "at": now,
            "counts": counts,
            "unhealthy": unhealthy,
            "breaker": breaker.model_dump(mode="json"),
            "approvals": approvals,
            "silences": silences,
            "dry_run": bool(dry and dry.on),
        }

    async def do_history(self, args: list[str], caller: Caller) -> str:
        node = self._node(args)
        records = [r async for r in read_audit(self.bus.js, node)][-10:]
        return (
            "\n".join(f"{rfc3339(r.at)[:19]} {r.type}: {r.summary}" for r in records)
            or f"nothing for {node}"
        )

    async def do_drain(self, args: list[str], caller: Caller) -> str:
        node = self._node(args, 2)
        # The chatops event published for this command is the request: the engine's
        # built-in rule decides it, through the node lock and the fleet breaker.
        return f"drain of {node} requested: {' '.join(args[1:])} (the engine decides; see status)"

    async def do_undrain(self, args: list[str], caller: Caller) -> str:
        node = self._node(args)
        return f"return of {node} to service requested (the engine decides; see status)"

    async def do_approve(self, args: list[str], caller: Caller) -> str:
        if not args:
            raise CommandError("which approval?")
        record = await self.approvals.decide(args[0], True, caller.user, self.clock.now())
        return f"approved {args[0]}: {record.summary}"

    async def do_deny(self, args: list[str], caller: Caller) -> str:
        if not args:
            raise CommandError("which approval?")
        record = await self.approvals.decide(args[0], False, caller.user, self.clock.now())
        return f"denied {args[0]}: {record.summary}"

    async def do_silence(self, args: list[str], caller: Caller) -> str:
        if len(args) < 3:
            raise CommandError("missing arguments")
        try:
            duration = parse_duration(args[1])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        now = self.clock.now()
        s = await self.silences.add(args[0], now, now + duration, " ".join(args[2:]), caller.user)
        return f"silence {s.id}: {s.target} for {format_duration(duration)} ({s.reason})"

    async def do_unsilence(self, args: list[str], caller: Caller) -> str:
        if not args:
            raise CommandError("which silence?")
        if not await self.silences.remove(args[0]):
            raise CommandError(f"no silence {args[0]!r}")
        return f"silence {args[0]} removed"

    async def do_breaker(self, args: list[str], caller: Caller) -> str:
        targets = {"reset": BreakerState.CLOSED, "half-open": BreakerState.HALF_OPEN}
        if not args or args[0] not in targets:
            raise CommandError("reset or half-open?")
        await self.breaker.set_state(
            targets[args[0]], f"{args[0]} by {caller.user}", self.clock.now(), caller.user
        )
        return f"breaker {targets[args[0]].value.replace('_', '-')}"

    async def do_dry_run(self, args: list[str], caller: Caller) -> str:
        if not args or args[0] not in ("on", "off"):
            raise CommandError("on or off?")
        await self.switches.put(Switch(on=args[0] == "on", by=caller.user), DRY_RUN_KEY)
        return f"dry-run {args[0]}"

    async def do_drift_check(self, args: list[str], caller: Caller) -> str:
        if self.drift_check is None:
            raise CommandError(
                "drift checks run in the engine; ask it (ChatOps) or use `gpuops drift-check`"
            )
        return await self.drift_check(args[0] if args else "all")


def render_status(s: dict[str, Any]) -> str:
    """The status as lines of text for chat and terminal."""
    lines = ["nodes: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items() if v)]
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
    lines.append(f"dry-run: {'on' if s['dry_run'] else 'off'}")
    return "\n".join(lines)
