"""Hot reload keeps the last good rules; replay prints would-be actions without acting."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import rfc3339
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, engine_settings, running_engine, wait_for
from tests.support import gpuops_argv

pytestmark = pytest.mark.integration


def _rules_copy(tmp_path: Path) -> Path:
    rules_dir = tmp_path / "rules"
    shutil.copytree(ROOT / "rules", rules_dir)
    return rules_dir


async def test_reload_with_a_bad_file_keeps_the_last_good_rules(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    rules_dir = _rules_copy(tmp_path)
    # The watcher stays out of the way: this test calls reload itself.
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, rules_dir=rules_dir, rules_poll_s=3600.0
    )
    async with running_engine(settings, bus) as app:
        before = {r.name for r in app.pipeline.matcher.rules.rules}
        bad = ROOT / "tests" / "unit" / "match" / "bad_rules" / "lambda.yml"
        shutil.copy(bad, rules_dir / "zz-bad.yml")
        assert await app.reload() is False
        assert {r.name for r in app.pipeline.matcher.rules.rules} == before
        (rules_dir / "zz-bad.yml").write_text(
            "rules:\n  - name: new-rule\n    on: xid\n    when: xid == 13\n"
        )
        assert await app.reload() is True
        assert "new-rule" in {r.name for r in app.pipeline.matcher.rules.rules}


async def test_the_watcher_reloads_a_changed_rule_file(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    rules_dir = _rules_copy(tmp_path)
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, rules_dir=rules_dir, rules_poll_s=0.2
    )
    async with running_engine(settings, bus) as app:
        await asyncio.wait_for(app.watching.wait(), 30)  # it has read the files as they were
        (rules_dir / "zz-new.yml").write_text(
            "rules:\n  - name: watched-rule\n    on: xid\n    when: xid == 13\n"
        )
        await wait_for(
            lambda: "watched-rule" in {r.name for r in app.pipeline.matcher.rules.rules}, 30
        )


def test_replay_prints_would_be_actions_as_json(tmp_path: Path) -> None:
    events = []
    for second in range(0, 45, 5):
        events.append(
            {
                "id": f"t{second}",
                "kind": "telemetry",
                "node": "node-001",
                "ts": rfc3339(1_800_000_000 + second),
                "source": "recording",
                "data": {
                    "gpus": [{"index": 2, "power_limit_w": 450.0, "power_default_limit_w": 700.0}]
                },
            }
        )
    events.append(
        {
            "id": "x",
            "kind": "xid",
            "node": "node-002",
            "ts": rfc3339(1_800_000_050),
            "source": "recording",
            "data": {"gpu": 0, "xid": 79},
        }
    )
    path = tmp_path / "week.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in events) + "\n{broken\n")
    done = subprocess.run(
        gpuops_argv("replay", str(path), "--json"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert {
        "kind": "action",
        "rule": "power-limit-below-policy",
        "node": "node-001",
        "gpu": 2,
        "gpus": [2],
        "action": "power_limit.yml",
        "ts": "2027-01-15T08:00:30.000Z",
        "dry_run": False,
    } in lines
    assert any(
        a.get("rule") == "xid-79-gpu-lost" and a.get("action") == "reboot.yml" for a in lines
    )
    [broken] = [a for a in lines if a["kind"] == "refused"]
    assert (broken["reason"], broken["first_line"]) == ("json", 11)
    assert "10 events, 1 unreadable" in done.stderr
