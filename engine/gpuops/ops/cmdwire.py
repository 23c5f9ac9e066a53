"""An operator's command on the wire: the request the CLI sends on its own subject
(`gpuops.cmd.<user>.<command>`), the engine's reply, and the errors both sides raise.

The server lets only `<user>` publish on that subject, so the engine knows who asks
without trusting anything the client says about itself.
"""

from __future__ import annotations

from typing import Literal

from nats.errors import NoRespondersError
from pydantic import BaseModel, ConfigDict

from gpuops import subjects
from gpuops.bus.conn import Bus
from gpuops.errors import BusError, EngineError


class CommandError(EngineError):
    """A command that cannot be carried out; the message goes back to the person."""


class CommandUsageError(CommandError):
    """A command that is not well formed (missing or bad arguments): the usage says how."""


class Refused(CommandError):
    """A command this caller may not run (the permission table says so)."""


ReplyKind = Literal["done", "usage", "refused", "failed"]


class CommandRequest(BaseModel):
    """What an operator's command request carries: the arguments (the user and the
    command are in the subject)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    args: list[str]


class CommandReply(BaseModel):
    """The engine's answer: done, or why not (usage, refused, failed) in one text."""

    model_config = ConfigDict(frozen=True)

    ok: bool
    kind: ReplyKind
    text: str

    @classmethod
    def refusing(cls, exc: CommandError) -> CommandReply:
        """The reply for a command that was not carried out, of the error's kind."""
        kind: ReplyKind = "failed"
        if isinstance(exc, CommandUsageError):
            kind = "usage"
        elif isinstance(exc, Refused):
            kind = "refused"
        return cls(ok=False, kind=kind, text=str(exc))

    def dump(self) -> bytes:
        """The reply as sent."""
        return self.model_dump_json().encode()


async def ask_engine(bus: Bus, name: str, args: list[str], timeout_s: float = 30.0) -> str:
    """Send one command to the running engine as this connection's NATS user; its reply.

    CommandUsageError, Refused or CommandError when the engine says no; BusError when no
    engine answers.
    """
    user = bus.user or "anonymous"
    subject = subjects.command(user, name)
    payload = CommandRequest(args=args).model_dump_json().encode()
    try:
        msg = await bus.nc.request(subject, payload, timeout=timeout_s)
    except NoRespondersError as exc:
        raise BusError(
            f"no engine answers commands on NATS at {bus.url}: start `gpuops run` "
            "(role all or engine), then try again"
        ) from exc
    except TimeoutError as exc:
        raise BusError(
            f"no answer from the engine within {timeout_s:g} s on {subject}: is it running, "
            f"and may NATS user {user!r} publish to gpuops.cmd.{user}.>?"
        ) from exc
    reply = CommandReply.model_validate_json(msg.data)
    if reply.ok:
        return reply.text
    error = {"usage": CommandUsageError, "refused": Refused}.get(reply.kind, CommandError)
    raise error(reply.text)
