"""The `gpuops_grade` filter: diagnose.yml's tool outputs judged by gpuops's own code.

The parsers and the per-SKU expectations live in gpuops.diagnose (tested against each
tool's real output format); the playbook only runs the tools. Ansible loads this file
from the playbooks' own filter_plugins/, and runs it in the controller's Python: the
gpuops venv's, where the package is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuops.diagnose.fabric import pair_checks
from gpuops.diagnose.grades import judge
from gpuops.diagnose.skus import load


def gpuops_grade(
    outputs: dict[str, str], grade: int, sku: str, skus_file: str | None = None
) -> dict[str, Any]:
    """The grade's result as data: checks with their numbers, `ok` and `summary`."""
    table = load(Path(skus_file) if skus_file else None)
    result = judge(int(grade), outputs, table.get(sku))
    return {**result.model_dump(mode="json"), "ok": result.ok, "summary": result.summary()}


def gpuops_pair_ok(reports: dict[str, str], sku: str, skus_file: str | None = None) -> bool:
    """Whether one fabric pass's pair passed on every HCA (grade 4's second pass follows
    when it did not)."""
    table = load(Path(skus_file) if skus_file else None)
    bound = table.get(sku).ib_write_bw_gbps.value
    return all(c.ok for c in pair_checks("pair", reports, bound))


class FilterModule:
    """Ansible's entry point for filter plugins."""

    def filters(self) -> dict[str, Any]:
        return {"gpuops_grade": gpuops_grade, "gpuops_pair_ok": gpuops_pair_ok}
