"""Watts as people type them, and which budget holds when (windows, overrides)."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from gpuops.errors import ConfigError
from gpuops.power.budgets import BudgetOverride, budget_now, budgets_now
from gpuops.power.config import PowerBudget, PowerSettings
from gpuops.power.units import format_watts, parse_watts
from gpuops.settings import load_settings


@pytest.mark.parametrize(
    ("text", "watts"), [("650W", 650.0), ("32kW", 32000.0), ("1.5MW", 1.5e6), (" 32.5kW ", 32500.0)]
)
def test_watts_with_their_unit(text: str, watts: float) -> None:
    assert parse_watts(text) == watts


@pytest.mark.parametrize("text", ["32", "32kw", "32 kW", "-5W", "0W", "1e3W", "32KW", "kW", "2GW"])
def test_anything_else_is_refused_saying_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"W, kW or MW|more than 0 W"):
        parse_watts(text)


def test_format() -> None:
    assert (format_watts(650), format_watts(32000), format_watts(2.5e6)) == (
        "650 W",
        "32.0 kW",
        "2.50 MW",
    )


def _at(text: str, zone: str = "Europe/Berlin") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).timestamp()


def test_a_window_lowers_the_budget_in_its_zone_and_an_override_wins() -> None:
    budget = PowerBudget.model_validate(
        {
            "group": "rack-a1",
            "watts": "40kW",
            "windows": [
                {
                    "cron": "0 17 * * mon-fri",
                    "duration": "4h",
                    "timezone": "Europe/Berlin",
                    "watts": "32kW",
                    "name": "peak",
                }
            ],
        }
    )
    assert budget_now(budget, None, _at("2026-01-05T16:59:00")) == (40000.0, "base")
    watts, why = budget_now(budget, None, _at("2026-01-05T18:00:00")) or (0, "")
    assert watts == 32000.0 and why.startswith("window peak until")
    assert budget_now(budget, None, _at("2026-01-05T21:00:00"))[0] == 40000.0  # type: ignore[index]
    assert budget_now(budget, None, _at("2026-01-10T18:00:00"))[0] == 40000.0  # type: ignore[index]
    now = _at("2026-01-05T18:00:00")
    dr = BudgetOverride(group="rack-a1", watts=25000, starts=now, ends=now + 7200, by="bob")
    assert budget_now(budget, dr, now + 60)[0] == 25000.0  # type: ignore[index]
    assert budget_now(budget, dr, now + 7200)[0] == 32000.0  # type: ignore[index]


def test_groups_without_hosts_or_budget_hold_none() -> None:
    settings = PowerSettings.model_validate(
        {"budgets": [{"group": "fleet", "watts": "1MW"}, {"group": "empty", "watts": 5000}]}
    )
    held = budgets_now(settings, {}, {"all": frozenset({"n1"}), "empty": frozenset()}, 0.0)
    assert [(b.group, b.watts, b.nodes) for b in held] == [("all", 1e6, frozenset({"n1"}))]


def test_bad_budget_settings_are_refused_with_the_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "gpuops.yml"
    path.write_text("power: {budgets: [{group: r1, watts: 32}, {group: r2, watts: 32kw}]}\n")
    with pytest.raises(ConfigError, match=r"power.budgets.1.watts.*W, kW or MW"):
        load_settings(path, environ={})
    path.write_text(
        "power: {budgets: [{group: r1, windows: [{cron: '0 99 * * *', "
        "duration: 1h, watts: 1kW}]}]}\n"
    )
    with pytest.raises(ConfigError, match=r"bad cron"):
        load_settings(path, environ={})
