"""Defaults come from the site directory first, then from the copies shipped with gpuops."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from gpuops import shipped
from gpuops.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_directory_gets_the_shipped_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for part in ("rules", "playbooks", "tests/rules"):
        found = shipped.locate(part)
        assert found.origin == "shipped" and found.path == shipped.shipped(part)
        assert any(found.path.iterdir()), f"the shipped {part} is not empty"
    assert shipped.site_settings() is None
    settings = Settings()
    assert settings.rules_dir == shipped.shipped("rules")
    assert settings.playbooks_dir == shipped.shipped("playbooks")
    # The example inventory's hosts are made up: the default stays in the site.
    assert settings.inventory == tmp_path / "inventories" / "sim"


def test_a_site_folder_wins_over_the_shipped_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rules").mkdir()
    monkeypatch.chdir(tmp_path)
    rules, books = shipped.locate("rules"), shipped.locate("playbooks")
    assert (rules.origin, rules.path) == ("site", (tmp_path / "rules").resolve())
    assert books.origin == "shipped", "a site without playbooks/ uses the shipped ones"
    assert rules.describe().startswith("site rules/ (")
    assert books.describe().startswith(f"shipped playbooks/ of gpuops {shipped.version()} (")
    assert Settings().rules_dir == (tmp_path / "rules").resolve()


def test_the_site_settings_file_is_read_when_none_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gpuops.yml").write_text("dry_run: true\nsafety: {attempt_cap: 2}\n")
    named = tmp_path / "other.yml"
    named.write_text("dry_run: false\n")
    monkeypatch.chdir(tmp_path)
    assert shipped.site_settings() == tmp_path / "gpuops.yml"
    site = load_settings(None, {}, {})
    assert site.dry_run is True and site.safety.attempt_cap == 2
    assert load_settings(named, {}, {}).dry_run is False, "--config wins over ./gpuops.yml"
    from_env = load_settings(None, {}, {"GPUOPS_CONFIG": str(named)})
    assert from_env.dry_run is False, "GPUOPS_CONFIG wins over ./gpuops.yml"


def test_the_checkout_is_the_shipped_copy_when_not_built_into_a_wheel() -> None:
    assert not (ROOT / "gpuops" / "_shipped").exists()
    assert shipped.root() == ROOT


def test_the_playbooks_digest_follows_content_not_the_readme(tmp_path: Path) -> None:
    copy = tmp_path / "playbooks"
    shutil.copytree(shipped.shipped("playbooks"), copy)
    original = shipped.tree_digest(shipped.shipped("playbooks"))
    (copy / "README.md").write_text("copied from gpuops\n")
    assert shipped.tree_digest(copy) == original
    (copy / "drain.yml").write_text((copy / "drain.yml").read_text() + "# local change\n")
    assert shipped.tree_digest(copy) != original


def test_the_wheel_build_ships_the_parts_gpuops_looks_for() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text())
    parts = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "PARTS" for t in node.targets)
    )
    assert tuple(parts) == shipped.PARTS
    for part in parts:
        assert (ROOT / part).exists(), f"setup.py ships {part}, which the repository lacks"
