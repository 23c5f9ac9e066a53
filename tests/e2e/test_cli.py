"""The gpuops command as a user runs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
GPUOPS = gpuops_argv()


def _gpuops(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUOPS, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.slow  # two minutes: the whole demo, as `make demo` runs it: `make test-slow`
def test_demo_closes_the_loop_for_every_fault(tmp_path: Path) -> None:
    # The demo waits on what happens, not on the wall: a loaded machine makes it slower,
    # never wrong, so its own limit is generous.
    done = _gpuops(
        "--state-dir", str(tmp_path), "demo", "--json-summary", "--timeout", "500", timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] is True
    rules = {f["fault"]: f for f in summary["faults"]}
    assert set(rules) == {"overheat", "power_limit", "xid", "zombie", "drift", "silent"}
    expected = {
        "overheat": "drain.yml",
        "power_limit": "power_limit.yml",
        # The lost GPU comes back from its reboot at 120 GB/s: the gate (grade 2) fails
        # and the ladder climbs; the reprovisioning is the remediation that held.
        "xid": "reprovision.yml",
        "zombie": "gpu_reset.yml",
        "drift": "baseline.yml",
    }
    for fault, playbook in expected.items():
        row = rules[fault]
        assert row["playbook"] == playbook and row["run"] == "successful", row
        assert row["detected_after_s"] is not None, row
        if fault != "overheat":
            assert row["outcome"] == "recovered", row
            assert summary["node_states"][row["node"]] == "healthy", "validated, back in service"
    assert rules["overheat"]["outcome"] == "isolated and cooled (needs a person)"
    assert summary["node_states"][rules["overheat"]["node"]] == "needs_human"
    assert rules["silent"]["outcome"] == "notified (needs a person)"
    assert summary["drift_check"]["hosts_checked"] == 16
    assert "node-006" in summary["drift_check"]["drifted"]
    history = _gpuops("--state-dir", str(tmp_path / "demo"), "history", "--json")
    assert history.returncode == 0, history.stderr
    runs = [json.loads(line) for line in history.stdout.splitlines() if '"type": "run"' in line]
    assert len(runs) == summary["runs"] >= 5


def test_validate_reports_file_line_rule_and_exits_1() -> None:
    bad = ROOT / "tests" / "unit" / "match" / "bad_rules" / "lambda.yml"
    done = _gpuops("validate", str(bad))
    assert done.returncode == 1
    assert done.stdout.strip() == f"{bad}:4: rule sneaky: when: lambdas are not allowed"


def test_validate_accepts_the_shipped_rules() -> None:
    done = _gpuops("validate", "rules")
    assert done.returncode == 0 and done.stdout.startswith("ok: ")


def test_schema_prints_json() -> None:
    done = _gpuops("schema", "events")
    assert json.loads(done.stdout)["title"] == "gpuops event v1"


def test_help_lists_every_command() -> None:
    done = _gpuops("--help")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.split("Commands:")[1].splitlines() if line}
    assert listed == {
        *("run", "validate", "test-rules", "replay", "diff-rules", "schema", "bench"),
        *("status", "history", "silence", "unsilence", "approve", "deny", "breaker"),
        *("drain", "undrain", "dry-run", "drift-check", "publish", "state"),
        *("simulate", "sim-fault", "demo", "agent"),
        *("init", "export", "ingest", "power", "report", "identity", "topology"),
    }


def test_help_of_a_subcommand_exits_0_without_an_error() -> None:
    for args in (("status", "--help"), ("bench", "storm", "--help"), ("history", "--help")):
        done = _gpuops(*args)
        assert done.returncode == 0 and "Usage:" in done.stdout, (args, done.stderr)
        assert "Error" not in done.stderr, (args, done.stderr)


def test_dash_h_is_help_on_every_command_and_subcommand() -> None:
    import click
    from click.testing import CliRunner
    from gpuops.cli import main

    runner = CliRunner()
    paths: list[list[str]] = [[]]
    for name, command in main.commands.items():
        paths.append([name])
        if isinstance(command, click.Group):
            paths += [[name, sub] for sub in command.commands]
    for path in paths:
        if path[-1:] == ["soak"]:  # its arguments pass through to the soak, -h included
            continue
        done = runner.invoke(main, [*path, "-h"])
        assert done.exit_code == 0 and done.output.startswith("Usage:"), (path, done.output)
