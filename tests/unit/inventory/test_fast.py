"""The fast inventory reader gives what Ansible's loader gives, or declines and Ansible reads.

Each test reads an inventory with both (gpuops.inventory.fast, and InventoryManager plus
VariableManager) and compares the whole `Inventory`: hosts, groups, children and every
host variable, the magic ones included.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpuops.bench.inventory import write_inventory
from gpuops.inventory import fast as inventory_fast
from gpuops.inventory.hosts import Inventory, load_inventory, load_inventory_ansible
from gpuops.inventory.sources import ini_value
from gpuops.sim.fleet import SimFleet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[3]


def _comparable(inv: Inventory) -> Inventory:
    """The inventory with each `groups` magic var's host lists sorted.

    Ansible lists the hosts of nested groups in the order it iterates a set of Group
    objects, which hash by id: that order changes from one run to the next.
    """
    hostvars = {
        host: {**hv, "groups": {g: sorted(hs) for g, hs in hv["groups"].items()}}
        for host, hv in inv.hostvars.items()
    }
    return Inventory(inv.path, inv.hosts, inv.groups, hostvars, inv.children)


def _assert_same(path: Path) -> Inventory:
    fast = Inventory(path=path, **inventory_fast.read(path)._asdict())
    reference = load_inventory_ansible(path)
    assert _comparable(fast) == _comparable(reference)
    return fast


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize(
    "inventory",
    [
        "inventories/example",
        "inventories/example/hosts.yml",
        "deploy/k8s/base/config/inventory.yml",
    ],
)
def test_every_inventory_in_the_repository_reads_the_same(inventory: str) -> None:
    # molecule/ has none: its scenarios give their hosts in molecule.yml, not in files.
    inv = _assert_same(ROOT / inventory)
    assert inv.hostvars["gpu-a01-01"]["bmc_address"] == "10.10.1.11"


def test_the_simulated_fleet_reads_the_same_with_a_second_source(fleet: SimFleet) -> None:
    (fleet.root / "inventory" / "ghost.yml").write_text(
        "all:\n  hosts:\n    node-ghost:\n      ansible_connection: ssh\n      ansible_port: 1\n"
    )
    inv = _assert_same(fleet.root / "inventory")
    assert inv.hostvars["node-001"]["ansible_python_interpreter"] == "{{ ansible_playbook_python }}"
    assert inv.hostvars["node-ghost"]["group_names"] == ["ungrouped"]


@pytest.mark.parametrize("ini", [False, True], ids=["yaml", "ini"])
def test_a_generated_fleet_reads_the_same(tmp_path: Path, ini: bool) -> None:
    inv = _assert_same(write_inventory(tmp_path, 70, ini=ini))
    assert inv.hostvars["gpu-00001"]["rack"] == "quarantine"  # host_vars/ beats the host line
    assert inv.hostvars["gpu-00002"]["drain_timeout_s"] == 480  # group_vars/slurm_nodes/
    assert inv.children["h200"] == {"rack_0000", "rack_0001", "rack_0002"}


@pytest.mark.slow
@pytest.mark.parametrize("ini", [False, True], ids=["yaml", "ini"])
def test_a_generated_thousand_host_fleet_reads_the_same(tmp_path: Path, ini: bool) -> None:
    assert len(_assert_same(write_inventory(tmp_path, 1000, ini=ini)).hosts) == 1000


PRECEDENCE = {
    "hosts.yml": """
all:
  vars: {v: all, only_all: 1, from_file: inventory}
  children:
    parent:
      vars: {v: parent, p: parent}
      children:
        child:
          vars: {v: child, w: child}
          hosts:
            n1: {v: host}
            n2:
        b_sibling:
          vars: {v: b_sibling, s: b}
          hosts: {n2: {}}
        a_sibling:
          vars: {v: a_sibling, s: a, ansible_group_priority: 10}
          hosts: {n2: {}, n3: {}}
""",
    "group_vars/all.yml": "from_file: group_vars_all\nw: group_vars_all\n",
    "group_vars/parent/10.yml": "p: parent_file\n",
    "group_vars/parent/20": "p: parent_file_20\n",
    "group_vars/parent/.hidden.yml": "p: hidden\n",
    "group_vars/b_sibling.yaml": "s: b_file\n",
    "host_vars/n3.json": '{"v": "host_vars", "n": 1e3}',
}

SHAPES: dict[str, tuple[dict[str, str], str]] = {
    "yaml-odd-corners": (
        {
            "inv.yaml": """
gpu:
  hosts:
    node-[01:03]:
      tpl: "{{ inventory_hostname }}-x"
    10.0.0.7:2222:
    gpu.example.com:
  children:
    rack_a:
    empty:
    strhosts:
      hosts: solo
  vars:
    base: &base {a: 1, b: [1, 2]}
    merged: {<<: *base, b: 3}
    when: 2024-05-01
    flag: yes
    none: ~
  junk: [ignored]
all:
  hosts:
    lone:
other: not-a-group
""",
        },
        "inv.yaml",
    ),
    "ini": (
        {
            "hosts": """# an INI inventory without an extension
bastion ansible_host=10.1.1.1

[gpu:children]
rack_a
rack_b

[rack_a]
n1 ansible_port=2201 tags="['a', 'b']" conf="{'x': 1}" ok=True
n[2:3] role='worker node'  # a comment
[rack_b]
n4

[rack_b:vars]
budget = 4000
label = two words
[gpu:vars]
budget=1000
ansible_group_priority=3
""",
        },
        "hosts",
    ),
    "directory": (
        {
            "10-base.yml": "all:\n  children:\n    gpu:\n      hosts: {n1: {x: 1}, n2: {}}\n",
            "20-more.ini": "[gpu]\nn1 x=2\nn3\n[spare]\nn9\n",
            "30-empty.yml": "",
            "README.md": "not an inventory\n",
            ".hidden": "[nope]\nn0\n",
            "sub/40-nested.json": '{"spare": {"hosts": {"n10": {"j": [1, 2]}}}}',
            "group_vars/gpu/main.yml": "g: 1\n",
            "host_vars/n2/a.yml": "h: a\n",
            "host_vars/n2/b.yml": "h: b\n",
        },
        ".",
    ),
    "precedence": (PRECEDENCE, "hosts.yml"),
}


@pytest.mark.parametrize(("files", "source"), SHAPES.values(), ids=SHAPES.keys())
def test_inventory_shapes_read_the_same(tmp_path: Path, files: dict[str, str], source: str) -> None:
    _write(tmp_path, files)
    assert _assert_same(tmp_path / source).hosts


def test_precedence_is_ansibles(tmp_path: Path) -> None:
    _write(tmp_path, PRECEDENCE)
    hv = _assert_same(tmp_path / "hosts.yml").hostvars
    assert hv["n1"]["v"] == "host" and hv["n1"]["p"] == "parent_file_20"
    assert hv["n1"]["from_file"] == "group_vars_all" and hv["n1"]["only_all"] == 1
    # group_vars/all.yml beats even a child group's vars in the inventory file.
    assert hv["n1"]["w"] == "group_vars_all"
    # Same depth: the priority orders siblings, then the name; group_vars/ beat the file.
    assert hv["n2"]["v"] == "a_sibling" and hv["n2"]["s"] == "b_file"
    assert hv["n3"]["v"] == "host_vars" and hv["n3"]["n"] == 1000.0


def test_a_directory_of_sources_reads_the_same(tmp_path: Path) -> None:
    _write(tmp_path, SHAPES["directory"][0])
    inv = _assert_same(tmp_path)
    assert inv.hosts == {"n1", "n2", "n3", "n9", "n10"}
    assert inv.hostvars["n1"]["x"] == 2 and inv.hostvars["n2"]["h"] == "b"
    assert inv.hostvars["n10"]["inventory_file"] == str(tmp_path / "sub" / "40-nested.json")


SCRIPT = '#!/bin/sh\necho \'{"gpu": {"hosts": ["s1"]}, "_meta": {"hostvars": {}}}\'\n'
DECLINED = {
    "script": ({"inv.sh": SCRIPT}, "executable"),
    "unsafe": ({"hosts.yml": "all:\n  hosts:\n    s1: {cmd: !unsafe '{{ x }}'}\n"}, "tags"),
    "plugin": ({"hosts.yml": "plugin: ansible.builtin.constructed\n"}, "inventory plugin"),
    "toml": ({"hosts.toml": "[gpu.hosts.s1]\n"}, "TOML"),
    "vault": (
        {
            "inv/hosts.yml": "gpu:\n  hosts: {s1: {}}\n",
            "inv/group_vars/gpu.yml": ("$ANSIBLE_VAULT;1.1;AES256\n6162\n"),
        },
        "vault",
    ),
}


@pytest.mark.parametrize(("files", "why"), DECLINED.values(), ids=DECLINED.keys())
def test_what_the_fast_reader_does_not_understand_it_declines(
    tmp_path: Path, files: dict[str, str], why: str
) -> None:
    _write(tmp_path, files)
    if (tmp_path / "inv.sh").exists():
        os.chmod(tmp_path / "inv.sh", 0o755)
    source = tmp_path / next(iter(files)).split("/")[0]
    with pytest.raises(inventory_fast.Unsupported, match=why):
        inventory_fast.read(source)


def test_a_declined_inventory_is_read_by_ansible_and_the_log_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path, {"inv.sh": SCRIPT, "hosts.yml": "all:\n  hosts: {n1: {}}\n"})
    os.chmod(tmp_path / "inv.sh", 0o755)
    with caplog.at_level(logging.INFO, logger="gpuops.inventory.hosts"):
        inv = load_inventory(tmp_path)
    assert inv.hosts == {"s1", "n1"} and inv.groups["gpu"] == {"s1"}
    assert "read with Ansible's loader (the fast reader declined: " in caplog.text
    assert "inv.sh is executable" in caplog.text
    caplog.clear()
    os.remove(tmp_path / "inv.sh")
    with caplog.at_level(logging.INFO, logger="gpuops.inventory.hosts"):
        assert load_inventory(tmp_path).hosts == {"n1"}
    assert "1 hosts read by the fast reader" in caplog.text


def test_a_setting_that_changes_how_vars_load_sends_it_to_ansible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hosts.yml").write_text("all:\n  hosts: {n1: {}}\n")
    monkeypatch.setenv("ANSIBLE_VARS_PLUGIN_STAGE", "inventory")
    with pytest.raises(inventory_fast.Unsupported, match="ANSIBLE_VARS_PLUGIN_STAGE set"):
        inventory_fast.read(tmp_path / "hosts.yml")


NAMES = st.sampled_from(["g0", "g1", "g2", "g3", "rack_a", "rack_b"])
HOSTS = st.sampled_from(["h0", "h1", "h2", "h3", "10.0.0.1", "h4.example.com"])
VARS = st.dictionaries(
    st.sampled_from(["a", "b", "c"]), st.integers(0, 9) | st.text("xy", max_size=2), max_size=3
)


@st.composite
def _trees(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A YAML inventory as a dict (groups nested by rank, so without loops) and group_vars."""
    names = draw(st.lists(NAMES, min_size=1, max_size=5, unique=True))
    bodies: dict[str, dict[str, Any]] = {}
    for rank, name in enumerate(names):
        body: dict[str, Any] = {"vars": draw(VARS)}
        if draw(st.booleans()):
            body["vars"]["ansible_group_priority"] = draw(st.integers(1, 3))
        body["hosts"] = {h: draw(VARS) or None for h in draw(st.sets(HOSTS, max_size=3))}
        kids = (
            draw(st.sets(st.sampled_from(names[rank + 1 :]), max_size=2))
            if rank + 1 < len(names)
            else set()
        )
        body["children"] = {k: None for k in sorted(kids)}
        bodies[name] = body
    tops = draw(st.sets(st.sampled_from(names), min_size=1))
    doc: dict[str, Any] = {
        "all": {"vars": draw(VARS), "children": {n: bodies[n] for n in names if n in tops}}
    }
    for n in names:
        if n not in tops:
            doc[n] = bodies[n]
    doc["all"]["hosts"] = {"h9": None}
    files = {n: draw(VARS) for n in draw(st.sets(st.sampled_from([*names, "all"]), max_size=3))}
    return doc, files


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_trees())
def test_generated_yaml_inventories_read_the_same(
    tree: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    doc, group_vars = tree
    # A fresh directory each time: Ansible caches group_vars lookups by path.
    with tempfile.TemporaryDirectory(prefix="gpuops-inv-") as tmp:
        root = Path(tmp)
        (root / "hosts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
        for name, found in group_vars.items():
            _write(root, {f"group_vars/{name}.yml": yaml.safe_dump(found)})
        _assert_same(root / "hosts.yml")


@settings(max_examples=200, deadline=None)
@given(st.text("ab1_0.-+'\"[]{}(),: jTrueNo/", max_size=10))
def test_ini_values_are_the_ini_plugins(text: str) -> None:
    from ansible._internal._datatag._tags import Origin
    from ansible.plugins.inventory.ini import InventoryModule

    plugin = InventoryModule()
    plugin._origin = Origin(path="/inventory", line_num=1)
    try:
        expected = plugin._parse_value(text)
    except Exception as exc:  # literal_eval's other errors fail the ini plugin's read too
        with pytest.raises(type(exc)):
            ini_value(text)
        return
    assert ini_value(text) == expected
