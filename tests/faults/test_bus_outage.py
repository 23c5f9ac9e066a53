"""Issue 10, defect 1: `gpuops run` survives a NATS outage longer than its timeouts.

Black box: a nats-server started here, `gpuops run` as a subprocess against it, events
before an outage of 15 s and after it; the engine must still answer /healthz, process
the events published after NATS came back, and be alive.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from gpuops.bus.conn import EVENTS
from gpuops.bus.server import EmbeddedNats
from gpuops.models import new_event, subject_for
from gpuops.scale.lag import drained
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from tests.conftest import ROOT, wait_for
from tests.support import free_port, gpuops_argv, stop_process

pytestmark = [pytest.mark.faults, pytest.mark.slow]

OUTAGE_S = 15.0


def _healthz(port: int) -> int:
    """The /healthz status code, 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


async def _quiet(exc: Exception) -> None:
    """The test's own client reconnects through the outage; its errors are expected."""


async def _healthy(port: int) -> bool:
    return await asyncio.to_thread(_healthz, port) == 200


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    nats_server = EmbeddedNats(tmp_path / "nats", port=free_port()).start()
    yield nats_server
    nats_server.stop()


@pytest.fixture
def engine(tmp_path: Path, server: EmbeddedNats) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """`gpuops run --dry-run` on the checkout's rules against a two-node simulated fleet."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    http = free_port()
    args = gpuops_argv("run", state_dir=tmp_path / "state")
    args += ["--nats", server.url, "--rules", str(ROOT / "rules")]
    args += ["--playbooks", str(ROOT / "playbooks"), "--inventory", str(fleet.root / "inventory")]
    args += ["--dry-run", "--http", f"127.0.0.1:{http}"]
    log = (tmp_path / "gpuops.log").open("w")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc, http
    finally:
        stop_process(proc, 15)
        log.close()


async def _publish_xids(nc: Client, count: int) -> int:
    """XID 63 (row remap: recorded, never acted on) events; the last stream sequence."""
    js = nc.jetstream(timeout=5)
    last = 0
    for i in range(count):
        event = new_event("xid", f"node-00{1 + i % 2}", time.time(), {"gpu": 0, "xid": 63}, "test")
        ack = await js.publish(
            subject_for("xid", event["node"]),
            json.dumps(event).encode(),
            headers={"Nats-Msg-Id": event["id"]},
        )
        last = ack.seq
    return last


async def _all_processed(nc: Client, through_seq: int) -> bool:
    """The engine's events consumers (every partition's) acked everything up to `through_seq`."""
    js = nc.jetstream(timeout=2)
    try:
        stored = (await js.stream_info(EVENTS)).state.last_seq
        return stored >= through_seq and await drained(js, False, NatsSettings().partitions)
    except (NatsError, JsError, TimeoutError):
        return False


async def test_engine_processes_events_after_a_15s_nats_outage(
    tmp_path: Path, server: EmbeddedNats, engine: tuple[subprocess.Popen[str], int]
) -> None:
    proc, http = engine
    log = tmp_path / "gpuops.log"
    await wait_for(lambda: _healthy(http), 60)
    nc = await nats.connect(
        server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=_quiet
    )
    try:
        before = await _publish_xids(nc, 5)
        await wait_for(lambda: _all_processed(nc, before), 60)

        server.stop()
        await asyncio.sleep(OUTAGE_S)  # the outage itself, longer than every client timeout
        server.start()  # same port, same store
        await wait_for(lambda: nc.is_connected, 30)

        after = await _publish_xids(nc, 5)
        try:
            await wait_for(lambda: _all_processed(nc, after), 90)
            await wait_for(lambda: _healthy(http), 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; engine log:\n{log.read_text()[-3000:]}") from exc
        assert proc.poll() is None, f"the engine exited: {log.read_text()[-3000:]}"
    finally:
        await nc.close()
