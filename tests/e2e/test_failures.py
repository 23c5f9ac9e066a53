"""Issue 13: every failure of the CLI says what is wrong and exits non-zero, in bounded
time, without a traceback. The gpuops command as a user runs it (a subprocess)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from gpuops.bus.conn import EVENTS, connect
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.models import new_event
from gpuops.ops.heartbeat import Heartbeats, this_process
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet

from tests.support import free_port, gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _gpuops(state: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gpuops_argv(*args, state_dir=state),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _one_error(done: subprocess.CompletedProcess[str]) -> str:
    """The error line on stderr; there is no traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("Error:")]
    return line


def test_a_wrong_nats_url_fails_within_15s_and_names_the_url(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    began = time.monotonic()
    done = _gpuops(tmp_path / "state", "status", "--nats", url, timeout=60)
    elapsed = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert elapsed < 15, f"gave up after {elapsed:.1f}s"
    assert _one_error(done).startswith(f"Error: cannot reach NATS at {url}: connection refused")
    assert "retrying" not in done.stderr, "no warning per connect attempt"


def test_status_without_an_engine_says_so_exits_1_and_starts_no_server(tmp_path: Path) -> None:
    state = tmp_path / "state"
    done = _gpuops(state, "status")
    assert done.returncode == 1
    assert _one_error(done).startswith(f"Error: no engine running on state dir {state}")
    assert not (state / "nats").exists(), "status started no embedded nats-server"


def test_status_reads_a_stale_heartbeat_without_an_inventory_file(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    async def beat_long_ago() -> None:
        bus = await connect(nats_server.url, NatsSettings())
        try:
            beat = this_process("all", time.time() - 3600, rules=24, hosts=16)
            await Heartbeats(NatsKV(bus.kv["control"])).beat(
                beat.model_copy(update={"at": time.time() - 60, "wall": time.time() - 60})
            )
        finally:
            await bus.close()

    asyncio.run(beat_long_ago())
    missing = tmp_path / "no-such-inventory"
    env_config = tmp_path / "gpuops.yml"
    env_config.write_text(f"inventory: {missing}\n")
    done = _gpuops(
        tmp_path / "state", "--config", str(env_config), "status", "--nats", nats_server.url
    )
    assert done.returncode == 1, done.stderr
    first, nodes = done.stdout.splitlines()[:2]
    found = re.fullmatch(r"no engine running \(last heartbeat (\d+) s ago\)", first)
    assert found and 60 <= int(found.group(1)) < 120, first
    assert nodes == "nodes: healthy 16", "the engine's host count, from its heartbeat"
    as_json = _gpuops(
        tmp_path / "state",
        "--config",
        str(env_config),
        "status",
        "--json",
        "--nats",
        nats_server.url,
    )
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["engine"]["running"] is False


def test_the_engine_refuses_an_inventory_that_does_not_parse_with_the_parsers_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "broken.yml"
    path.write_text("all:\n  hosts:\n    node-001: [\n")
    # No NATS at that URL: the inventory is checked before anything connects.
    args = ("run", "--inventory", str(path), "--nats", f"nats://127.0.0.1:{free_port()}")
    done = _gpuops(tmp_path / "state", *args)
    assert done.returncode == 1
    expected = f"Error: inventory {path}: cannot parse {path}: line 4, column 1: "
    assert _one_error(done).startswith(expected), done.stderr


def test_publish_reports_each_rejected_line_and_exits_1(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    async def make_streams() -> None:
        await (await connect(nats_server.url, NatsSettings())).close()

    asyncio.run(make_streams())
    good = new_event("xid", "node-001", time.time(), {"gpu": 0, "xid": 63}, "test")
    bad = {**good, "id": "e-2", "data": {"gpu": "zero", "xid": 63}}
    lines = [json.dumps(good), json.dumps(bad), "not json at all"]
    events = tmp_path / "events.jsonl"
    events.write_text("\n".join(lines) + "\n")
    # A bare nats-server, no engine: `--direct` publishes straight to the subjects.
    done = _gpuops(
        tmp_path / "state", "publish", "--direct", str(events), "--nats", nats_server.url
    )
    assert done.returncode == 1
    rejected = [x for x in done.stderr.splitlines() if x.startswith("line ")]
    assert rejected[0].startswith("line 2: schema: xid.data.gpu: "), rejected
    assert rejected[1].startswith("line 3: json: "), rejected
    assert len(rejected) == 2
    assert "2 line(s) are not valid events" in _one_error(done)
    assert done.stdout.strip() == "published 3 events", "bad lines go on for the dead-letter queue"

    async def stored() -> int:
        bus = await connect(nats_server.url, NatsSettings())
        try:
            return int((await bus.js.stream_info(EVENTS)).state.messages)
        finally:
            await bus.close()

    assert asyncio.run(stored()) == 3, "every line, the bad ones too, is on the bus"
    # Without `--direct` the lines go through an engine; with none to answer, it says so.
    began = time.monotonic()
    done = _gpuops(tmp_path / "state", "publish", str(events), "--nats", nats_server.url)
    assert done.returncode != 0 and time.monotonic() - began < 60
    assert "no engine answers commands" in _one_error(done)
    assert asyncio.run(stored()) == 3, "nothing more was published"


@pytest.mark.slow
def test_bad_cli_use_against_a_running_engine_exits_non_zero_with_its_cause(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=2)
    config = tmp_path / "gpuops.yml"
    config.write_text(f"inventory: {fleet.root / 'inventory'}\n")
    cli = ("--config", str(config))
    engine = subprocess.Popen(
        gpuops_argv(*cli, "run", state_dir=state),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while _gpuops(state, *cli, "status").returncode != 0:
            assert time.monotonic() < deadline, "the engine came up"
            time.sleep(1)
        assert _gpuops(state, *cli, "status").stdout.startswith("engine up since ")
        usage = [
            ("silence", "node:node-001"),
            ("silence", "node:node-001", "soon", "fan swap"),
            ("silence", "nodes:node-001", "1h", "fan swap"),
            ("approve",),
        ]
        for args in usage:
            done = _gpuops(state, *cli, *args)
            assert done.returncode == 2, (args, done.stderr)
            assert "(usage: " in _one_error(done), done.stderr
        unknown = _gpuops(state, *cli, "silence", "node:node-009", "1h", "fan swap")
        assert unknown.returncode == 1 and "--force" in _one_error(unknown)
        denied = _gpuops(state, *cli, "deny", "nosuchid")
        assert denied.returncode == 1
        assert _one_error(denied) == "Error: deny: no approval 'nosuchid'"
        forced = _gpuops(state, *cli, "silence", "node:node-009", "1h", "joins", "--force")
        assert forced.returncode == 0 and forced.stdout.startswith("silence "), forced.stderr
    finally:
        engine.terminate()
        engine.wait(30)
    after = _gpuops(state, *cli, "status")
    assert after.returncode == 1 and "no engine running" in _one_error(after)


def test_an_unwritable_state_dir_stops_the_engine_with_one_line_naming_it(
    tmp_path: Path,
) -> None:
    """A file where the state dir should be (as a read-only mount would, for root too):
    one line with the path and what to do, not an internal error halfway through."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    state = blocker / "state"
    done = _gpuops(state, "run", "--nats", f"nats://127.0.0.1:{free_port()}")
    assert done.returncode == 1
    line = _one_error(done)
    assert line.startswith(f"Error: state dir {state} is not writable"), line
    assert "--state-dir, GPUOPS_STATE_DIR" in line and "internal error" not in line
