"""Helpers the test suites share: a free loopback port, the CLI as a user runs it, and
one match decided through the pipeline's entry."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuops.models import Decision, Match, Request
from gpuops.spine.pipeline import Pipeline


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpuops_argv(*args: str, state_dir: Path | None = None) -> list[str]:
    """The `gpuops` command line, run by this interpreter (the checkout's code)."""
    head = [sys.executable, "-m", "gpuops.cli"]
    if state_dir is not None:
        head += ["--state-dir", str(state_dir)]
    return [*head, *args]


def run_gpuops(
    *args: str, state_dir: Path | None = None, timeout: float = 120, **options: Any
) -> subprocess.CompletedProcess[str]:
    """Run `gpuops ARGS` to its end, output captured as text."""
    return subprocess.run(
        gpuops_argv(*args, state_dir=state_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **options,
    )


async def decide(pipeline: Pipeline, match: Match, approved_by: str | None = None) -> Decision:
    """One match decided through the pipeline's entry, as an engine request."""
    [decision] = await pipeline.handle(Request(match=match, approved_by=approved_by))
    return decision
