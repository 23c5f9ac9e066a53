"""The Ansible inventory, read with Ansible's own parser: which hosts exist, their groups."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuops import subjects
from gpuops.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Inventory:
    """Hosts and their groups and variables; an event about any other host is never acted upon."""

    path: Path
    hosts: frozenset[str]
    groups: dict[str, frozenset[str]]
    hostvars: dict[str, dict[str, Any]]

    def __contains__(self, node: object) -> bool:
        return node in self.hosts

    def group_hosts(self, group: str) -> frozenset[str]:
        """Hosts in `group` (`all` for every host)."""
        if group == "all":
            return self.hosts
        return self.groups.get(group, frozenset())


def load_inventory(path: Path) -> Inventory:
    """Parse any inventory Ansible can (YAML, INI, directories, host_vars)."""
    if not path.exists():
        raise ConfigError(
            f"inventory {path} does not exist: pass --inventory, or create a simulated "
            "fleet with `gpuops simulate` (it writes inventories/sim)"
        )
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
    check_subject_tokens(names, path)
    hostvars = {h.name: dict(variables.get_vars(host=h, include_hostvars=False)) for h in hosts}
    return Inventory(path=path, hosts=names, groups=groups, hostvars=hostvars)


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
