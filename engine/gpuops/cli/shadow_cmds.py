"""`gpuops` commands that try rules on events through the live engine, acting on nothing:
test-rules (YAML cases) and replay (a recording).

Each takes the site's settings as `run` does (--config, GPUOPS_CONFIG, ./gpuops.yml),
so the breaker, cooldowns, attempt cap and stale and future cutoffs are the site's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from gpuops.cli.terminal import cells, out, run_async, settings_from
from gpuops.errors import EngineError, RuleError

if TYPE_CHECKING:
    from gpuops.match.rules import RuleSet
    from gpuops.settings import Settings
    from gpuops.spine.report import Report

_rules_option = click.option(
    "--rules", "rules_dir", type=click.Path(path_type=Path), help="default: rules/"
)


def _inventory(settings: Settings) -> Path | None:
    """The inventory `--inventory` or the settings name; None when neither does."""
    return settings.inventory if "inventory" in settings.model_fields_set else None


def _rules(settings: Settings, rules_dir: Path | None = None) -> RuleSet:
    """The rules (the settings' unless `rules_dir`), checked as `run` checks them."""
    from gpuops.inventory.hosts import load_inventory
    from gpuops.match.loader import load_rules

    books = settings.playbooks_dir
    try:
        where = _inventory(settings)
        inventory = load_inventory(where) if where is not None else None
        return load_rules(
            [rules_dir or settings.rules_dir], books if books.is_dir() else None, inventory
        )
    except EngineError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)


@click.command("test-rules")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path))
@_rules_option
@click.option(
    "--inventory",
    type=click.Path(path_type=Path),
    help="check rules that read the inventory against it (cases give hosts' variables)",
)
@click.pass_context
def test_rules(
    ctx: click.Context, paths: tuple[Path, ...], rules_dir: Path | None, inventory: Path | None
) -> None:
    """Run rule tests (YAML cases of events and expected actions; default: the site's
    tests/rules/, else the shipped ones); exit 1 on any failure."""
    from gpuops.shipped import locate
    from gpuops.spine.ruletest import load_cases, run_cases

    settings = settings_from(ctx, rules_dir=rules_dir, inventory=inventory)
    rules = _rules(settings)
    if not paths:
        click.echo(f"running {locate('tests/rules').describe()}")
    paths = paths or (locate("tests/rules").path,)
    files = [f for p in paths for f in (sorted(p.rglob("*.y*ml")) if p.is_dir() else [p])]
    failed = total = 0
    for file in files:
        try:
            results = asyncio.run(run_cases(str(file), load_cases(file), rules, settings))
        except RuleError as exc:
            click.echo(f"FAIL {exc}")
            failed += 1
            continue
        for result in results:
            total += 1
            click.echo(f"{'PASS' if result.passed else 'FAIL'} {file}: {result.name}")
            for failure in result.failures:
                click.echo(f"     {failure}")
            failed += 0 if result.passed else 1
    click.echo(f"{total - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


def _replayed(file: Path, rules: RuleSet, settings: Settings) -> Report:
    from gpuops.spine.replay import replay

    _, report = run_async(replay(file, rules, _inventory(settings), settings))
    return report


@click.command()
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@_rules_option
@click.option(
    "--inventory", type=click.Path(path_type=Path), help="only these hosts may be acted on"
)
@click.option(
    "--json", "as_json", is_flag=True, help="one JSON line per action, drop, trip, refusal"
)
@click.pass_context
def replay(
    ctx: click.Context,
    file: Path,
    rules_dir: Path | None,
    inventory: Path | None,
    as_json: bool,
) -> None:
    """Shadow mode: recorded events through the live engine's stages, acting on nothing."""
    settings = settings_from(ctx, rules_dir=rules_dir, inventory=inventory)
    _show_report(_replayed(file, _rules(settings), settings), as_json)


def _show_report(report: Report, as_json: bool) -> None:
    if as_json:
        for row in report.lines():
            click.echo(json.dumps(row, sort_keys=True))
    else:
        for table in _tables(report):
            out.print(table)
    s = report.summary()
    # One line, unwrapped: CI logs and scripts read it.
    click.echo(
        f"{s['events']} events, {s['unreadable']} unreadable, {s['future']} dated in the "
        f"future, {s['actions']} would-be actions, {s['escalations']} escalations, "
        f"{s['drops']} drops, {s['trips']} breaker trips, {s['unknown_nodes']} unknown nodes",
        err=True,
    )


def _tables(report: Report) -> list[Table]:
    """The report as tables, the empty ones left out."""
    from gpuops.clock import rfc3339

    actions = Table("ts", "rule", "node", "gpu", "would run", title="would run")
    for a in report.actions:
        would = a.action + (" (dry-run rule)" if a.dry_run else "")
        gpu = ",".join(map(str, a.gpus)) if a.gpus else ""
        actions.add_row(*cells(rfc3339(a.ts), a.rule, a.node, gpu, would))
    by_reason = Table("rule", "reason", "decisions", title="decisions by rule and reason")
    for (rule, reason), count in sorted(report.by_reason.items()):
        by_reason.add_row(*cells(rule, reason.value, count))
    folds = Table(
        "",
        "rule",
        "node",
        "reason",
        "times",
        "first",
        "last",
        "why",
        title="escalations and drops (identical ones folded)",
    )
    for f in report.drops(every=True):
        mark = "needs-human" if f.kind == "escalation" else "drop"
        folds.add_row(
            *cells(
                mark,
                f.rule,
                f.node,
                f.reason.value,
                f.count,
                rfc3339(f.first),
                rfc3339(f.last),
                f.detail,
            )
        )
    trips = Table("at", "why", title="breaker trips")
    for t in report.trips:
        trips.add_row(*cells(rfc3339(t.at), t.why))
    refused = Table("reason", "node", "lines", "first line", "error", title="refused at intake")
    for r in report.refused.values():
        refused.add_row(*cells(r.reason, r.node or "?", r.count, r.first_line, r.error))
    unknown = Table("node", "events", title="nodes not in the inventory (never acted upon)")
    for node, count in sorted(report.unknown.items()):
        unknown.add_row(*cells(node, count))
    tables = [actions, by_reason, folds, trips, refused, unknown]
    return [t for t in tables if t.row_count or t is actions]


COMMANDS = [test_rules, replay]
