"""Inventory files read the way Ansible's yaml and ini plugins read them, without Ansible.

`Data` keeps InventoryData's rules (a host's first source, ports, group links, the
`ungrouped` group); `read_source` walks a file or directory as InventoryManager does and
tries, per file, what Ansible's plugins would (yaml, then ini). Anything those plugins
would hand to another plugin or only warn about raises `Unsupported`: the caller then
reads the whole inventory with Ansible, so the result never depends on a guess here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import warnings
from dataclasses import dataclass, field
from typing import Any

import yaml

from gpuops.inventory import yamlfile as inventory_yaml

SECTIONS = ("vars", "children", "hosts")
_INI_SECTION = re.compile(r"^\[([^:\]\s]+)(?::(\w+))?\]\s*(?:\#.*)?$")
_INI_GROUP = re.compile(r"^([^:\]\s]+)\s*(?:\#.*)?$")
# A host line shlex would split just as str.split does: no quotes, escapes, comments
# or whitespace but spaces and tabs (shlex is ~40 us a line, most of an INI read).
_INI_NOT_PLAIN = re.compile(r"['\"\\#]|[^\S \t]")
# How a Python literal can start; text that starts otherwise, quoteless, is a string.
_LITERAL_START = frozenset("0123456789-+.([{")


NOT_YAML: Any = object()  # load_yaml's answer for text that is neither JSON nor YAML


class Unsupported(Exception):
    """The fast reader declines this inventory; the message says why (Ansible reads it)."""


@dataclass(eq=False, slots=True)
class Group:
    """A group as InventoryData holds it: its own vars, links and direct hosts."""

    name: str
    vars: dict[Any, Any] = field(default_factory=dict)
    children: list[Group] = field(default_factory=list)
    parents: list[Group] = field(default_factory=list)
    hosts: dict[str, Host] = field(default_factory=dict)
    priority: int = 1


@dataclass(eq=False, slots=True)
class Host:
    """A host with the vars set on it by inventory files, in the order they were set."""

    name: str
    vars: dict[Any, Any]


class Data:
    """Groups and hosts added under the rules of Ansible's InventoryData."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.hosts: dict[str, Host] = {}
        self.source = ""
        self._source_dir = ""
        for name in ("all", "ungrouped"):
            self.add_group(name)
        self.add_child("all", "ungrouped")

    def set_source(self, path: str) -> None:
        """The file being read: a host's `inventory_file` is the first one naming it."""
        self.source, self._source_dir = path, os.path.abspath(os.path.dirname(path))

    def add_group(self, name: Any) -> str:
        """Add a group unless it exists; its name as used."""
        if not isinstance(name, str) or not name:
            raise Unsupported(f"group name {name!r} is not a non-empty string")
        if name not in self.groups:
            self.groups[name] = Group(name)
        return name

    def add_host(self, name: Any, group: str, port: int | None) -> Host:
        """Add a host to `group`; a port counts only where the host is first seen."""
        if not isinstance(name, str) or not name:
            raise Unsupported(f"host name {name!r} is not a non-empty string")
        host = self.hosts.get(name)
        if host is None:
            first: dict[Any, Any] = {"ansible_port": port} if port else {}
            first["inventory_file"] = self.source
            first["inventory_dir"] = self._source_dir
            host = self.hosts[name] = Host(name, first)
        self.groups[group].hosts.setdefault(name, host)
        return host

    def add_child(self, parent: str, child: Any) -> None:
        """Make a group or host a child of `parent`, refusing loops as Ansible does."""
        group = self.groups[parent]
        if child in self.groups:
            self.link(group, self.groups[child])
        elif child in self.hosts:
            group.hosts.setdefault(child, self.hosts[child])
        else:
            raise Unsupported(f"{child!r} is neither a known host nor group")

    def link(self, parent: Group, child: Group) -> None:
        """A child group under `parent` (once)."""
        if child is parent or child in ancestors(parent):
            raise Unsupported(f"group {child.name!r} under {parent.name!r} makes a loop")
        if child not in parent.children:
            parent.children.append(child)
        if parent not in child.parents:
            child.parents.append(parent)

    def set_group_var(self, group: str, key: Any, value: Any) -> None:
        """A group var; `ansible_group_priority` sets the priority instead, as in Ansible."""
        target = self.groups[group]
        if key != "ansible_group_priority":
            target.vars[key] = value
            return
        try:
            target.priority = int(value)
        except TypeError:
            pass  # Ansible ignores a priority that int() cannot take
        except ValueError as exc:
            raise Unsupported(f"ansible_group_priority {value!r} is not a number") from exc


def ancestors(group: Group) -> set[Group]:
    """Every group above `group`."""
    seen: set[Group] = set()
    todo = list(group.parents)
    while todo:
        g = todo.pop()
        if g not in seen:
            seen.add(g)
            todo.extend(g.parents)
    return seen


def read_source(data: Data, source: str, yaml_exts: list[str], ignored: re.Pattern[str]) -> None:
    """Read a file, or every file under a directory in name order, as InventoryManager does."""
    if not os.path.isdir(source):
        _read_file(data, source, yaml_exts)
        return
    for name in sorted(os.listdir(source)):
        if not ignored.search(name):
            read_source(data, os.path.join(source, name), yaml_exts, ignored)


def _read_file(data: Data, path: str, yaml_exts: list[str]) -> None:
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise Unsupported(f"{path} is not a readable file")
    if os.access(path, os.X_OK):
        raise Unsupported(f"{path} is executable (Ansible runs it as an inventory script)")
    ext = os.path.splitext(path)[1]
    if ext == ".toml":
        raise Unsupported(f"{path} is TOML")
    text = load_text(path)
    data.set_source(path)
    doc = load_yaml(text, path) if not ext or ext in yaml_exts else NOT_YAML
    if isinstance(doc, dict) and doc:
        if doc.get("plugin"):
            raise Unsupported(f"{path} configures an inventory plugin")
        for name, body in doc.items():
            _yaml_group(data, name, body)
        return
    # Ansible's yaml plugin declines text that is not a non-empty mapping; ini tries next.
    try:
        _ini(data, text.splitlines())
    except Unsupported:
        raise
    except Exception as exc:  # Ansible's ini plugin fails on this file too: it reads it
        raise Unsupported(f"{path} does not parse as INI: {exc}") from exc


def load_text(path: str) -> str:
    """A file's text; vault-encrypted or non-UTF-8 files are left to Ansible."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if raw.lstrip().startswith(b"$ANSIBLE_VAULT"):
        raise Unsupported(f"{path} is vault-encrypted")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unsupported(f"{path} is not UTF-8") from exc


def load_yaml(text: str, path: str) -> Any:
    """JSON first, then YAML, as Ansible's DataLoader; NOT_YAML where neither parses."""
    if "__ansible" in text:
        raise Unsupported(f"{path} holds Ansible's tagged JSON values")
    try:
        return json.loads(text)
    except Exception:  # not JSON: YAML next, as Ansible does
        pass
    try:
        return inventory_yaml.load(text)
    except yaml.constructor.ConstructorError as exc:
        raise Unsupported(f"{path}: {exc.problem} (Ansible's own YAML tags)") from exc
    except yaml.YAMLError:
        return NOT_YAML


def _yaml_group(data: Data, name: Any, body: Any) -> Any:
    """One group of a YAML inventory and those under it (the yaml plugin's _parse_group)."""
    if body is not None and not isinstance(body, dict):
        return name  # Ansible warns and skips a group that is not a mapping
    group = data.add_group(name)
    if body is None:
        return group
    for section in SECTIONS:
        if isinstance(body.get(section), str):
            body[section] = {body[section]: None}
        if section in body and not isinstance(body[section], (dict, type(None))):
            raise Unsupported(f'Invalid "{section}" entry for "{group}" group')
    for key, value in body.items():
        if not isinstance(value, dict):
            continue  # Ansible skips empty and non-mapping keys
        if key == "vars":
            for var, val in value.items():
                data.set_group_var(group, var, val)
        elif key == "children":
            for sub, sub_body in value.items():
                data.add_child(group, _yaml_group(data, sub, sub_body))
        elif key == "hosts":
            for pattern, host_vars in value.items():
                _add_hosts(data, group, pattern, host_vars or {})
    return group


def _add_hosts(data: Data, group: str, pattern: Any, host_vars: Any) -> None:
    if not isinstance(host_vars, dict):
        raise Unsupported(f"host {pattern!r} in {group!r} has vars that are not a mapping")
    names, port = expand_pattern(pattern)
    for name in names:
        data.add_host(name, group, port).vars.update(host_vars)


def expand_pattern(pattern: Any) -> tuple[list[str], int | None]:
    """Host names and port of a host pattern (`node-[001:100]`, `gpu1:2222`)."""
    if not isinstance(pattern, str):
        raise Unsupported(f"host pattern {pattern!r} is not a string")
    if "[" not in pattern and ":" not in pattern:
        return [pattern], None
    from ansible.parsing.utils.addresses import parse_address
    from ansible.plugins.inventory import expand_hostname_range

    try:
        host, port = parse_address(pattern, allow_ranges=True)
    except Exception:  # Ansible takes an unparsable pattern as it is
        host, port = pattern, None
    try:
        names = expand_hostname_range(host) if "[" in host else [host]
    except Exception as exc:
        raise Unsupported(f"host pattern {pattern!r}: {exc}") from exc
    return list(names), port


def _ini(data: Data, lines: list[str]) -> None:
    """The ini plugin's _parse: sections, host lines, and children declared before use."""
    pending: dict[str, dict[str, Any]] = {}
    group, state = "ungrouped", "hosts"
    for raw in lines:
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if m := _INI_SECTION.match(line):
            group, state = m.group(1), m.group(2) or "hosts"
            _ini_section(data, group, state, pending)
        elif line.startswith("[") and line.endswith("]"):
            raise ValueError(f"invalid section entry {line!r}")
        elif state == "hosts":
            _ini_hosts(data, group, line)
        elif state == "vars":
            if "=" not in line:
                raise ValueError(f"expected key=value, got {line!r}")
            key, value = (part.strip() for part in line.split("=", 1))
            data.set_group_var(group, key, ini_value(value))
        else:
            _ini_child(data, group, line, pending)
    if pending:
        raise ValueError(f"groups used but never defined: {sorted(pending)}")


def _ini_section(data: Data, group: str, state: str, pending: dict[str, dict[str, Any]]) -> None:
    if state not in SECTIONS:
        raise ValueError(f"section [{group}:{state}] has an unknown type")
    if group not in data.groups:
        if state == "vars":
            pending.setdefault(group, {"state": "vars", "parents": []})
        data.add_group(group)
    if group in pending and state != "vars":
        if pending[group]["state"] == "children":
            _ini_resolve(data, group, pending)
        else:
            del pending[group]


def _ini_resolve(data: Data, group: str, pending: dict[str, dict[str, Any]]) -> None:
    for parent in pending[group]["parents"]:
        data.add_child(parent, group)
        if parent in pending and pending[parent]["state"] == "children":
            _ini_resolve(data, parent, pending)
    del pending[group]


def _ini_child(data: Data, group: str, line: str, pending: dict[str, dict[str, Any]]) -> None:
    m = _INI_GROUP.match(line)
    if not m:
        raise ValueError(f"expected a group name, got {line!r}")
    child = m.group(1)
    if child in data.groups:
        data.add_child(group, child)
    else:
        pending.setdefault(child, {"state": "children", "parents": []})["parents"].append(group)


def _ini_hosts(data: Data, group: str, line: str) -> None:
    tokens = shlex.split(line, comments=True) if _INI_NOT_PLAIN.search(line) else line.split()
    names, port = expand_pattern(tokens[0])
    if tokens[0].strip().endswith(":") and port is None:
        raise ValueError(f"host pattern {tokens[0]!r} ends in ':'")
    if any(name.strip() == "---" for name in names):
        raise ValueError("'---' as a host: a YAML file")
    host_vars: dict[str, Any] = {}
    for token in tokens[1:]:
        if "=" not in token:
            raise ValueError(f"expected key=value, got {token!r}")
        key, value = token.split("=", 1)
        host_vars[key] = ini_value(value)
    for name in names:
        data.add_host(name, group, port).vars.update(host_vars)


def ini_value(text: str) -> Any:
    """A value as the ini plugin reads it: a Python literal where it is one, else the text."""
    if _plain_text(text):
        return text
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    return _ini_coerce(value)


def _plain_text(text: str) -> bool:
    """Text ast.literal_eval would refuse (a name, a path, an address), known without it."""
    head = text.lstrip(" \t")  # literal_eval skips leading blanks: ' 0' is 0
    if not head or head[0] in _LITERAL_START or head in ("True", "False", "None"):
        return False
    return "'" not in text and '"' not in text


def _ini_coerce(value: Any) -> Any:
    if isinstance(value, (list, tuple, set)):
        return [_ini_coerce(v) for v in value]
    if isinstance(value, dict):
        return {k: _ini_coerce(v) for k, v in value.items()}
    if value is ...:
        return "..."
    if isinstance(value, complex):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    return value
