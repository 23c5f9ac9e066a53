"""The `gpuops` command. Results go to stdout, logs to stderr, so `--json` output pipes."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.errors import EngineError, RuleError
from engine.settings import Settings, load_settings

T = TypeVar("T")
# Piped output is read in logs and CI: do not squeeze tables to 80 columns there.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except EngineError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", markup=True, highlight=False)
        sys.exit(2)


def _settings(ctx: click.Context, **flags: Any) -> Settings:
    base: dict[str, Any] = dict(ctx.obj or {})
    nats_url = flags.pop("nats", None)
    if nats_url:
        base["nats"] = {"url": nats_url}
    base.update({k: v for k, v in flags.items() if v is not None})
    try:
        return load_settings(base.pop("config", None), base)
    except EngineError as exc:
        err.print(f"error: {exc}", markup=False)
        sys.exit(2)


@click.group()
@click.option("--config", type=click.Path(path_type=Path), help="settings YAML (or GPUOPS_CONFIG)")
@click.option(
    "--state-dir", type=click.Path(path_type=Path), help="state dir (or GPUOPS_STATE_DIR)"
)
@click.option("-v", "--verbose", count=True, help="more logging on stderr")
@click.pass_context
def main(ctx: click.Context, config: Path | None, state_dir: Path | None, verbose: int) -> None:
    """gpuops: event-driven remediation for GPU clusters."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx.obj = {"config": config, "state_dir": state_dir}


@main.command()
@click.option("--nats", help="NATS URL; without one an embedded nats-server is started")
@click.option("--rules", "rules_dir", type=click.Path(path_type=Path), help="rules directory")
@click.option("--playbooks", "playbooks_dir", type=click.Path(path_type=Path))
@click.option("--inventory", type=click.Path(path_type=Path), help="Ansible inventory")
@click.option("--dry-run/--no-dry-run", default=None, help="decide and record, never execute")
@click.option("--role", type=click.Choice(["all", "engine", "executor"]), help="which loops to run")
@click.option("--http", help="host:port for ChatOps, /metrics and /healthz (e.g. 127.0.0.1:8080)")
@click.pass_context
def run(ctx: click.Context, /, **flags: Any) -> None:
    """Run the engine (intake, match, decide, intents) and the executor."""
    from engine.runtime import run_engine

    settings = _settings(ctx, **flags)
    logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
    _run(run_engine(settings))


@main.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--playbooks",
    "playbooks_dir",
    type=click.Path(path_type=Path),
    help="check playbooks exist here",
)
def validate(paths: tuple[Path, ...], playbooks_dir: Path | None) -> None:
    """Check rule files; print `file:line: rule NAME: message` per error, exit 1 on any."""
    from engine.match.loader import load_rules
    from engine.settings import checkout_root

    targets = list(paths) or [checkout_root() / "rules"]
    books = playbooks_dir or checkout_root() / "playbooks"
    try:
        rules = load_rules(targets, books if books.is_dir() else None)
    except RuleError as exc:
        for line in str(exc).splitlines():
            click.echo(line)
        sys.exit(1)
    click.echo(f"ok: {len(rules.rules)} rules in {len(rules.sources)} files")


@main.command()
@click.argument("file", type=click.File("rb"))
@click.option("--nats", help="NATS URL (default: the running engine's embedded server)")
@click.pass_context
def publish(ctx: click.Context, file: Any, nats: str | None) -> None:
    """Publish events from a JSON lines file (`-` for stdin) to their subjects."""
    from engine.runtime import publish_lines

    settings = _settings(ctx, nats=nats)
    sent, bad = _run(publish_lines(settings, file.read().splitlines()))
    click.echo(
        f"published {sent} events"
        + (f", {bad} lines were not JSON events (skipped)" if bad else "")
    )


@main.command()
@click.argument("node", required=False)
@click.option("--json", "as_json", is_flag=True, help="one JSON record per line")
@click.option("--nats", help="NATS URL (default: the running engine's or the state dir's store)")
@click.option("--limit", type=int, default=200, show_default=True, help="the newest N records")
@click.option("--drift", is_flag=True, help="only drift-check summaries")
@click.pass_context
def history(
    ctx: click.Context, node: str | None, as_json: bool, nats: str | None, limit: int, drift: bool
) -> None:
    """Print the audit trail: decisions, runs (with playbook revision), notes (for NODE, or all)."""
    from engine.clock import rfc3339
    from engine.record.audit import as_json_line
    from engine.runtime import audit_records

    records = _run(audit_records(_settings(ctx, nats=nats), node))
    if drift:
        records = [r for r in records if "drift_check" in r.body]
    records = records[-limit:]
    if as_json:
        for record in records:
            click.echo(as_json_line(record))
        return
    table = Table("time", "type", "node", "rule", "what", "playbook version")
    for r in records:
        version = ""
        if r.type == "run":
            rev, sha = r.body.get("revision") or "-", r.body.get("sha256") or "-"
            version = (
                f"{rev[:12]}{'+dirty' if str(rev).endswith('+dirty') else ''} sha256:{sha[:12]}"
            )
        table.add_row(rfc3339(r.at)[:19], r.type, r.node, r.rule, r.summary, version)
    out.print(table)


def _rules(rules_dir: Path | None) -> Any:
    from engine.match.loader import load_rules
    from engine.settings import checkout_root

    books = checkout_root() / "playbooks"
    try:
        return load_rules(
            [rules_dir or checkout_root() / "rules"], books if books.is_dir() else None
        )
    except RuleError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)


@main.command("test-rules")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--rules", "rules_dir", type=click.Path(path_type=Path), help="default: rules/")
def test_rules(paths: tuple[Path, ...], rules_dir: Path | None) -> None:
    """Run rule tests (YAML cases of events and expected actions); exit 1 on any failure."""
    from engine.ruletest import load_cases, run_cases

    rules = _rules(rules_dir)
    files = [f for p in paths for f in (sorted(p.rglob("*.y*ml")) if p.is_dir() else [p])]
    failed = total = 0
    for file in files:
        try:
            results = asyncio.run(run_cases(str(file), load_cases(file), rules))
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


@main.command()
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@click.option("--rules", "rules_dir", type=click.Path(path_type=Path), help="default: rules/")
@click.option(
    "--inventory", type=click.Path(path_type=Path), help="only these hosts may be acted on"
)
@click.option("--json", "as_json", is_flag=True, help="one JSON line per would-be action")
def replay(file: Path, rules_dir: Path | None, inventory: Path | None, as_json: bool) -> None:
    """Shadow mode: recorded events through matching and safety stages, acting on nothing."""
    from engine.replay import replay_file

    rules = _rules(rules_dir)
    actions, stats = _run(replay_file(file, rules, inventory))
    if as_json:
        for action in actions:
            click.echo(json.dumps(action.as_dict(), sort_keys=True))
    else:
        table = Table("ts", "rule", "node", "gpu", "would run")
        for a in actions:
            from engine.clock import rfc3339

            table.add_row(
                rfc3339(a.ts),
                a.rule,
                a.node,
                "" if a.gpu is None else str(a.gpu),
                a.action + (" (dry-run rule)" if a.dry_run else ""),
            )
        out.print(table)
    err.print(
        f"{stats['events']} events, {stats['bad']} unreadable, {len(actions)} would-be actions",
        highlight=False,
    )


@main.group()
def bench() -> None:
    """Benchmarks that print figures (never timed tests)."""


@bench.command("rules")
@click.option("--rules", "n_rules", type=int, default=50, show_default=True)
@click.option("--gpus", type=int, default=10_000, show_default=True)
@click.option("--seconds", type=float, default=20.0, show_default=True, help="wall seconds to run")
def bench_rules(n_rules: int, gpus: int, seconds: float) -> None:
    """Matcher throughput on samples built from the H200 recording."""
    from engine.bench import bench_rules as run_bench

    for line in run_bench(n_rules=n_rules, gpus=gpus, seconds=seconds):
        click.echo(line)


@main.command()
@click.argument("what", type=click.Choice(["events", "rules"]))
def schema(what: str) -> None:
    """Print the JSON Schema of events (format v1) or of rule files."""
    from engine.match.schema import RULES_FILE_SCHEMA
    from engine.models import event_json_schema

    doc = event_json_schema() if what == "events" else RULES_FILE_SCHEMA
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


@main.command()
@click.option("--nodes", type=int, default=16, show_default=True)
@click.option("--scenario", default="demo", show_default=True, help="shipped name or a .yml file")
@click.option(
    "--speed", type=float, default=10.0, show_default=True, help="simulated seconds per second"
)
@click.option("--json-summary", is_flag=True, help="print the summary as JSON")
@click.option(
    "--timeout", type=float, default=110.0, show_default=True, help="wall seconds at most"
)
@click.pass_context
def demo(
    ctx: click.Context, nodes: int, scenario: str, speed: float, json_summary: bool, timeout: float
) -> None:
    """Run the whole loop on a simulated fleet: faults, rules, playbooks, recovery."""
    from engine.demo import run_demo

    ok = _run(
        run_demo(
            nodes=nodes,
            speed=speed,
            json_summary=json_summary,
            timeout_s=timeout,
            state_dir=(ctx.obj or {}).get("state_dir"),
            console=out,
            scenario=scenario,
        )
    )
    sys.exit(0 if ok else 1)


# The fleet and operator commands live in their own module; importing it registers them.
from engine import cli_ops  # noqa: E402, F401

if __name__ == "__main__":
    from engine.cli import main as _main  # the imported module's group holds every command

    _main()
