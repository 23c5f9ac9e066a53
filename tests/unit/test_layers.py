"""Each folder of the package imports only what its `__init__` docstring allows.

A folder's docstring ends with `May import: a, b, c.` (folders, or single modules such
as `power.config`); the package root's vocabulary may be imported by anyone. The
allowed graph itself runs one way, so no two folders can lean on each other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "engine" / "gpuops"
ROOT = "(root)"
MAY = re.compile(r"May import:\s*(.*?)(?:\.\s*$|\.\s*\n\s*\n|\Z)", re.S | re.M)


def _may_import(init: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    found = MAY.search(doc)
    if found is None:
        raise AssertionError(f"{init}: the docstring does not say 'May import: ...'")
    text = re.sub(r"\([^)]*\)", "", found.group(1))
    if text.strip().startswith("nothing"):
        return set()
    return {name.strip() for name in text.split(",") if name.strip()}


def _folder(package: Path, path: Path) -> str:
    parts = path.relative_to(package).parts
    return parts[0] if len(parts) > 1 else ROOT


def _module(package: Path, path: Path) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Every gpuops module `path` names in an import, in functions too (relative to gpuops)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n.removeprefix("gpuops.") for n in out if n.startswith("gpuops.")}


def violations(package: Path) -> list[str]:
    """`module -> module` for each import its folder's docstring does not allow."""
    files = {_module(package, p): p for p in package.rglob("*.py")}
    allowed = {
        ROOT if init.parent == package else init.parent.name: _may_import(init)
        for init in package.glob("**/__init__.py")
        if init.parent == package or init.parent.parent == package
    }
    out = []
    for name, path in sorted(files.items()):
        mine = _folder(package, path)
        for target in sorted(_imported(path) & set(files)):
            theirs = _folder(package, files[target])
            if theirs in (mine, ROOT):
                continue
            may = allowed.get(mine, set())
            if theirs not in may and not any(
                target == m or target.startswith(f"{m}.") for m in may
            ):
                out.append(f"{name} -> {target} ({mine} may import: {', '.join(sorted(may))})")
    return out


def _layers(package: Path) -> dict[str, set[str]]:
    return {
        init.parent.name: {m.split(".")[0] for m in _may_import(init)}
        for init in package.glob("*/__init__.py")
    }


def test_every_import_is_one_its_folder_allows() -> None:
    assert violations(PACKAGE) == []


def test_the_allowed_folders_run_one_way() -> None:
    layers = _layers(PACKAGE)
    placed: list[str] = []
    left = dict(layers)
    while left:
        ready = sorted(f for f, deps in left.items() if deps <= set(placed))
        assert ready, f"folders that allow each other in a circle: {sorted(left)}"
        placed += ready
        for f in ready:
            del left[f]
    assert placed.index("bus") < placed.index("decide") < placed.index("spine")


def test_nothing_in_the_product_may_import_bench() -> None:
    assert all("bench" not in deps for deps in _layers(PACKAGE).values())


def test_the_root_holds_at_most_eight_modules() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 8, loose


@pytest.mark.parametrize(
    ("folder", "line", "allowed", "expected"),
    [
        (
            "decide",
            "from gpuops.power.units import parse_watts",
            "record",
            "decide.bad -> power.units",
        ),
        ("match", "import gpuops.bench.rules", "inventory", "match.bad -> bench.rules"),
        ("decide", "from gpuops.record.audit import Auditor", "record", None),
    ],
)
def test_an_import_its_docstring_does_not_allow_is_found(
    tmp_path: Path, folder: str, line: str, allowed: str, expected: str | None
) -> None:
    package = tmp_path / "gpuops"
    for name, may in (
        (folder, allowed),
        ("power", "nothing"),
        ("record", "nothing"),
        ("bench", "nothing"),
    ):
        (package / name).mkdir(parents=True, exist_ok=True)
        (package / name / "__init__.py").write_text(f'"""A folder.\n\nMay import: {may}.\n"""\n')
    (package / "__init__.py").write_text('"""Root.\n\nMay import: nothing.\n"""\n')
    (package / "power" / "units.py").write_text("X = 1\n")
    (package / "record" / "audit.py").write_text("X = 1\n")
    (package / "bench" / "rules.py").write_text("X = 1\n")
    (package / folder / "bad.py").write_text(f"def f() -> None:\n    {line}\n")
    found = violations(package)
    assert found == ([] if expected is None else [found[0]])
    if expected is not None:
        assert found[0].startswith(expected)


# Strings that start like a subject but name something else: the CLI's entry-point group.
NOT_SUBJECTS = frozenset({"gpuops.commands"})


def _subject_texts(package: Path) -> list[str]:
    """`module: text` for each literal outside subjects.py that reads as a NATS subject
    (it starts with `gpuops.` and is neither a module of the package nor a file name)."""
    modules = {f"gpuops.{_module(package, p)}" for p in package.rglob("*.py")}
    out: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        if path.name == "subjects.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr) and node.values:
                first = node.values[0]
                text = first.value if isinstance(first, ast.Constant) else ""
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if not isinstance(text, str) or not text.startswith("gpuops."):
                continue
            if any(c.isspace() for c in text):
                continue  # prose (a docstring): a subject has no blanks
            if text in modules or text in NOT_SUBJECTS or re.fullmatch(r"gpuops\.\w+", text):
                continue  # a module, the entry-point group, a file such as gpuops.yml
            out.add(f"{_module(package, path)}: {text!r}")  # an f-string's head: seen twice
    return sorted(out)


def test_subject_text_is_written_only_in_subjects_py() -> None:
    assert _subject_texts(PACKAGE) == []


def test_a_subject_written_elsewhere_is_found(tmp_path: Path) -> None:
    package = tmp_path / "gpuops"
    (package / "bus").mkdir(parents=True)
    (package / "bus" / "conn.py").write_text('S = ["gpuops.audit.>"]\nF = f"gpuops.cmd.{1}"\n')
    (package / "bus" / "names.py").write_text('L = "gpuops.bus.names"\nY = "gpuops.yml"\n')
    assert _subject_texts(package) == ["bus.conn: 'gpuops.audit.>'", "bus.conn: 'gpuops.cmd.'"]
