"""The Ansible inventory: which hosts exist, their groups and variables.

Read by gpuops.inventory.fast where it can (12,500 hosts in about a CPU-second), else by
Ansible's own parser; both give the same `Inventory`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuops import subjects
from gpuops.errors import ConfigError
from gpuops.inventory import fast as inventory_fast

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Inventory:
    """Hosts and their groups and variables; an event about any other host is never acted upon."""

    path: Path
    hosts: frozenset[str]
    groups: dict[str, frozenset[str]]
    hostvars: dict[str, dict[str, Any]]
    children: dict[str, frozenset[str]] = field(default_factory=dict)  # group -> child groups

    def __contains__(self, node: object) -> bool:
        return node in self.hosts

    def group_hosts(self, group: str) -> frozenset[str]:
        """Hosts in `group` (`all` for every host)."""
        if group == "all":
            return self.hosts
        return self.groups.get(group, frozenset())


def k8s_nodes(inventory: Inventory) -> dict[str, str]:
    """Each host's Kubernetes node name (its `k8s_node_name`, else its own, as the playbooks
    read it), mapped back to the host.

    Two hosts claiming one node name are refused, naming both: the playbooks of either would
    drain and fence the same node, and a taint on it could not be put on one of them.
    Refused, not skipped as unknown: that would drop the driver's word on a faulty GPU with
    a log line nobody reads. A templated name is refused too: read without Ansible, it is
    not the name the playbooks use.
    """
    hosts: dict[str, str] = {}
    for host in sorted(inventory.hosts):
        name = inventory.hostvars.get(host, {}).get("k8s_node_name") or host
        if not isinstance(name, str) or "{{" in name or "{%" in name:
            raise ConfigError(
                f"inventory {inventory.path}: host {host!r} has k8s_node_name {name!r}: gpuops "
                "reads it without Ansible's templating; write the node's name as Kubernetes has it"
            )
        other = hosts.setdefault(name, host)
        if other != host:
            raise ConfigError(
                f"inventory {inventory.path}: hosts {other!r} and {host!r} are both the "
                f"Kubernetes node {name!r} (k8s_node_name, or the host's own name); give each "
                "host its own node"
            )
    return hosts


def load_inventory(path: Path) -> Inventory:
    """Parse any inventory Ansible can (YAML, INI, directories, host_vars), fast where it can."""
    if not path.exists():
        raise ConfigError(
            f"inventory {path} does not exist: pass --inventory, or create a simulated "
            "fleet with `gpuops simulate` (it writes inventories/sim)"
        )
    if not (path.is_file() or path.is_dir()):
        raise ConfigError(f"inventory {path} is neither a file nor a directory of inventories")
    start = time.perf_counter()
    try:
        parts = inventory_fast.read(path)
    except inventory_fast.Unsupported as why:
        log.info(
            "inventory %s: read with Ansible's loader (the fast reader declined: %s)", path, why
        )
        return load_inventory_ansible(path)
    check_subject_tokens(parts.hosts, path)
    took = time.perf_counter() - start
    log.info(
        "inventory %s: %d hosts read by the fast reader in %.2f s", path, len(parts.hosts), took
    )
    return Inventory(path=path, **parts._asdict())


def load_inventory_ansible(path: Path) -> Inventory:
    """Parse the inventory with Ansible's InventoryManager and VariableManager (the reference)."""
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    manager = InventoryManager(loader=loader, sources=[str(path)])
    variables = VariableManager(loader=loader, inventory=manager)
    hosts = manager.get_hosts()
    groups = {
        name: frozenset(h.name for h in group.get_hosts())
        for name, group in manager.groups.items()
        if name not in ("all", "ungrouped")
    }
    names = frozenset(h.name for h in hosts)
    if not names:
        raise ConfigError(
            f"inventory {path}: {_why_no_hosts(path, loader)}; fix it (check it with "
            f"`ansible-inventory -i {path} --graph`) or pass --inventory"
        )
    check_subject_tokens(names, path)
    hostvars = {h.name: dict(variables.get_vars(host=h, include_hostvars=False)) for h in hosts}
    children = {
        name: frozenset(c.name for c in group.child_groups)
        for name, group in manager.groups.items()
        if group.child_groups
    }
    return Inventory(path=path, hosts=names, groups=groups, hostvars=hostvars, children=children)


def _why_no_hosts(path: Path, loader: Any) -> str:
    """What the parser said about a source that gave no hosts (Ansible only warns).

    Each file is read again by the plugin its name calls for (YAML for .yml, .yaml and
    .json, INI otherwise); the first error is the cause. None: it parses, with no hosts.
    """
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if _source(p))
    for file in files:
        error = _parse_error(file, loader)
        if error:
            return f"cannot parse {file}: {error}"
    return "it defines no hosts"


def _source(path: Path) -> bool:
    """A file Ansible would read as an inventory source in an inventory directory."""
    return path.is_file() and not path.name.startswith(".") and not path.name.endswith("~")


def _parse_error(file: Path, loader: Any) -> str | None:
    from ansible.inventory.data import InventoryData
    from ansible.plugins.loader import inventory_loader

    yaml_like = file.suffix in (".yml", ".yaml", ".json")
    plugin = inventory_loader.get("yaml" if yaml_like else "ini")
    if yaml_like:
        try:
            yaml.safe_load(file.read_text(errors="replace"))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            return f"{where}{exc.context + ', ' if exc.context else ''}{exc.problem}"
        except yaml.YAMLError as exc:
            return " ".join(str(exc).split())
    try:
        plugin.parse(InventoryData(), loader, str(file))
    except Exception as exc:  # any parser failure is the message we want to show
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


def check_subject_tokens(hosts: frozenset[str], path: Path) -> None:
    """Refuse hosts that share a subject token: each could publish as the other.

    `gpu.a1` and `gpu_a1` both publish on `gpuops.telemetry.gpu_a1`, so the subject
    check could not tell them apart and events of one would act on the other.
    """
    seen: dict[str, str] = {}
    for host in sorted(hosts):
        other = seen.setdefault(subjects.token(host), host)
        if other != host:
            raise ConfigError(
                f"inventory {path}: hosts {other!r} and {host!r} share the subject token "
                f"{subjects.token(host)!r} (dots and other characters become '_'); "
                "rename one of them"
            )
