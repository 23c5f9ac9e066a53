"""The shipped rule tests pass, cover every shipped rule, and a failing case fails."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from gpuops.match.loader import load_rules
from gpuops.match.rules import RuleSet
from gpuops.sim.fleet import SimFleet
from gpuops.spine.ruletest import load_cases, run_cases

from tests.support import gpuops_argv

ROOT = Path(__file__).resolve().parents[3]
RULE_TESTS = sorted((ROOT / "tests" / "rules").glob("*.yml"))


@pytest.fixture(scope="module")
def shipped() -> RuleSet:
    return load_rules([ROOT / "rules"], ROOT / "playbooks")


@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
async def test_rule_test_file_passes(path: Path, shipped: RuleSet) -> None:
    results = await run_cases(str(path), load_cases(path), shipped)
    failed = [(r.name, r.failures) for r in results if not r.passed]
    assert results and not failed


def test_every_shipped_rule_has_a_test(shipped: RuleSet) -> None:
    expected = {
        want["rule"]
        for path in RULE_TESTS
        for case in load_cases(path)
        for want in case.get("expect", [])
        if "rule" in want
    }
    assert {r.name for r in shipped.rules} - expected == set()


def test_cli_exits_nonzero_on_a_failing_case(tmp_path: Path) -> None:
    case = {
        "cases": [
            {
                "name": "wrong on purpose",
                "events": [
                    {"at": "0s", "kind": "xid", "node": "n1", "data": {"gpu": 0, "xid": 79}}
                ],
                "expect": [{"rule": "xid-79-gpu-lost", "action": "drain.yml"}],
            }
        ]
    }
    (tmp_path / "t.yml").write_text(yaml.safe_dump(case))
    done = subprocess.run(
        gpuops_argv("test-rules", str(tmp_path)),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 1
    assert "FAIL" in done.stdout and "xid-79-gpu-lost:reboot.yml" in done.stdout


def test_test_rules_decides_over_the_sites_inventory(tmp_path: Path) -> None:
    """Review of issue 30: test-rules built its fleet from the case's nodes alone, though
    the site names an inventory the live engine decides over: three lost GPUs in a
    fleet of three tripped a breaker that a fleet of 40 keeps closed for two. Over the
    inventory (`--inventory`), two are rebooted and the third is held, as live; a case's
    own `nodes:` keeps the made-up fleet it names."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=40, gpus=2)
    lost = [
        {"at": f"{10 * i}s", "kind": "xid", "node": node, "data": {"gpu": 0, "xid": 79}}
        for i, node in enumerate(("node-001", "node-011", "node-021"))
    ]
    reboots = {"rule": "xid-79-gpu-lost", "action": "reboot.yml"}
    cases = [
        {"name": "over the inventory", "events": lost, "expect": [{**reboots, "count": 2}]},
        {
            "name": "a made-up fleet of three",
            "nodes": ["node-001", "node-011", "node-021"],
            "events": lost,
            "expect": [{**reboots, "count": 1}],
        },
    ]
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"cases": cases}))
    argv = gpuops_argv(
        "test-rules", str(tmp_path / "t.yml"), "--inventory", str(fleet.root / "inventory")
    )
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
