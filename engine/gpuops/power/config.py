"""The `power:` section of the settings: budgets per inventory group, their peak windows,
the guaranteed floors, and the controller's tuning.

```yaml
power:
  budgets:
    - group: rack-a1          # an inventory group, or `all` for the fleet
      watts: 40kW             # the budget outside any window (omit: none)
      windows:                # lower budgets at set times (cron start, duration, zone)
        - {name: peak, cron: "0 17 * * mon-fri", duration: 4h, timezone: Europe/Berlin,
           watts: 32kW}
  floors: {guaranteed: 650W}  # host var power_class -> never below this
```
"""

from __future__ import annotations

from typing import Annotated

from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gpuops.clock import cron_trigger
from gpuops.match.durations import parse_duration
from gpuops.power.units import watts_value

Watts = Annotated[float, BeforeValidator(watts_value)]
Seconds = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]


class PowerWindow(BaseModel):
    """A lower budget for `duration` from each start of `cron` (in `timezone`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "peak"
    cron: str
    duration: Seconds
    timezone: str = "UTC"
    watts: Watts

    @model_validator(mode="after")
    def _cron_parses(self) -> PowerWindow:
        trigger(self)
        return self


def trigger(window: PowerWindow) -> CronTrigger:
    """The window's start times; ValueError names a bad expression or zone."""
    return cron_trigger(window.cron, window.timezone, f"power window {window.name}")


class PowerBudget(BaseModel):
    """One inventory group's budget: a base value and/or windows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group: str = Field(min_length=1)
    watts: Watts | None = None
    windows: tuple[PowerWindow, ...] = ()


class PowerSettings(BaseModel):
    """Budgets and how the controller keeps them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budgets: tuple[PowerBudget, ...] = ()
    # How often the controller looks (it also looks at once when a budget changes).
    interval_s: float = Field(default=30.0, gt=0, le=3600)
    # power_class (a host variable) -> the floor of that class's GPUs; a host variable
    # power_floor_w sets one node's floor directly and wins.
    floors: dict[str, Watts] = Field(default_factory=lambda: {"guaranteed": 650.0})
    class_var: str = "power_class"
    # Limits rise at most this much per interval, not again within dwell_s of a change,
    # and not at all for less than hysteresis_w: limits settle instead of oscillating.
    # Cuts that keep a budget are never delayed.
    step_w: float = Field(default=100.0, gt=0)
    dwell_s: float = Field(default=300.0, ge=0)
    hysteresis_w: float = Field(default=50.0, ge=0)
    # A GPU below this utilisation and not at its cap is idle: it goes to its minimum.
    idle_util: float = Field(default=5.0, ge=0, le=100)
    # A GPU not at its cap keeps its draw plus this, no more.
    headroom_w: float = Field(default=30.0, ge=0)
    # Telemetry older than this is not trusted: the GPU is left as it is and counted at
    # its last known limit.
    stale_s: float = Field(default=120.0, gt=0)
    # A change the controller sent counts as done for this long before telemetry shows it
    # (and a node is not let go meanwhile): a run lasts at most run_timeout_s (900 s).
    pending_s: float = Field(default=900.0, gt=0)
    # Overrides from the CLI or ChatOps last at most this long.
    max_override_s: float = Field(default=7 * 86400.0, gt=0)
    # Rules that restore or report power limits: they leave budgeted GPUs to the
    # controller (rules running power_limit.yml always do).
    yield_rules: tuple[str, ...] = ("power-limit-below-policy", "power-capped-below-policy")
