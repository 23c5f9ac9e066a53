"""The playbook catalogue's roles: what the engine itself runs a playbook for."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.catalog import Role, load_catalog
from gpuops.errors import ConfigError

from tests.conftest import ROOT


def _catalog(tmp_path: Path, body: str) -> Path:
    books = tmp_path / "playbooks"
    books.mkdir()
    for name in ("a.yml", "b.yml"):
        (books / name).write_text("---\n- hosts: all\n  tasks: []\n")
    (books / "catalog.yml").write_text(body)
    return books


def test_the_shipped_catalogue_names_the_power_and_baseline_playbooks() -> None:
    catalog = load_catalog(ROOT / "playbooks")
    assert catalog.for_role(Role.POWER_LIMIT) == "power_limit.yml"
    assert catalog.for_role(Role.BASELINE) == "baseline.yml"
    assert catalog.has_role("power_limit.yml", Role.POWER_LIMIT)
    assert not catalog.has_role("gpu_reset.yml", Role.POWER_LIMIT)


def test_a_role_nobody_has_says_what_to_add(tmp_path: Path) -> None:
    books = _catalog(tmp_path, "playbooks:\n  a.yml: {effect: fix}\n")
    with pytest.raises(ConfigError, match=r"no playbook with role: power_limit; add `role: power"):
        load_catalog(books).for_role(Role.POWER_LIMIT)


def test_two_playbooks_with_one_role_are_refused(tmp_path: Path) -> None:
    body = (
        "playbooks:\n"
        "  a.yml: {effect: fix, role: baseline}\n"
        "  b.yml: {effect: fix, role: baseline}\n"
    )
    with pytest.raises(ConfigError, match="more than one playbook has role: baseline"):
        load_catalog(_catalog(tmp_path, body))
