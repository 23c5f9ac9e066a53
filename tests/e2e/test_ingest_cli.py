"""`gpuops ingest prometheus` and `gpuops validate --source dcgm` as a user runs them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.dcgm_exposition import exposition, serve

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
GPUOPS = [sys.executable, "-m", "gpuops.cli"]


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
        rc, out, err = await _gpuops(
            "--state-dir", str(tmp_path), "ingest", "prometheus", "--target", url, "--once"
        )
        assert rc == 0, err
        (event,) = [json.loads(line) for line in out.splitlines()]
        assert (event["kind"], event["node"], event["source"]) == (
            "telemetry",
            "gpu-node-07",
            "prometheus",
        )
        assert [g["temp_c"] for g in event["data"]["gpus"]] == [34] * 5 + [71, 34, 34]
        rc, _, err = await _gpuops("ingest", "prometheus", "--target", f"{url}x", "--once")
    assert rc == 1 and "no target answered" in err and "(http_status)" in err


async def test_ingest_without_a_target_says_what_to_give() -> None:
    rc, _, err = await _gpuops("ingest", "prometheus", "--once")
    assert rc == 1 and "give --target URL" in err
    rc, _, err = await _gpuops("ingest", "prometheus", "--target", "ftp://x/metrics", "--once")
    assert rc == 1 and "not an http(s) URL" in err
