"""YAML with line numbers: every mapping remembers where it and each of its keys began."""

from __future__ import annotations

import re
from typing import Any

import yaml

from gpuops.errors import RuleError


class LineDict(dict[str, Any]):
    """A mapping from YAML that knows its own line and the line of each key."""

    line: int = 0
    key_lines: dict[str, int]

    def line_of(self, key: str) -> int:
        """The line of `key`, or of the mapping when the key is absent."""
        return self.key_lines.get(key, self.line)


class _Loader(yaml.SafeLoader):
    """Safe loading; only `true`/`false` are booleans, so `on: telemetry` stays a key."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# PyYAML's bool pattern also matches yes/no/on/off; narrow it to YAML 1.2's two words.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LineDict:
    out = LineDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out.key_lines:
            raise RuleError(
                f"duplicate key {key!r} (first on line {out.key_lines[key]})",
                line=key_node.start_mark.line + 1,
            )
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[str(key)] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str, file: str) -> Any:
    """Parse one YAML document, turning syntax errors into RuleErrors with file and line."""
    try:
        return yaml.load(text, Loader=_Loader)
    except RuleError as exc:
        exc.file = file
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark is not None else 0
        raise RuleError(f"YAML: {exc.problem}", file=file, line=line) from exc
    except yaml.YAMLError as exc:
        raise RuleError(f"YAML: {exc}", file=file) from exc
    except (RecursionError, MemoryError) as exc:  # PyYAML composes nested nodes recursively
        raise RuleError(f"YAML nested too deeply ({type(exc).__name__})", file=file) from exc
