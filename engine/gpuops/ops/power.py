"""The `power` command (ChatOps and CLI): start or end a group's budget override, and
show the budgets and what the controller set.

    power budget rack-a1 32kW 2h [REASON]   a demand-response budget for two hours
    power budget rack-a1 --end              end it now
    power status                            budgets now, overrides, nodes the controller holds
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuops.bus.store import KV
from gpuops.clock import rfc3339
from gpuops.inventory.domains import Domains
from gpuops.match.durations import format_duration, parse_duration
from gpuops.ops.cmdwire import CommandError, CommandUsageError
from gpuops.power.budgets import FLEET, BudgetOverride, Overrides, budget_now, group_name
from gpuops.power.config import PowerSettings
from gpuops.power.engine import allocations
from gpuops.power.units import format_watts, parse_watts

if TYPE_CHECKING:
    from gpuops.inventory.hosts import Inventory

USAGE = "power budget GROUP WATTS DURATION [REASON] | power budget GROUP --end | power status"
END = "--end"


async def do_power(
    args: list[str],
    user: str,
    control: KV,
    settings: PowerSettings,
    inventory: Inventory | None,
    now: float,
) -> str:
    """The command table's `power`, for `user` (the command table checked the grant)."""
    if args[:1] == ["status"]:
        return await power_status(control, settings, now)
    if args[:1] != ["budget"] or len(args) < 3:
        raise CommandUsageError("budget GROUP WATTS DURATION, budget GROUP --end, or status")
    group = group_name(args[1])
    if inventory is None:
        raise CommandError("budgets are set through the engine (it knows the inventory)")
    if group != FLEET and not (
        inventory.group_hosts(group) or Domains.of(inventory).as_groups().get(group)
    ):
        raise CommandError(f"group {args[1]!r} is not in the inventory (nor a failure domain)")
    overrides = Overrides(control)
    if args[2] == END:
        ended = await overrides.end(group)
        if ended is None:
            raise CommandError(f"no budget override on {group}")
        return f"power budget {group}: override of {format_watts(ended.watts)} ended"
    override = _override(group, args[2:], user, now, settings)
    await overrides.set(override)
    said = f": {override.reason}" if override.reason else ""
    return (
        f"power budget {group}: {format_watts(override.watts)} for "
        f"{format_duration(override.ends - override.starts)} until "
        f"{rfc3339(override.ends)[:19]} by {override.by}{said}"
    )


def _override(
    group: str, args: list[str], user: str, now: float, settings: PowerSettings
) -> BudgetOverride:
    if len(args) < 2:
        raise CommandUsageError("say how many watts and for how long (32kW 2h)")
    try:
        watts = parse_watts(args[0])
        seconds = parse_duration(args[1])
    except ValueError as exc:
        raise CommandUsageError(str(exc)) from exc
    if not 0 < seconds <= settings.max_override_s:
        longest = format_duration(settings.max_override_s)
        raise CommandUsageError(f"duration must be more than 0 and at most {longest}")
    reason = " ".join(args[2:]).strip()
    return BudgetOverride(
        group=group, watts=watts, starts=now, ends=now + seconds, by=user, reason=reason
    )


async def power_status(control: KV, settings: PowerSettings, now: float) -> str:
    """Budgets (configured, and overrides), and the nodes whose limits the controller holds."""
    overrides = await Overrides(control).all()
    configured = {group_name(b.group): b for b in settings.budgets}
    lines = []
    for group in sorted({*configured, *overrides}):
        held = budget_now(configured.get(group), overrides.get(group), now)
        said = f"{format_watts(held[0])} ({held[1]})" if held else "none now"
        lines.append(f"budget {group}: {said}")
    records = sorted((r for _, r in await allocations(control).all()), key=lambda r: r.node)
    for r in records:
        limits = ", ".join(f"{i}:{w:g}" for i, w in sorted(r.limits.items(), key=_index))
        lines.append(f"  {r.node} ({', '.join(r.groups) or 'to policy'}): {limits} W")
    return "\n".join(lines) or "no power budgets"


def _index(item: tuple[str, float]) -> int:
    return int(item[0]) if item[0].isdigit() else -1
