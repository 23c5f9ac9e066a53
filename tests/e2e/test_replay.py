"""`gpuops replay` as a site runs it: under the site's settings, with the live intake's
future check on the recording's own clock, every drop reported (identical ones folded),
unknown nodes named, and `--against` / `diff-rules` as a CI gate on a rule change."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpuops.clock import rfc3339
from gpuops.spine.ruletest import T0, case_event

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
YEAR_S = 365 * 86400.0


def _gpuops(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*gpuops_argv(), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def _json(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _sample(node: str, at: float, **gpu: Any) -> dict[str, Any]:
    """A telemetry sample of a healthy GPU 0, `gpu` fields laid over it."""
    return case_event({"kind": "telemetry", "node": node, "gpus": [{"index": 0, **gpu}]}, at)


def _heartbeat(node: str, at: float) -> dict[str, Any]:
    return case_event({"kind": "heartbeat", "node": node, "data": {"seq": int(at)}}, at)


def _write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _fleet(seconds: int, nodes: dict[str, dict[str, Any]], every: int = 10) -> list[dict[str, Any]]:
    """Each node's samples (with its GPU fields) and heartbeats, every `every` seconds."""
    events = []
    for at in range(0, seconds, every):
        for node, gpu in nodes.items():
            events += [_sample(node, at, **gpu), _heartbeat(node, at)]
    return events


def _config(tmp_path: Path, safety: dict[str, Any]) -> Path:
    path = tmp_path / "site.yml"
    path.write_text(yaml.safe_dump({"safety": safety}))
    return path


def test_an_event_dated_a_year_ahead_changes_nothing_and_is_refused_as_future(
    tmp_path: Path,
) -> None:
    events = _fleet(600, {"n1": {"power_limit_w": 300}, "n2": {}})
    plain = _json(
        _gpuops("replay", _write(tmp_path / "plain.jsonl", events), "--json", cwd=tmp_path)
    )
    ahead = _heartbeat("n2", 300 + YEAR_S)  # an agent whose clock is a year off, once
    skewed = [*events[:60], ahead, *events[60:]]
    rows = _json(
        _gpuops("replay", _write(tmp_path / "skewed.jsonl", skewed), "--json", cwd=tmp_path)
    )

    actions = [r for r in rows if r["kind"] == "action"]
    assert actions == [r for r in plain if r["kind"] == "action"]
    assert {(a["rule"], a["node"]) for a in actions} == {("power-limit-below-policy", "n1")}
    [refused] = [r for r in rows if r["kind"] == "refused"]
    assert (refused["reason"], refused["node"], refused["count"]) == ("future", "n2", 1)
    assert refused["first_line"] == 61
    assert "after the engine's clock (limit 300 s)" in refused["error"]
    assert rows[-1] == {**plain[-1], "future": 1}


def test_a_gap_in_the_recording_is_not_taken_for_the_future(tmp_path: Path) -> None:
    # The fleet's agents were down for an hour: what comes after is the present, not ahead.
    later = [{**e, "ts": rfc3339(T0 + 3600 + i * 10)} for i, e in enumerate(_fleet(60, {"n1": {}}))]
    rows = _json(
        _gpuops(
            "replay",
            _write(tmp_path / "gap.jsonl", [*_fleet(60, {"n1": {}}), *later]),
            "--json",
            cwd=tmp_path,
        )
    )
    assert not [r for r in rows if r["kind"] == "refused"]
    assert rows[-1]["events"] == 24


def test_a_node_past_its_attempt_cap_for_two_hours_is_one_escalation_line(
    tmp_path: Path,
) -> None:
    # The power limit stays low however often it is restored: two runs, then the cap.
    config = _config(tmp_path, {"attempt_cap": 2})
    recording = _write(tmp_path / "cap.jsonl", _fleet(3 * 3600, {"n1": {"power_limit_w": 300}}))
    rows = _json(_gpuops("--config", config, "replay", recording, "--json", cwd=tmp_path))

    assert [r["action"] for r in rows if r["kind"] == "action"] == ["power_limit.yml"] * 2
    [escalation] = [r for r in rows if r["kind"] == "escalation"]
    assert (escalation["rule"], escalation["node"], escalation["reason"]) == (
        "power-limit-below-policy",
        "n1",
        "attempt_cap",
    )
    assert escalation["count"] > 800, "every sample past the cap, folded into this one line"
    first, last = (T0 + 1830, T0 + 3 * 3600 - 10)
    assert (escalation["first"], escalation["last"]) == (rfc3339(first), rfc3339(last))
    [cooldowns] = [r for r in rows if r["kind"] == "drop"]
    assert (cooldowns["reason"], cooldowns["count"]) == ("cooldown", 178)

    table = _gpuops("--config", config, "replay", recording, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("needs-human") == 1
    assert "1 escalations" in table.stderr


def test_an_inventory_lacking_the_recordings_nodes_names_them(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"n1": {}}}}))
    events = _fleet(60, {"n1": {}, "n2": {}, "n3": {}})[:-1]  # n3's last heartbeat is not there
    recording = _write(tmp_path / "fleet.jsonl", events)
    rows = _json(_gpuops("replay", recording, "--inventory", inventory, "--json", cwd=tmp_path))

    unknown = {r["node"]: r["events"] for r in rows if r["kind"] == "unknown_node"}
    assert unknown == {"n2": 12, "n3": 11}
    assert rows[-1]["unknown_nodes"] == 2
    table = _gpuops("replay", recording, "--inventory", inventory, cwd=tmp_path)
    assert "nodes not in the inventory" in table.stdout
    assert "n2" in table.stdout and "n3" in table.stdout and "2 unknown nodes" in table.stderr


def _lowered(rules: Path, into: Path) -> Path:
    """The rules with gpu-overheat's threshold lowered from 3 C to 8 C below slowdown."""
    shutil.copytree(rules, into)
    path = into / "overheat.yml"
    text = path.read_text()
    assert text.count("temp_c >= temp_slowdown_c - 3") == 1
    path.write_text(text.replace("temp_c >= temp_slowdown_c - 3", "temp_c >= temp_slowdown_c - 8"))
    return into


def _hot(tmp_path: Path) -> Path:
    """n1 at 88 C (hot under either rule), n2 at 83 C (only under the lowered one)."""
    return _write(tmp_path / "hot.jsonl", _fleet(300, {"n1": {"temp_c": 88}, "n2": {"temp_c": 83}}))


def test_a_lowered_threshold_shows_the_added_actions_and_fails_the_gate(tmp_path: Path) -> None:
    base = ROOT / "rules"
    head = _lowered(base, tmp_path / "head")
    config = _config(tmp_path, {"breaker_share": 1.0})  # both drains go through
    args = ("--config", config, "replay", _hot(tmp_path), "--rules", head, "--against", base)

    done = _gpuops(*args, "--fail-on", "new-actions", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    at = rfc3339(T0 + 60)
    assert lines[1:] == [
        "n2",
        f"  + {at} gpu-overheat gpu 0: drain.yml",
        f"  + {at} gpu-overheat gpu 0: notify:chatops",
        "breaker trips with the old rules: none",
        "breaker trips with the new rules: none",
    ]
    assert "2 added, 0 removed, 0 changed; --fail-on new-actions: FAIL" in done.stderr

    rows = _json(_gpuops(*args, "--json", cwd=tmp_path))
    assert {(r["kind"], r["node"], r["head"]["action"]) for r in rows} == {
        ("added", "n2", "drain.yml"),
        ("added", "n2", "notify:chatops"),
    }

    # Under the default breaker (one node of two), n2's drain trips it instead of running:
    # no action is added, and the new trip fails the gate all the same.
    tripped = _gpuops(*args[2:], "--fail-on", "new-actions", cwd=tmp_path)
    assert tripped.returncode == 1, tripped.stdout + tripped.stderr
    assert "n2\n" not in tripped.stdout
    assert (
        f"breaker trips with the new rules: {at}: 2 nodes would lose capacity within 10m "
        "(limit 1)" in tripped.stdout
    )
    assert "0 added, 0 removed, 0 changed; --fail-on new-actions: FAIL" in tripped.stderr


def test_an_unchanged_rule_set_shows_no_difference_and_passes(tmp_path: Path) -> None:
    rules = ROOT / "rules"
    done = _gpuops(
        "replay",
        _hot(tmp_path),
        "--rules",
        rules,
        "--against",
        rules,
        "--fail-on",
        "any-change",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no difference in what the engine would do" in done.stdout
    assert "0 added, 0 removed, 0 changed; --fail-on any-change: pass" in done.stderr


def _git(site: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=site,
        check=True,
        capture_output=True,
    )


def test_diff_rules_reads_two_revisions_from_git(tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(ROOT / "rules", site / "rules")
    (site / "gpuops.yml").write_text(yaml.safe_dump({"safety": {"breaker_share": 1.0}}))
    _git(site, "init", "-q")
    _git(site, "add", "-A")
    _git(site, "commit", "-qm", "rules as shipped")
    shutil.rmtree(site / "rules")
    _lowered(ROOT / "rules", site / "rules")
    recording = _hot(tmp_path)

    dirty = _gpuops("diff-rules", "HEAD", recording, "--fail-on", "new-actions", cwd=site)
    assert dirty.returncode == 1, dirty.stdout + dirty.stderr
    assert "rules at the work tree against HEAD" in dirty.stdout
    assert "2 added, 0 removed, 0 changed" in dirty.stderr
    _git(site, "commit", "-qam", "overheat: drain 8 C below slowdown")
    committed = _gpuops("diff-rules", "HEAD~1..HEAD", recording, "--json", cwd=site)
    assert {(r["kind"], r["node"]) for r in _json(committed)} == {("added", "n2")}
    same = _gpuops("diff-rules", "HEAD", recording, "--fail-on", "any-change", cwd=site)
    assert same.returncode == 0, same.stdout + same.stderr
    missing = _gpuops("diff-rules", "no-such-rev", recording, cwd=site)
    assert missing.returncode == 1
    assert "cannot read rules at revision no-such-rev: fatal: Not a valid object" in missing.stderr


def test_rule_tests_run_under_the_sites_settings(tmp_path: Path) -> None:
    # gpuops.yml in the directory it runs in, as `run` reads it: an attempt cap of one.
    (tmp_path / "gpuops.yml").write_text(yaml.safe_dump({"safety": {"attempt_cap": 1}}))
    case = {
        "name": "a limit that will not stay restored goes to a person after one try",
        "events": [
            {
                "at": "0s",
                "kind": "telemetry",
                "node": "n1",
                "gpus": [{"index": 0, "power_limit_w": 300}],
                "repeat": {"every": "10s", "until": "40m"},
            }
        ],
        "expect": [
            {"rule": "power-limit-below-policy", "action": "power_limit.yml", "count": 1},
            {"rule": "power-limit-below-policy", "action": "needs-human"},
        ],
    }
    cases = tmp_path / "cap.yml"
    cases.write_text(yaml.safe_dump({"cases": [case]}))
    done = _gpuops("test-rules", cases, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 0 failed" in done.stdout
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    defaults = _gpuops("test-rules", cases, cwd=elsewhere)  # no gpuops.yml: a cap of five
    assert defaults.returncode == 1
    assert "'action': 'needs-human', 'rule': 'power-limit-below-policy'}, got 0" in defaults.stdout
