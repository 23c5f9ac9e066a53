"""Every record type the engine stores is one a repair can validate (spine.statemodels)."""

from __future__ import annotations

import ast
from pathlib import Path

from gpuops.spine.statemodels import STATE_MODELS, model_of

PACKAGE = Path(__file__).resolve().parents[3] / "engine" / "gpuops"


def _stores_in_source() -> set[tuple[str, str]]:
    """(model name, prefix) of every `Store(kv, Model, "prefix")` in the package."""
    found: set[tuple[str, str]] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Store":
                model, prefix = node.args[1], node.args[2]
                if isinstance(model, ast.Name) and isinstance(prefix, ast.Constant):
                    found.add((model.id, str(prefix.value)))
    return found


def test_every_store_of_the_package_is_in_the_table() -> None:
    in_source = _stores_in_source()
    assert len(in_source) >= 15, "the scan finds the stores"
    table = {(model.__name__, prefix) for (_, prefix), model in STATE_MODELS.items()}
    assert in_source <= table, f"stores missing from STATE_MODELS: {in_source - table}"


def test_a_key_names_its_record_by_its_longest_prefix() -> None:
    assert model_of("control", "power.alloc.node-001").__name__ == "NodeAllocation"  # type: ignore[union-attr]
    assert model_of("control", "breaker.fleet").__name__ == "BreakerRecord"  # type: ignore[union-attr]
    assert model_of("cooldowns", "breaker.fleet") is None, "another bucket's prefix"
    assert model_of("control", "breakerfleet") is None, "a prefix is whole, up to its dot"
