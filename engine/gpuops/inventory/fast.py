"""A fast inventory loader, equal to Ansible's on the inventories gpuops meets.

Ansible's InventoryManager and VariableManager take ~3 ms and ~41 KB per host: 12,000
hosts cost 29 s and 560 MB before the engine is ready. This reads YAML (with libyaml)
and INI inventory files, directories of them and their group_vars/ and host_vars/, and
applies Ansible's variable precedence itself: all < parent group < child group < host,
inventory files < group_vars/ < host vars < host_vars/, and the magic vars on top.
Templated values stay unrendered strings, as Ansible's loader leaves them.

It reads only under Ansible's default settings for these; an ansible.cfg or environment
that changes how inventories or variables are read, and any file it does not understand
(scripts, plugin configs, vault, `!unsafe`, TOML, a file Ansible would skip with a
warning), raise `Unsupported`: the caller then uses Ansible's loader.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from gpuops.inventory.sources import (
    NOT_YAML,
    Data,
    Group,
    Host,
    Unsupported,
    ancestors,
    load_text,
    load_yaml,
    read_source,
)

__all__ = ["Parts", "Unsupported", "read"]

_DEFAULTS: dict[str, Any] = {
    "DEFAULT_HASH_BEHAVIOUR": "replace",
    "INVENTORY_ENABLED": ["host_list", "script", "auto", "yaml", "ini", "toml"],
    "VARIABLE_PLUGINS_ENABLED": ["host_group_vars"],
    "RUN_VARS_PLUGINS": "demand",
    "CACHE_PLUGIN": "memory",
    "INJECT_FACTS_AS_VARS": True,
    "VARIABLE_PRECEDENCE": [
        "all_inventory",
        "groups_inventory",
        "all_plugins_inventory",
        "all_plugins_play",
        "groups_plugins_inventory",
        "groups_plugins_play",
    ],
}
# Options of the yaml inventory and host_group_vars plugins, which ansible.constants lacks.
_PLUGIN_ENV = ("ANSIBLE_INVENTORY_PLUGIN_EXTS", "ANSIBLE_VARS_PLUGIN_STAGE")
_PLUGIN_SECTIONS = ("inventory_plugin_yaml", "vars_host_group_vars")


class Parts(NamedTuple):
    """What `gpuops.inventory.hosts.Inventory` holds, as Ansible's loader would fill it."""

    hosts: frozenset[str]
    groups: dict[str, frozenset[str]]
    hostvars: dict[str, dict[Any, Any]]
    children: dict[str, frozenset[str]]


def read(path: Path) -> Parts:
    """Read the inventory at `path` (file or directory); `Unsupported` says why not."""
    with _collector_paused():
        return _read(path)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while reading.

    Everything read stays alive, so each collection rescans a growing heap for nothing:
    with it running, libyaml's node graph for 12,500 hosts takes 2.5 times as long.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _read(path: Path) -> Parts:
    import ansible.constants as C

    _check_settings(C)
    source = str(path)
    if "," in source:
        raise Unsupported("a ',' in the path makes it a host list for Ansible")
    data = Data()
    read_source(data, _absolute(source), C.YAML_FILENAME_EXTENSIONS, _ignored(C))
    if not data.hosts:
        raise Unsupported("no hosts (Ansible's loader says why)")
    for name in [*data.groups, *data.hosts]:
        if name.startswith(os.sep) or os.sep in name:
            raise Unsupported(f"{name!r} holds {os.sep!r}: its group_vars/host_vars path")
    host_groups = _reconcile(data)
    return _parts(data, host_groups, _VarsFiles(source, C.YAML_FILENAME_EXTENSIONS), C.CONFIG_FILE)


def _check_settings(C: Any) -> None:
    """Refuse settings under which Ansible would read inventories or vars differently."""
    for name, want in _DEFAULTS.items():
        if getattr(C, name) != want:
            raise Unsupported(f"Ansible setting {name} is {getattr(C, name)!r}")
    if C.TRANSFORM_INVALID_GROUP_CHARS not in ("never", "ignore"):
        raise Unsupported("TRANSFORM_INVALID_GROUP_CHARS renames groups")
    if C.config.get_config_value("DUPLICATE_YAML_DICT_KEY") == "error":
        raise Unsupported("DUPLICATE_YAML_DICT_KEY is error")
    if set_env := [e for e in _PLUGIN_ENV if os.environ.get(e)]:
        raise Unsupported(f"{', '.join(set_env)} set")
    for folder in C.DEFAULT_VARS_PLUGIN_PATH:
        if os.path.isdir(folder) and any(n.endswith(".py") for n in os.listdir(folder)):
            raise Unsupported(f"vars plugins in {folder}")
    if C.CONFIG_FILE:
        _check_config_file(C.CONFIG_FILE)
    from ansible import context

    if context.CLIARGS:
        raise Unsupported("Ansible command-line arguments are set in this process")


def _check_config_file(path: str) -> None:
    import configparser

    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(path)
    except configparser.Error as exc:
        raise Unsupported(f"{path}: {exc}") from exc
    if found := [s for s in _PLUGIN_SECTIONS if parser.has_section(s)]:
        raise Unsupported(f"{path} configures {', '.join(found)}")


def _absolute(source: str) -> str:
    """Ansible's unfrackpath(follow=False): user, variables and `..` resolved, no symlinks."""
    expanded = os.path.expanduser(os.path.expandvars(source))
    return os.path.normpath(os.path.join(os.getcwd(), expanded))


def _ignored(C: Any) -> re.Pattern[str]:
    """InventoryManager's IGNORED: names skipped in an inventory directory."""
    always = [r"^\.", "^host_vars$", "^group_vars$", "^vars_plugins$"]
    exts = [f"{re.escape(x)}$" for x in C.INVENTORY_IGNORE_EXTS]
    return re.compile("|".join(always + list(C.INVENTORY_IGNORE_PATTERNS) + exts))


def _reconcile(data: Data) -> dict[str, set[Group]]:
    """InventoryData.reconcile_inventory: top groups under `all`, lone hosts `ungrouped`.

    Gives each host's groups, ancestors included (Host.get_groups).
    """
    top, ungrouped = data.groups["all"], data.groups["ungrouped"]
    if top.parents or ungrouped.children or ungrouped.parents != [top]:
        raise Unsupported("`all` or `ungrouped` is nested")
    for group in list(data.groups.values()):
        if group is not top and not group.parents:
            data.link(top, group)
    host_groups = _host_groups(data)
    for name, mine in host_groups.items():
        if ungrouped in mine:
            if mine - {top, ungrouped}:
                del ungrouped.hosts[name]
                mine.discard(ungrouped)
        elif not mine - {top}:
            ungrouped.hosts[name] = data.hosts[name]
            mine |= {top, ungrouped}
    return host_groups


def _host_groups(data: Data) -> dict[str, set[Group]]:
    """Each host's groups with their ancestors."""
    closure: dict[Group, frozenset[Group]] = {}
    out: dict[str, set[Group]] = {name: set() for name in data.hosts}
    for group in data.groups.values():
        closure[group] = frozenset({group, *ancestors(group)})
        for name in group.hosts:
            out[name] |= closure[group]
    return out


def _depths(data: Data) -> dict[Group, int]:
    """A group's depth: the longest path to it from `all` (what Ansible's updates reach)."""
    depth: dict[Group, int] = {}

    def walk(group: Group) -> int:
        if group not in depth:
            depth[group] = max((walk(p) + 1 for p in group.parents), default=0)
        return depth[group]

    for group in data.groups.values():
        walk(group)
    return depth


def _members(group: Group) -> list[str]:
    """Group.get_hosts: its hosts and its descendants', level by level, once each."""
    out: dict[str, None] = {}
    level, seen = [group], {group}
    while level:
        nxt: list[Group] = []
        for g in level:
            out.update(dict.fromkeys(g.hosts))
            for child in g.children:
                if child not in seen:
                    seen.add(child)
                    nxt.append(child)
        level = nxt
    return list(out)


class _VarsFiles:
    """group_vars/ and host_vars/ beside the inventory and in the working directory."""

    def __init__(self, source: str, exts: list[str]) -> None:
        where = source if os.path.isdir(source) else os.path.dirname(source)
        self.inventory = os.path.realpath(_basedir(where))
        self.play = os.path.realpath(os.getcwd())
        self._exts = ["", *exts]
        self._cache: dict[tuple[str, str, str], dict[Any, Any]] = {}
        self._listed: dict[str, frozenset[str]] = {}

    def get(self, base: str, subdir: str, name: str) -> dict[Any, Any]:
        """The vars files of one group or host under `base`, merged in Ansible's order."""
        key = (base, subdir, name)
        if key not in self._cache:
            self._cache[key] = self._load(os.path.join(base, subdir), name)
        return self._cache[key]

    def _load(self, folder: str, name: str) -> dict[Any, Any]:
        merged: dict[Any, Any] = {}
        for path in self._find(folder, name):
            found = load_yaml(load_text(path), path)
            if found is NOT_YAML:
                raise Unsupported(f"{path} does not parse")
            if found and not isinstance(found, dict):
                raise Unsupported(f"{path} is not a mapping")
            merged.update(found or {})
        return merged

    def _find(self, folder: str, name: str) -> list[str]:
        """DataLoader.find_vars_files: the first of NAME, NAME.yml ... that exists."""
        if folder not in self._listed:
            names = os.listdir(folder) if os.path.isdir(folder) else []
            self._listed[folder] = frozenset(names)
        for ext in self._exts:
            if name + ext in self._listed[folder]:
                path = os.path.join(folder, name + ext)
                return self._walk(path) if os.path.isdir(path) else [path]
        return []

    def _walk(self, folder: str) -> list[str]:
        found: list[str] = []
        for name in sorted(os.listdir(folder)):
            if name.startswith(".") or name.endswith("~"):
                continue
            path, ext = os.path.join(folder, name), os.path.splitext(name)[1]
            if os.path.isdir(path) and not ext:
                found.extend(self._walk(path))
            elif os.path.isfile(path) and (not ext or ext in self._exts):
                found.append(path)
        return found


def _basedir(path: str) -> str:
    """ansible.utils.path.basedir for a directory, `''` meaning the working directory."""
    return os.path.abspath(path or os.getcwd())


def _parts(
    data: Data, host_groups: dict[str, set[Group]], files: _VarsFiles, config_file: str | None
) -> Parts:
    members = {name: _members(g) for name, g in data.groups.items()}
    magic = {
        "playbook_dir": os.path.abspath("."),
        "ansible_playbook_python": sys.executable,
        "ansible_config_file": config_file,
        "groups": members,
        "ansible_version": "Unknown",
    }
    depth = _depths(data)
    layers: dict[frozenset[Group], dict[Any, Any]] = {}
    hostvars: dict[str, dict[Any, Any]] = {}
    for name, groups in host_groups.items():
        key = frozenset(groups)
        if key not in layers:
            order = sorted(
                groups - {data.groups["all"]}, key=lambda g: (depth[g], g.priority, g.name)
            )
            layers[key] = _group_layer(data.groups["all"], order, files)
        hostvars[name] = _host_vars(data.hosts[name], order_names(groups), layers[key], files)
        hostvars[name].update(magic)
    return Parts(
        hosts=frozenset(data.hosts),
        groups={n: frozenset(h) for n, h in members.items() if n not in ("all", "ungrouped")},
        hostvars=hostvars,
        children={
            n: frozenset(c.name for c in g.children) for n, g in data.groups.items() if g.children
        },
    )


def order_names(groups: set[Group]) -> list[str]:
    """A host's `group_names`: its groups but `all`, sorted."""
    return sorted(g.name for g in groups if g.name != "all")


def _group_layer(top: Group, order: list[Group], files: _VarsFiles) -> dict[Any, Any]:
    """VariableManager's VARIABLE_PRECEDENCE entries, in their default order."""
    out = dict(top.vars)
    for group in order:
        out.update(group.vars)
    for base in (files.inventory, files.play):
        out.update(files.get(base, "group_vars", "all"))
    for base in (files.inventory, files.play):
        for group in order:
            out.update(files.get(base, "group_vars", group.name))
    return out


def _host_vars(
    host: Host, group_names: list[str], layer: dict[Any, Any], files: _VarsFiles
) -> dict[Any, Any]:
    out = dict(layer)
    out.update(host.vars)
    out["inventory_hostname"] = host.name
    out["inventory_hostname_short"] = _short(host.name)
    out["group_names"] = group_names
    for base in (files.inventory, files.play):
        out.update(files.get(base, "host_vars", host.name))
    out["ansible_facts"] = {}
    return out


def _short(name: str) -> str:
    """inventory_hostname_short: up to the first dot, unless the name is an IP address."""
    if "." not in name:
        return name
    from ansible.parsing.utils.addresses import patterns

    if patterns["ipv4"].match(name) or patterns["ipv6"].match(name):
        return name
    return name.split(".")[0]
