"""The `gpuops` command. Results go to stdout, logs to stderr, so `--json` output pipes.

The commands live in modules by audience, each a list of click commands added here:
engine_cmds (run the engine, check rules), shadow_cmds (try rules on events: test-rules,
replay, diff-rules), operator_cmds (status, history,
approvals, silences, the breaker, drains, drift checks, publishing events),
sim_cmds (the simulated fleet and the demo), agent_cmds (the node agent), source_cmds
(ingest from dcgm-exporter / Prometheus) and site_cmds (init a site, export events, --version).
`gpuops bench ...` comes from the bench wing's entry point (gpuops/bench/cli.py).

May import: act, agent, bus, diagnose (topology learn / check), intake, inventory, match,
ops, power, record, scale, sim, sources, spine.
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import click

from gpuops.cli import (
    agent_cmds,
    engine_cmds,
    operator_cmds,
    power_cmds,
    shadow_cmds,
    sim_cmds,
    site_cmds,
    source_cmds,
)
from gpuops.errors import EngineError


class Gpuops(click.Group):
    """The group: every command's errors end here, each as one message and an exit code.

    Bad arguments are click's UsageError (exit 2), whether click or the engine found
    them; an EngineError (gpuops.errors) exits 1 with its message, which says what to
    do; anything else is a bug, one line too unless --debug asks for the traceback.
    """

    def invoke(self, ctx: click.Context) -> Any:
        from gpuops.ops.cmdwire import CommandUsageError

        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: a usage error, `--help` of a subcommand, Ctrl-C
        except CommandUsageError as exc:
            raise click.UsageError(str(exc)) from exc
        except EngineError as exc:
            raise click.ClickException(str(exc)) from exc
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            raise click.ClickException(
                f"internal error: {type(exc).__name__}: {exc} "
                "(a bug: rerun with --debug for the traceback, and report it)"
            ) from exc


# -h as well as --help, on every command (click hands the names down to subcommands).
@click.group(cls=Gpuops, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", type=click.Path(path_type=Path), help="settings YAML (or GPUOPS_CONFIG)")
@click.option(
    "--state-dir", type=click.Path(path_type=Path), help="state dir (or GPUOPS_STATE_DIR)"
)
@click.option("-v", "--verbose", count=True, help="more logging on stderr")
@click.option("--debug", is_flag=True, help="a traceback with an unexpected error")
@site_cmds.version_option
@click.pass_context
def main(
    ctx: click.Context, config: Path | None, state_dir: Path | None, verbose: int, debug: bool
) -> None:
    """gpuops: event-driven remediation for GPU clusters."""
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ctx.obj = {"config": config, "state_dir": state_dir}


for _module in (
    engine_cmds,
    shadow_cmds,
    operator_cmds,
    power_cmds,
    sim_cmds,
    agent_cmds,
    site_cmds,
    source_cmds,
):
    for _command in _module.COMMANDS:
        main.add_command(_command)

# Wings that plug commands in (bench/): found by entry point, never imported here, so
# the product's CLI reads and runs without them.
for _plugin in entry_points(group="gpuops.commands"):
    main.add_command(_plugin.load(), _plugin.name)
