"""The `gpuops_grade` filter: diagnose.yml's tool outputs judged by gpuops's own code.

The parsers and the per-SKU expectations live in gpuops.diagnose (tested against each
tool's real output format); the playbook only runs the tools. Ansible loads this file
from the playbooks' own filter_plugins/, and runs it in the controller's Python: the
gpuops venv's, where the package is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuops.diagnose.grades import judge
from gpuops.diagnose.skus import load


def gpuops_grade(
    outputs: dict[str, str], grade: int, sku: str, skus_file: str | None = None
) -> dict[str, Any]:
    """The grade's result as data: checks with their numbers, `ok` and `summary`."""
    table = load(Path(skus_file) if skus_file else None)
    result = judge(int(grade), outputs, table.get(sku))
    return {**result.model_dump(mode="json"), "ok": result.ok, "summary": result.summary()}


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {"gpuops_grade": gpuops_grade}
