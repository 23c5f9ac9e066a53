"""`gpuops ingest prometheus` and `gpuops validate --source dcgm` as a user runs them."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from click.testing import CliRunner
from gpuops.bus.conn import Bus
from gpuops.bus.embedded import enrol
from gpuops.bus.identity import KeyRing, Verifier, source
from gpuops.bus.server import EmbeddedNats
from gpuops.cli import main
from gpuops.signing import load_key

from tests.conftest import wait_for
from tests.dcgm_exposition import exposition, serve
from tests.support import AsEvents, free_port, gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
GPUOPS = gpuops_argv()


def _inventory(tmp_path: Path) -> str:
    """gpu-node-07, whose exporter the tests serve on 127.0.0.1."""
    path = tmp_path / "inventory.yml"
    path.write_text("all:\n  hosts:\n    gpu-node-07: {ansible_host: 127.0.0.1}\n")
    return str(path)


async def _gpuops(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *GPUOPS, *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_validate_source_dcgm_warns_and_exits_0() -> None:
    rc, out, _ = await _gpuops("validate", "--source", "dcgm", "rules")
    assert rc == 0 and out.startswith("ok: ")
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert any(
        "rule probe-failed: cannot-fire: dcgm-exporter never sends probe" in w for w in warnings
    )
    assert any("rule agent-silent: fires-everywhere" in w for w in warnings)
    loaded = out.splitlines()[0].split()[1]  # "ok: N rules in M files"
    assert out.splitlines()[-1] == f"dcgm: {len(warnings)} of {loaded} rules not fully served"


async def test_ingest_once_prints_the_events_of_one_scrape(tmp_path: Path) -> None:
    page = exposition(overrides={5: {"DCGM_FI_DEV_GPU_TEMP": 71}})
    async with serve({"/metrics": page}) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        args = ["--state-dir", str(tmp_path / "state"), "ingest", "prometheus", "--once"]
        rc, out, err = await _gpuops(*args, "--target", url, "--inventory", _inventory(tmp_path))
        assert rc == 0, err
        (event,) = [json.loads(line) for line in out.splitlines()]
        assert (event["kind"], event["node"], event["source"]) == (
            "telemetry",
            "gpu-node-07",
            "prometheus",
        )
        assert [g["temp_c"] for g in event["data"]["gpus"]] == [34] * 5 + [71, 34, 34]


def test_ingest_without_a_target_says_what_to_give(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["--config", str(tmp_path / "none.yml"), "ingest", "prometheus", "--once"]
    (tmp_path / "none.yml").write_text("{}\n")
    done = runner.invoke(main, base)
    assert done.exit_code == 1 and "give --target URL" in done.output
    done = runner.invoke(main, [*base, "--target", "ftp://x/metrics"])
    assert (
        done.exit_code == 1 and "not an http(s) URL with a host: 'ftp://x/metrics'" in done.output
    )
    done = runner.invoke(main, [*base, "--target", "http://x/metrics", "--interval", "0"])
    assert done.exit_code == 1 and "sources.prometheus.interval_s" in done.output
    closed = f"http://127.0.0.1:{free_port()}/metrics"
    done = runner.invoke(main, [*base, "--target", closed, "--inventory", _inventory(tmp_path)])
    assert done.exit_code == 1 and f"no target answered: {closed} (down)" in done.output


async def test_ingest_publishes_every_interval_serves_metrics_and_stops_on_sigterm(
    tmp_path: Path, nats_server: EmbeddedNats, bus: Bus
) -> None:
    seen: list[dict[str, Any]] = []
    read = AsEvents()
    signed: list[str] = []
    # The source signs as `source:prometheus` with the key an engine on this state dir
    # writes when it starts (bus.embedded.enrol): there is no engine here, so enrol.
    identity_key = load_key(tmp_path / "keys" / "identity.key", "identity key")
    enrol(tmp_path, ["gpu-node-07"], identity_key)
    verifier = Verifier(KeyRing(identity_key))

    async def keep(msg: Any) -> None:
        seen.append(read(msg.data))
        signed.append(verifier.publisher(msg.headers, msg.data, "telemetry", "gpu-node-07"))

    nc = await nats.connect(nats_server.url)
    await nc.subscribe("gpuops.telemetry.>", cb=keep)
    http = f"127.0.0.1:{free_port()}"
    async with serve({"/metrics": exposition(gpus=2)}) as port:
        args = ["--state-dir", str(tmp_path), "ingest", "prometheus", "--interval", "0.5"]
        args += ["--target", f"http://127.0.0.1:{port}/metrics", "--nats", nats_server.url]
        args += ["--inventory", _inventory(tmp_path)]
        proc = await asyncio.create_subprocess_exec(
            *GPUOPS, *args, "--http", http, cwd=ROOT, stderr=asyncio.subprocess.PIPE
        )
        try:
            await wait_for(lambda: len(seen) >= 2, 30)
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://{http}/metrics") as resp,
            ):
                text = await resp.text()
            assert 'gpuops_source_scrapes_total{outcome="ok",target=' in text
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    await nc.close()
    assert proc.returncode == 0, err.decode()
    assert "failed" not in err.decode(), err.decode()  # every scrape went into the stream
    assert {(e["node"], e["source"], len(e["data"]["gpus"])) for e in seen} == {
        ("gpu-node-07", "prometheus", 2)
    }
    assert set(signed) == {source("prometheus")}, "each sample is the source's, by its MAC"


async def _once(tmp_path: Path, page: str, inventory: str | None = None) -> tuple[int, str, str]:
    """`ingest prometheus --once` against one served page, on the checkout's rules."""
    async with serve({"/metrics": page}) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        args = ["--state-dir", str(tmp_path / "state"), "ingest", "prometheus", "--once"]
        inv = inventory or _inventory(tmp_path)
        return await _gpuops(*args, "--target", url, "--inventory", inv)


async def test_a_feed_without_the_slowdown_field_names_the_rule_and_what_to_add(
    tmp_path: Path,
) -> None:
    # dcgm-exporter's default counters leave DCGM_FI_DEV_SLOWDOWN_TEMP out.
    page = "\n".join(
        line for line in exposition().splitlines() if "DCGM_FI_DEV_SLOWDOWN_TEMP" not in line
    )
    rc, out, err = await _once(tmp_path, page + "\n")
    assert rc == 0, err
    assert [json.loads(line)["kind"] for line in out.splitlines()] == ["telemetry"]
    (told,) = [line for line in err.splitlines() if "rule gpu-overheat" in line]
    assert "reads temp_slowdown_c" in told and "the rule cannot fire" in told
    assert "add DCGM_FI_DEV_SLOWDOWN_TEMP to dcgm-exporter's counters CSV" in told
    assert "rule hbm-overheat" not in err, "a field the page has is not told"


async def test_a_page_without_hostname_from_no_inventory_host_warns_and_fails(
    tmp_path: Path,
) -> None:
    page = re.sub(r'Hostname="[^"]*",', "", exposition())
    inventory = tmp_path / "other.yml"  # the node is elsewhere: 127.0.0.1 is no host
    inventory.write_text("all:\n  hosts:\n    gpu-node-07: {ansible_host: 10.9.9.7}\n")
    rc, out, err = await _once(tmp_path, page, str(inventory))
    assert rc == 1 and out == ""
    (told,) = [line for line in err.splitlines() if "placed no series" in line]
    assert "the target is no inventory host" in told and "no Hostname label" in told
    assert "(logged once while it lasts)" in err


async def test_a_page_with_no_dcgm_series_says_nothing_matched_and_fails(tmp_path: Path) -> None:
    rc, out, err = await _once(tmp_path, "# TYPE node_load1 gauge\nnode_load1 0.5\n")
    assert rc == 1 and out == ""
    assert "no series matched: the page has none of the DCGM fields gpuops maps" in err


async def test_once_prints_an_xid_it_only_remembers(tmp_path: Path) -> None:
    rc, out, err = await _once(tmp_path, exposition(overrides={3: {"DCGM_FI_DEV_XID_ERRORS": 79}}))
    assert rc == 0, err
    assert [json.loads(line)["kind"] for line in out.splitlines()] == ["telemetry"]
    assert "gpu-node-07 GPU 3: last XID 79 (remembered, not an event" in err
