"""`gpuops` commands that try rules on events through the live engine, acting on nothing:
test-rules (YAML cases), replay (a recording; `--against` old rules: the difference) and
diff-rules (two git revisions of the rules on a recording).

Each takes the site's settings as `run` does (--config, GPUOPS_CONFIG, ./gpuops.yml),
so the breaker, cooldowns, attempt cap and stale and future cutoffs are the site's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from gpuops.cli.terminal import cells, out, run_async, settings_from
from gpuops.errors import EngineError, RuleError

if TYPE_CHECKING:
    from gpuops.inventory.hosts import Inventory
    from gpuops.match.rules import RuleSet
    from gpuops.settings import Settings
    from gpuops.spine.report import Report
    from gpuops.spine.rulediff import RuleDiff

_rules_option = click.option(
    "--rules", "rules_dir", type=click.Path(path_type=Path), help="default: rules/"
)
_fail_on_option = click.option(
    "--fail-on",
    type=click.Choice(["new-actions", "any-change"]),  # gpuops.spine.rulediff.FailOn
    help="exit 1 when the new rules would run something the old would not or trip the "
    "breaker where they would not (new-actions), or when anything differs (any-change)",
)


def _inventory(settings: Settings) -> Path | None:
    """The inventory `--inventory` or the settings name; None when neither does."""
    return settings.inventory if "inventory" in settings.model_fields_set else None


def _rules(
    settings: Settings, rules_dir: Path | None = None, inventory: Inventory | None = None
) -> RuleSet:
    """The rules (the settings' unless `rules_dir`), checked as `run` checks them, against
    `inventory` (else the one the settings name, read here)."""
    from gpuops.match.loader import load_rules

    books = settings.playbooks_dir
    inventory = inventory or _fleet(settings)
    try:
        return load_rules(
            [rules_dir or settings.rules_dir], books if books.is_dir() else None, inventory
        )
    except EngineError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)


def _fleet(settings: Settings) -> Inventory | None:
    """The inventory the live engine would decide over (`--inventory` or the settings'),
    read once: the rules are checked against it, and test-rules' cases decided over it;
    None when neither names one."""
    from gpuops.inventory.hosts import load_inventory

    where = _inventory(settings)
    try:
        return load_inventory(where) if where is not None else None
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
    fleet = _fleet(settings)
    rules = _rules(settings, inventory=fleet)
    if not paths:
        click.echo(f"running {locate('tests/rules').describe()}")
    paths = paths or (locate("tests/rules").path,)
    files = [f for p in paths for f in (sorted(p.rglob("*.y*ml")) if p.is_dir() else [p])]
    failed = total = 0
    for file in files:
        try:
            results = asyncio.run(run_cases(str(file), load_cases(file), rules, settings, fleet))
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
    from gpuops.spine.heap import settle_heap
    from gpuops.spine.replay import replay

    settle_heap()  # the rules loaded, as `run` settles its heap: a tenth of replay's CPU
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
@click.option(
    "--against",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="old rules: print what the rules would do differently, node by node",
)
@_fail_on_option
@click.pass_context
def replay(
    ctx: click.Context,
    file: Path,
    rules_dir: Path | None,
    inventory: Path | None,
    as_json: bool,
    against: Path | None,
    fail_on: str | None,
) -> None:
    """Shadow mode: recorded events through the live engine's stages, acting on nothing."""
    settings = settings_from(ctx, rules_dir=rules_dir, inventory=inventory)
    if fail_on and against is None:
        raise click.UsageError("--fail-on compares rules: give the old ones with --against DIR")
    head = _replayed(file, _rules(settings), settings)
    if against is None:
        _show_report(head, as_json)
        return
    base = _replayed(file, _rules(settings, against), settings)
    _gate(_diffed(base, head, f"{settings.rules_dir} against {against}", as_json), fail_on)


@click.command("diff-rules")
@click.argument("revisions", metavar="BASE[..HEAD]")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@_rules_option
@click.option("--inventory", type=click.Path(path_type=Path), help="as for replay")
@click.option("--json", "as_json", is_flag=True, help="one JSON line per difference and trip")
@_fail_on_option
@click.pass_context
def diff_rules(
    ctx: click.Context,
    revisions: str,
    file: Path,
    rules_dir: Path | None,
    inventory: Path | None,
    as_json: bool,
    fail_on: str | None,
) -> None:
    """Replay FILE under the rules of two git revisions (HEAD left out: the rules as they
    are in the work tree) and print what the engine would do differently, node by node."""
    from gpuops.ops.revisions import rules_at

    settings = settings_from(ctx, rules_dir=rules_dir, inventory=inventory)
    old, _, new = revisions.partition("..")
    with tempfile.TemporaryDirectory(prefix="gpuops-rules-") as tmp:
        base_dir = rules_at(old, settings.rules_dir, Path(tmp) / "base")
        head_dir = rules_at(new, settings.rules_dir, Path(tmp) / "head") if new else None
        base = _replayed(file, _rules(settings, base_dir), settings)
        head = _replayed(file, _rules(settings, head_dir), settings)
    _gate(_diffed(base, head, f"rules at {new or 'the work tree'} against {old}", as_json), fail_on)


def _diffed(base: Report, head: Report, title: str, as_json: bool) -> RuleDiff:
    from gpuops.spine.rulediff import diff

    found = diff(base, head)
    if as_json:
        for d in found.differences:
            click.echo(json.dumps(d.as_dict(), sort_keys=True))
        for side, trips in (("base", found.base_trips), ("head", found.head_trips)):
            for t in trips:
                click.echo(json.dumps({**t.as_dict(), "side": side}, sort_keys=True))
    else:
        _show_diff(found, title)
    return found


def _gate(found: RuleDiff, fail_on: str | None) -> None:
    from gpuops.spine.rulediff import FailOn

    counts = found.counts()
    verdict = ""
    failed = fail_on is not None and found.fails(FailOn(fail_on))
    if fail_on:
        verdict = f"; --fail-on {fail_on}: {'FAIL' if failed else 'pass'}"
    click.echo(
        f"{counts['added']} added, {counts['removed']} removed, {counts['changed']} changed"
        + verdict,
        err=True,
    )
    if failed:
        sys.exit(1)


def _show_diff(found: RuleDiff, title: str) -> None:
    from gpuops.spine.rulediff import Change, describe

    click.echo(title)
    if not found.differences:
        click.echo("no difference in what the engine would do")
    node = None
    for d in found.differences:
        if d.node != node:
            node = d.node
            click.echo(node)
        if d.change is Change.CHANGED and d.base is not None and d.head is not None:
            click.echo(f"  ~ {describe(d.base)}  ->  {describe(d.head)}")
        elif d.head is not None:
            click.echo(f"  + {describe(d.head)}")
        elif d.base is not None:
            click.echo(f"  - {describe(d.base)}")
    for side, trips in (("old rules", found.base_trips), ("new rules", found.head_trips)):
        shown = "; ".join(f"{t.as_dict()['at']}: {t.why}" for t in trips) or "none"
        click.echo(f"breaker trips with the {side}: {shown}")


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
    unapplied = Table("command", "times", title="people's commands not carried out as live")
    for command, count in sorted(report.unapplied.items()):
        unapplied.add_row(*cells(command, count))
    tables = [actions, by_reason, folds, trips, refused, unknown, unapplied]
    return [t for t in tables if t.row_count or t is actions]


COMMANDS = [test_rules, replay, diff_rules]
