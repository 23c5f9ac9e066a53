"""`gpuops init`: a site with every part, refusing to write over a non-empty directory."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from gpuops import shipped
from gpuops.errors import ConfigError
from gpuops.ops.site import init_site, settings_template
from gpuops.settings import Settings, load_settings

from tests.support import gpuops_argv

GPUOPS = gpuops_argv()


def test_init_writes_a_site_with_every_part(tmp_path: Path) -> None:
    made = init_site(tmp_path / "site")
    site = made.root
    for part in ("rules", "playbooks", "schemas", "inventories/example", "tests/rules"):
        copied = {p.relative_to(site / part) for p in (site / part).rglob("*") if p.is_file()}
        origin = shipped.shipped(part)
        assert {p.relative_to(origin) for p in origin.rglob("*.y*ml")} <= copied, part
    assert (site / "recordings" / "example.jsonl").read_bytes() == (
        shipped.shipped("examples") / "recording.jsonl"
    ).read_bytes()
    readme = (site / "playbooks" / "README.md").read_text()
    digest = shipped.tree_digest(shipped.shipped("playbooks"))
    assert f"gpuops {shipped.version()} (playbooks digest {digest})" in readme
    assert shipped.tree_digest(site / "playbooks") == digest, "an untouched copy hashes alike"
    ci = yaml.safe_load((site / ".github" / "workflows" / "gpuops.yml").read_text())
    steps = [s.get("run") for s in ci["jobs"]["rules"]["steps"]]
    assert "gpuops validate" in steps and "gpuops test-rules" in steps
    [gate] = [s for s in ci["jobs"]["rules"]["steps"] if s.get("name") == "gpuops diff-rules"]
    assert 'gpuops diff-rules "$base" "$recording" --fail-on new-actions' in gate["run"]
    assert ci["jobs"]["rules"]["steps"][0]["with"] == {"fetch-depth": 0}, "the base is read"
    assert f'pip install "gpuops=={shipped.version()}"' in steps
    assert "gpuops init" in (site / "README.md").read_text()
    assert "$" not in (site / "README.md").read_text(), "every template value was filled in"


def test_gitlab_ci_is_written_on_request(tmp_path: Path) -> None:
    site = init_site(tmp_path / "site", ci="gitlab").root
    job = yaml.safe_load((site / ".gitlab-ci.yml").read_text())["gpuops-rules"]
    assert job["script"][1:3] == ["gpuops validate", "gpuops test-rules"]
    assert 'gpuops diff-rules "$base" "$recording" --fail-on new-actions' in job["script"][3]
    assert job["variables"] == {"GIT_DEPTH": 0}
    assert not (site / ".github").exists()


def _git(site: Path, *args: str) -> None:
    who = ["-c", "user.name=site", "-c", "user.email=site@example.com"]
    subprocess.run(["git", *who, *args], cwd=site, check=True, capture_output=True, timeout=60)


def test_the_ci_gate_fails_a_rule_change_that_would_act_more_on_the_kept_recording(
    tmp_path: Path,
) -> None:
    site = init_site(tmp_path / "site").root
    _git(site, "init", "-q")
    _git(site, "add", "-A")
    _git(site, "commit", "-qm", "the site as init wrote it")
    ci = yaml.safe_load((site / ".github" / "workflows" / "gpuops.yml").read_text())
    [gate] = [
        s["run"] for s in ci["jobs"]["rules"]["steps"] if s.get("name") == "gpuops diff-rules"
    ]
    # The job as GitHub runs it (bash -e), the base revision the expression would give,
    # and `gpuops` this checkout's.
    script = (
        "gpuops() { "
        + shlex.join(GPUOPS)
        + ' "$@"; }\n'
        + gate.replace("${{ github.event.pull_request.base.sha || github.event.before }}", "HEAD~1")
    )
    overheat = site / "rules" / "overheat.yml"
    hot = overheat.read_text().replace("temp_c >= temp_slowdown_c - 3", "temp_c >= 20")
    for change, rules in (
        ("reword a comment", "# reworded\n" + overheat.read_text()),
        ("drain at 20 C", hot),
    ):
        overheat.write_text(rules)
        _git(site, "commit", "-qam", change)
        done = subprocess.run(
            ["bash", "-e", "-c", script], cwd=site, capture_output=True, text=True, timeout=120
        )
        if change == "reword a comment":
            assert done.returncode == 0, done.stdout + done.stderr
            assert "no difference in what the engine would do" in done.stdout
    assert done.returncode == 1, done.stdout + done.stderr
    assert "gpu-a01-02\n  + 2027-01-15T08:01:00.000Z gpu-overheat gpu 5: drain.yml" in done.stdout
    assert "--fail-on new-actions: FAIL" in done.stderr


def test_init_refuses_a_non_empty_directory_and_leaves_it_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(ConfigError, match=r"is not empty \(notes.txt\).*--force"):
        init_site(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    done = subprocess.run(
        [*GPUOPS, "init", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"error: {tmp_path} is not empty (notes.txt)" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_init_with_force_writes_beside_what_is_there(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "local.yml").write_text("rules: []\n")
    init_site(tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    assert (tmp_path / "rules" / "local.yml").exists() and (tmp_path / "rules" / "xid.yml").exists()


def test_init_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "site").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        init_site(tmp_path / "site", force=True)


def test_the_settings_file_lists_every_default(tmp_path: Path) -> None:
    text = settings_template()
    uncommented = [line[2:] for line in text.splitlines() if line.startswith("# ") and line.strip()]
    config = tmp_path / "gpuops.yml"
    config.write_text("\n".join(uncommented) + "\n")
    loaded = load_settings(config, {}, {})
    paths = {"state_dir", "rules_dir", "playbooks_dir", "inventory"}
    assert loaded.model_dump(exclude=paths) == Settings().model_dump(exclude=paths)
    assert (loaded.rules_dir, loaded.inventory) == (Path("rules"), Path("inventories/sim"))
    for section in ("nats", "safety", "chatops", "drift"):
        assert f"\n# {section}:" in text, section
    assert set(yaml.safe_load(config.read_text())) == set(Settings.model_fields) - {"state_dir"}
