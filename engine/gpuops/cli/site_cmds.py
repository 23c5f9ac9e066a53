"""`gpuops` commands about a site and its data: `init` a site repository, `export` events
from JetStream, and the group's `--version`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from gpuops.cli.terminal import err, run_async, settings_from, telemetry_format_option
from gpuops.errors import EngineError

if TYPE_CHECKING:
    from gpuops.ops.export import Exported, Selection
    from gpuops.settings import Settings


def version_lines() -> list[str]:
    """The installed version and the digests of the shipped and the site's playbooks."""
    from gpuops import shipped

    lines = [f"gpuops {shipped.version()}"]
    books = shipped.locate("playbooks")
    lines.append(f"shipped playbooks {shipped.tree_digest(shipped.shipped('playbooks'))}")
    if books.origin == "site":
        lines.append(f"site playbooks {shipped.tree_digest(books.path)} ({books.path})")
    return lines


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    for line in version_lines():
        click.echo(line)
    ctx.exit()


version_option = click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="print the version and the playbooks' digests, then exit",
)


@click.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="write into a non-empty directory")
@click.option("--ci", type=click.Choice(["github", "gitlab"]), default="github", show_default=True)
def init(directory: Path, force: bool, ci: str) -> None:
    """Create a site repository in DIRECTORY: rules, playbooks, inventory, rule tests,
    settings, CI, README."""
    from gpuops.ops.site import init_site

    try:
        made = init_site(directory, force=force, ci="gitlab" if ci == "gitlab" else "github")
    except EngineError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(f"site created in {made.root}: {', '.join(made.entries)}")
    click.echo(f"next: cd {made.root} && git init && gpuops validate && gpuops test-rules")


@click.command()
@click.option("--since", help="from this time: a duration before now (2h, 7d) or an ISO time")
@click.option("--until", help="up to this time: a duration before now or an ISO time")
@click.option("--node", "nodes", multiple=True, help="only this node (repeatable)")
@click.option(
    "--kind", "kinds", multiple=True, help="only this kind: telemetry, xid, ... (repeatable)"
)
@click.option("-o", "--output", type=click.File("wb"), default="-", help="file (default: stdout)")
@telemetry_format_option("the lines written")
@click.option("--nats", help="NATS URL (default: the running engine's embedded server)")
@click.pass_context
def export(
    ctx: click.Context,
    /,
    output: IO[bytes],
    telemetry_format: int,
    nats: str | None,
    **filters: Any,
) -> None:
    """Write events from JetStream as JSON lines, for `gpuops replay` and `gpuops publish`.

    Times are when the stream stored each event; the export stops at the end of the
    streams as they were when it began.
    """
    from gpuops.clock import SystemClock
    from gpuops.ops.export import Selection, parse_time

    clock = SystemClock()
    try:
        selection = Selection(
            since=parse_time(filters["since"], clock) if filters["since"] else None,
            until=parse_time(filters["until"], clock) if filters["until"] else None,
            nodes=tuple(filters["nodes"]),
            kinds=tuple(filters["kinds"]),
        )
    except EngineError as exc:
        raise click.BadParameter(str(exc)) from exc
    settings = settings_from(ctx, nats=nats)
    done = run_async(_export(settings, selection, output, telemetry_format))
    per_stream = ", ".join(f"{n} from {s}" for s, n in sorted(done.lines.items())) or "none"
    skipped = f"; {done.skipped} unreadable messages left out" if done.skipped else ""
    if done.unjoined:
        skipped += (
            f"; {done.unjoined} v2 samples without their node's static facts "
            "(replay refuses them as facts_unknown; v1 leaves them out)"
        )
    err.print(f"exported {done.total} events ({per_stream}){skipped}", highlight=False)


async def _export(
    settings: Settings, selection: Selection, output: IO[bytes], telemetry_format: int
) -> Exported:
    from gpuops.bus.conn import open_bus
    from gpuops.ops.export import export as run_export

    settings.state_dir.mkdir(parents=True, exist_ok=True)
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-export", role="cli") as bus:
        return await run_export(bus.js, selection, output, telemetry_format)


@click.group()
def identity() -> None:
    """Publisher keys: what proves a message is a node's or a source's (docs/deploy.md)."""


@identity.command("issue")
@click.argument("name")
@click.option("--source", "is_source", is_flag=True, help="NAME is a source (prometheus)")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="write the key here (0600) instead of printing it",
)
@click.pass_context
def issue(ctx: click.Context, name: str, is_source: bool, output: Path | None) -> None:
    """The publisher key of node NAME (or, --source, of a source), derived from this
    engine's identity key: give it to that node's agent only (identity.publisher_key)."""
    from gpuops.bus.identity import derive, node_identity, source, write_key
    from gpuops.spine.app import identity_key

    settings = settings_from(ctx)
    who = source(name) if is_source else node_identity(name)
    key = derive(identity_key(settings), who)
    if output is None:
        click.echo(key.hex())
        return
    write_key(output, key)
    click.echo(f"wrote the key of {who} to {output}", err=True)


COMMANDS = [init, export, identity]
