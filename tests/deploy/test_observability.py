"""The Grafana dashboard and the Prometheus alert rules shipped in deploy/ query only
series the engine exports, and promtool accepts (and unit-tests) the rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from gpuops.http import HttpServer
from gpuops.record.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "gpuops.json"
RULES = DEPLOY / "prometheus" / "gpuops-alerts.yml"
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
METRIC = re.compile(r"\bgpuops_[a-z_]+")


async def _exported() -> set[str]:
    """Every family the engine's /metrics describes (TYPE lines), read over HTTP."""
    server = HttpServer(Metrics().registry, lambda: (True, {}))
    port = await server.start("127.0.0.1:0")
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/metrics") as r,
        ):
            text = await r.text()
    finally:
        await server.stop()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _family(name: str, families: set[str]) -> bool:
    return name in families or any(
        name.endswith(s) and name[: -len(s)] in families for s in SUFFIXES
    )


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


async def test_every_metric_the_dashboard_queries_is_exported() -> None:
    families = await _exported()
    exprs = _dashboard_exprs()
    queried = {m for e in exprs for m in METRIC.findall(e)}
    assert len(queried) >= 12, queried  # states, lag, breaker, the four latencies, runs...
    missing = sorted(m for m in queried if not _family(m, families))
    assert not missing, f"the dashboard queries series the engine does not export: {missing}"
    for wanted in (
        "gpuops_event_to_decision_seconds_bucket",
        "gpuops_decide_to_run_seconds_bucket",
        "gpuops_run_duration_seconds_bucket",
        "gpuops_detect_to_recover_seconds_bucket",
        "gpuops_nodes",
        "gpuops_breaker_state",
        "gpuops_consumer_pending",
        "gpuops_episodes_open",
    ):
        assert any(wanted in e for e in exprs), wanted


async def test_every_metric_the_alerts_read_is_exported() -> None:
    families = await _exported()
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"GpuopsEngineDown", "GpuopsConsumerLagGrowing", "GpuopsBreakerOpen"} <= names
    assert "GpuopsRunsFailing" in names
    queried = {m for r in rules for m in METRIC.findall(r["expr"])}
    assert not sorted(m for m in queried if not _family(m, families))


def test_the_dashboard_is_provisioned_from_its_folder() -> None:
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/gpuops.yml").read_text())
    assert provider["providers"][0]["type"] == "file"
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "gpuops-engine" and len({p["id"] for p in dash["panels"]}) == len(
        dash["panels"]
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_and_unit_tests_the_alert_rules() -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None
    here = RULES.parent
    checked = subprocess.run(
        [promtool, "check", "rules", RULES.name], cwd=here, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout
    tested = subprocess.run(
        [promtool, "test", "rules", "gpuops-alerts.test.yml"],
        cwd=here,
        capture_output=True,
        text=True,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    config = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"], cwd=here, capture_output=True, text=True
    )
    assert config.returncode == 0, config.stdout + config.stderr
