"""The package's imports run one way: no module imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "engine" / "gpuops"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `path` imports at module level (not in functions)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out.update(n for n in names if n in known)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {m: _imports(p, known) - {m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the path around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_walk_finds_a_cycle_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_package_has_no_import_cycle() -> None:
    graph = _graph()
    assert (
        "gpuops.spine.pipeline" in graph and "gpuops.decide.stage" in graph["gpuops.spine.pipeline"]
    )
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
