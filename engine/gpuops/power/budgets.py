"""Which budget holds for a group now: an override (CLI, ChatOps), else the lowest of
its windows that are open, else its base value, else none.

Windows are cron starts with a duration, read with APScheduler's CronTrigger like the
drift schedules (`latest_slot` in gpuops/clock.py). Overrides are typed records in KV, so
every replica and the CLI see the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from gpuops.bus.store import KV, Store
from gpuops.clock import latest_slot, rfc3339
from gpuops.power.config import PowerBudget, PowerSettings, PowerWindow, trigger
from gpuops.power.units import format_watts

FLEET = "all"  # `fleet` is accepted for it


def group_name(name: str) -> str:
    """The inventory group a person means (`fleet` is every host)."""
    return FLEET if name == "fleet" else name


class BudgetOverride(BaseModel):
    """A budget a person set for a while (a demand-response event), kept in KV."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group: str
    watts: float = Field(gt=0)
    starts: float
    ends: float
    by: str
    reason: str = ""

    def active(self, now: float) -> bool:
        """Whether it holds at `now`."""
        return self.starts <= now < self.ends


class Overrides:
    """Overrides in the control bucket, one per group."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[BudgetOverride] = Store(kv, BudgetOverride, "power.override")

    async def set(self, override: BudgetOverride) -> None:
        """Start (or replace) a group's override."""
        await self.store.put(override, override.group)

    async def end(self, group: str) -> BudgetOverride | None:
        """End a group's override now; the one it was, if any."""
        current, _ = await self.store.get(group)
        await self.store.delete(group)
        return current

    async def all(self) -> dict[str, BudgetOverride]:
        """Every stored override by group (ended ones too, until removed)."""
        return {o.group: o for _, o in await self.store.all()}


@dataclass(frozen=True, slots=True)
class GroupBudget:
    """The budget that holds for a group now, and where it comes from."""

    group: str
    watts: float
    source: str
    nodes: frozenset[str]

    def line(self) -> str:
        """One line for people."""
        return f"{self.group}: {format_watts(self.watts)} ({self.source})"


def window_end(window: PowerWindow, now: float) -> float | None:
    """When the window open at `now` closes; None when it is not open."""
    start = latest_slot(trigger(window), now, window.duration)
    if start is None or now >= start + window.duration:
        return None
    return start + window.duration


def budget_now(
    budget: PowerBudget | None, override: BudgetOverride | None, now: float
) -> tuple[float, str] | None:
    """(watts, why) for one group at `now`, or None when no budget holds."""
    if override is not None and override.active(now):
        return override.watts, f"override by {override.by} until {rfc3339(override.ends)[:19]}"
    if budget is None:
        return None
    open_windows = [
        (w.watts, f"window {w.name} until {rfc3339(end)[:19]}")
        for w in budget.windows
        if (end := window_end(w, now)) is not None
    ]
    if open_windows:
        return min(open_windows)
    if budget.watts is not None:
        return budget.watts, "base"
    return None


def budgets_now(
    settings: PowerSettings,
    overrides: dict[str, BudgetOverride],
    hosts_of: dict[str, frozenset[str]],
    now: float,
) -> list[GroupBudget]:
    """Every group's budget at `now` (`hosts_of`: the inventory's groups, with `all`)."""
    configured = {group_name(b.group): b for b in settings.budgets}
    out = []
    for group in sorted({*configured, *overrides}):
        held = budget_now(configured.get(group), overrides.get(group), now)
        nodes = hosts_of.get(group, frozenset())
        if held is not None and nodes:
            out.append(GroupBudget(group, held[0], held[1], nodes))
    return out
