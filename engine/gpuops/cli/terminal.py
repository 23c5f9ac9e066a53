"""What every gpuops command shares: the consoles, settings from flags, running a
coroutine, user text made safe for Rich, and the options several commands take.
Errors are reported by the CLI group."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape

from gpuops.settings import Settings, load_settings

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
# Piped output is read in logs and CI: do not squeeze tables to 80 columns there.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; its errors are the CLI group's to report."""
    return asyncio.run(coro)


def settings_from(ctx: click.Context, **flags: Any) -> Settings:
    """The settings: file, environment, then the group's and the command's flags."""
    base: dict[str, Any] = dict(ctx.obj or {})
    nats_url = flags.pop("nats", None)
    if nats_url:
        base["nats"] = {"url": nats_url}
    base.update({k: v for k, v in flags.items() if v is not None})
    return load_settings(base.pop("config", None), base)


def telemetry_format_option(what: str) -> Callable[[F], F]:
    """`--telemetry-format 1|2` (an int), for the commands that write telemetry."""
    return click.option(
        "--telemetry-format",
        type=click.IntRange(1, 2),
        default=2,
        show_default=True,
        help=f"{what}: 2 compact (static facts once, readings as arrays), 1 every field (JSON)",
    )


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def one_line(text: object) -> str:
    """Text a node or the network wrote, as one line with no control characters: its
    newlines cannot fake lines of ours, nor its escapes move the cursor or clear the screen."""
    return _CONTROL.sub(" ", str(text))


def cells(*values: object) -> list[str]:
    """Table cells from text that may hold user input: Rich markup in it is shown as is."""
    return [escape(str(v)) for v in values]
