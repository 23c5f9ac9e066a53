"""Shared fixtures: a real nats-server per test, a simulated fleet, an engine in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.conn import Bus, connect
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import Clock, SystemClock
from gpuops.models import RunOutcome
from gpuops.record.audit import read_audit
from gpuops.record.metrics import total
from gpuops.settings import NatsSettings, Settings
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App, load_world

counted = total  # the tests' name for reading a counter (summed, or one label)
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream on a random loopback port."""
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[Bus]:
    """A connection with the streams and buckets created."""
    b = await connect(nats_server.url, NatsSettings())
    yield b
    await b.close()


@pytest.fixture
def fleet(tmp_path: Path) -> SimFleet:
    """Two simulated nodes with four GPUs each, and their inventory."""
    return SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)


def engine_settings(tmp_path: Path, fleet: SimFleet, url: str, **over: Any) -> Settings:
    """Settings for an engine on the checkout's playbooks and the test fleet."""
    base: dict[str, Any] = {
        "state_dir": tmp_path / "state",
        "rules_dir": ROOT / "rules",
        "playbooks_dir": ROOT / "playbooks",
        "inventory": fleet.root / "inventory",
        "nats": {"url": url},
        "tick_s": 0.2,
    }
    base.update(over)
    return Settings.model_validate(base)


@contextlib.asynccontextmanager
async def running_engine(
    settings: Settings, bus: Bus, clock: Clock | None = None
) -> AsyncIterator[App]:
    """An App running in the background of the test's event loop."""
    rules, inventory = load_world(settings)
    app = App(
        settings=settings, bus=bus, clock=clock or SystemClock(), rules=rules, inventory=inventory
    )
    task = asyncio.create_task(app.run())
    try:
        await wait_for(lambda: _owns_everything(app, task), 60)
        yield app
    finally:
        app.stop.set()
        await asyncio.wait_for(task, 30)


def _owns_everything(app: App, task: asyncio.Task[None]) -> bool:
    """The one engine of a test owns every partition (it decides for every node)."""
    if task.done():
        task.result()  # the engine failed to start: say why
    parts = app.partitions
    return parts is None or len(parts.ready) == app.settings.nats.partitions


def calls(fleet: SimFleet, node: str, tool: str | None = None) -> list[list[str]]:
    """The argv of every shim call made on a node (optionally one tool's)."""
    path = fleet.node_dir(node) / "calls.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["argv"] for r in rows if tool is None or r["tool"] == tool]


async def wait_for(predicate: Any, limit_s: float = 30.0, interval: float = 0.1) -> None:
    """Poll until `predicate()` is true; fail the test with a clear message on timeout."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while asyncio.get_running_loop().time() < deadline:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {limit_s}s: {predicate}")


async def run_outcomes(bus: Bus, node: str | None = None) -> list[RunOutcome]:
    """Every playbook run in the audit trail (optionally one node's), oldest first."""
    return [
        RunOutcome.model_validate(r.body) async for r in read_audit(bus.js, node) if r.type == "run"
    ]
