"""Helpers the test suites share: a free loopback port, the CLI as a user runs it, a
real Prometheus, one match decided through the pipeline's entry, the headers that
make a message a node's own (gpuops.bus.identity), and published messages read back as
v1 events whatever telemetry format they went out in, and a drain intent as the engine
decides one."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gpuops import subjects
from gpuops.bus.identity import KeyRing
from gpuops.bus.wire import Expander
from gpuops.models import ActionSpec, Decision, Intent, Match, Request
from gpuops.signing import load_key
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


@contextlib.contextmanager
def prometheus(tmp_path: Path, scrape_configs: str) -> Iterator[str]:
    """/usr/bin/prometheus scraping every second with these `scrape_configs` (YAML list
    items, indented two spaces); its base URL. Skips where it is not installed."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (scripts/ci-setup.sh installs Debian's)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n" + scrape_configs
    )
    with (tmp_path / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """Ask a child to stop, and kill it if it has not within `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def ask(prometheus: str, query: str) -> list[dict[str, Any]]:
    """The instant vector a Prometheus answers `query` with ([] while it cannot)."""
    try:
        url = f"{prometheus}/api/v1/query"
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, params={"query": query}) as r,
        ):
            return list((await r.json())["data"]["result"]) if r.status == 200 else []
    except (aiohttp.ClientError, OSError, KeyError):
        return []


def node_keys(state_dir: Path) -> KeyRing:
    """Every publisher's key of the engine on `state_dir` (its identity key, made if new):
    what a test publishing as a node's agent signs with, as that agent would."""
    return KeyRing(load_key(state_dir / "keys" / "identity.key", "identity key"))


def as_node(
    keys: KeyRing, subject: str, payload: bytes, msg_id: str | None = None
) -> dict[str, str]:
    """The headers of `payload` published by the node its subject names (and its id)."""
    _kind, node = subjects.parse_event(subject)
    return keys.node(node).headers(payload, {"Nats-Msg-Id": msg_id} if msg_id else None)


class AsEvents:
    """Published payloads as v1 event dicts: telemetry v2 joined to the keyframes read
    before it (one reader per stream of messages, as the engine keeps facts per node)."""

    def __init__(self) -> None:
        self._expander = Expander(1)

    def __call__(self, payload: bytes) -> dict[str, Any]:
        line = self._expander.line(payload)
        assert line is not None, "a v2 sample before its node's keyframe"
        event: dict[str, Any] = json.loads(line)
        return event


def fleet_gpus(tmp_path: Path, t: float) -> list[dict[str, Any]]:
    """One 8-GPU sample of a simulated H200 node at `t`, as its agent reads it."""
    from gpuops.sim.fleet import SimFleet

    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=8)
    sample = fleet.telemetry(fleet.nodes[0], t)
    assert sample is not None
    gpus: list[dict[str, Any]] = sample["data"]["gpus"]
    return gpus


def drain_intent(
    key: str, node: str = "node-001", reason: str = "GPU 0 at 91 C", **action: Any
) -> Intent:
    """An overheat rule's drain of `node`, decided now (unsigned; `gpuops.signing.sign`)."""
    now = time.time()
    return Intent(
        key=key,
        rule="overheat",
        node=node,
        action=ActionSpec(playbook="drain.yml", vars={"reason": reason}, **action),
        event_id=f"event-{key}",
        event_ts=now,
        decided_at=now,
    )
