"""An inventory with no hosts, or one Ansible cannot parse, is an error with the parser's
message: Ansible itself only warns, and an engine would run watching nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.errors import ConfigError
from gpuops.inventory.hosts import load_inventory


@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        ("empty.yml", "all:\n  hosts: {}\n", "it defines no hosts"),
        ("empty.ini", "# nobody yet\n", "it defines no hosts"),
        (
            "broken.yml",
            "all:\n  hosts:\n    node-001: [\n",
            "cannot parse {path}: line 4, column 1: while parsing a flow node",
        ),
        (
            "groups.yml",
            "all:\n  children: [gpu]\n",
            'cannot parse {path}: Invalid "children" entry for "all" group',
        ),
        ("broken.ini", "[gpu\nnode-001\n", "cannot parse {path}: Failed to parse inventory"),
    ],
)
def test_an_inventory_without_hosts_is_refused_with_the_parsers_message(
    tmp_path: Path, name: str, text: str, why: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_inventory(path)
    assert str(caught.value).startswith(f"inventory {path}: {why.format(path=path)}")


def test_a_directory_names_the_file_that_does_not_parse(tmp_path: Path) -> None:
    (tmp_path / "a.yml").write_text("all:\n  hosts: {}\n")
    (tmp_path / "b.ini").write_text("[gpu\n")
    with pytest.raises(ConfigError, match=r"cannot parse .*/b\.ini: Failed to parse"):
        load_inventory(tmp_path)


def test_a_good_inventory_loads(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yml"
    path.write_text("all:\n  hosts:\n    node-001:\n")
    assert load_inventory(path).hosts == {"node-001"}


def test_a_device_or_fifo_is_no_inventory_and_says_so() -> None:
    with pytest.raises(ConfigError, match="inventory /dev/null is neither a file nor a directory"):
        load_inventory(Path("/dev/null"))
