"""Grades: which tools each diagnostic grade runs, and their outputs judged as one result.

    1 quick   (seconds, node in service)  the GPUs as nvidia-smi lists them (count, PCIe
                                          width against the SKU's), `dcgmi diag -r 1`
    2 medium  (minutes, node drained)     `dcgmi diag -r 2`, nvbandwidth host<->device and
                                          device<->device
    3 deep    (15-60 min, node exclusive) `dcgmi diag -r 3`, nvbandwidth, an 8-GPU NCCL
                                          all_reduce_perf against the SKU's busbw
    4 fabric  (minutes, node drained)     the GPUs, and `ib_write_bw` per HCA with a
                                          known-good peer, a second pass deciding which
                                          side of a failing pair is bad (gpuops.diagnose.fabric)
    5 service (minutes, any node)         a bundle for a person or NVIDIA support:
                                          nvidia-bug-report, the BMC's event log, the
                                          kernel log, `nvidia-smi -q`, `dcgmi diag -r 1`;
                                          a check per part collected, and the engine
                                          hands the node to a person (the built-in rule
                                          `service-handoff`)

Grades 1 to 3 each include the ones below; 4 is the network's, beside them. The
playbook (playbooks/diagnose.yml) runs the tools and hands their raw outputs here, by
the names in `TOOLS`; what comes back is the typed result the run's outcome and the
audit carry. PCIe generation is not judged: an idle GPU lowers its link generation by
design, never its width.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuops.diagnose import fabric, parsers
from gpuops.diagnose.results import BUNDLE_DIR, Check, GradeResult
from gpuops.diagnose.skus import SkuExpectations
from gpuops.errors import DiagnosticsError

GRADES = (1, 2, 3, 4, 5)
# The outputs each grade needs, by the names the playbook registers them under.
TOOLS: dict[int, tuple[str, ...]] = {
    1: ("gpus", "dcgm"),
    2: ("gpus", "dcgm", "nvbandwidth"),
    3: ("gpus", "dcgm", "nvbandwidth", "nccl"),
    4: ("gpus", "fabric"),
    5: ("bundle",),
}
# The parts of a service bundle (tasks/diagnose_bundle.yml writes them, and a JSON list
# of what it wrote as the `bundle` output).
BUNDLE_PARTS = ("nvidia-bug-report", "bmc-sel", "dmesg", "nvidia-smi-q", "dcgm-diag")
# nvidia-smi --query-gpu=... --format=csv,noheader,nounits, in this order.
GPU_QUERY = "index,pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.width.max"


def judge(grade: int, outputs: Mapping[str, str], sku: SkuExpectations) -> GradeResult:
    """The grade's checks over the tools' outputs; a tool that gave no output fails."""
    if grade not in TOOLS:
        raise DiagnosticsError("diagnose", f"grade {grade} is not one of {list(GRADES)}")
    checks: list[Check] = []
    for tool in TOOLS[grade]:
        text = outputs.get(tool) or ""
        if not text.strip():
            checks.append(Check(name=f"{tool}:ran", ok=False, detail="no output: did it run?"))
            continue
        try:
            checks += _checks(tool, text, sku)
        except DiagnosticsError as exc:
            checks.append(Check(name=f"{tool}:output", ok=False, detail=str(exc)))
    return GradeResult(grade=grade, checks=tuple(checks))


def _checks(tool: str, text: str, sku: SkuExpectations) -> list[Check]:
    if tool == "gpus":
        return gpu_query(text, int(sku.gpu_count.value), int(sku.pcie_width.value))
    if tool == "dcgm":
        return parsers.dcgm_diag(text)
    if tool == "nvbandwidth":
        return parsers.nvbandwidth(text, sku.nvbandwidth_expect())
    if tool == "fabric":
        return fabric.judged(text, sku.ib_write_bw_gbps.value)
    if tool == "bundle":
        return bundle_checks(text)
    return parsers.all_reduce_perf(text, sku.nccl_allreduce_busbw_gbs.value)


def bundle_checks(text: str) -> list[Check]:
    """A service bundle as the playbook wrote it (`{"dir": ..., "parts": [{"name", "path",
    "bytes", "error"}]}`): the directory, then a check per part, collected when it has
    bytes (a part the playbook did not list is missing)."""
    try:
        doc = parsers.loads("bundle", text)
        parts = {str(p["name"]): p for p in doc["parts"]}
        where = str(doc["dir"])
    except (ValueError, TypeError, KeyError) as exc:
        raise DiagnosticsError("bundle", f"not the bundle's list of parts: {exc}") from exc
    checks = [Check(name=BUNDLE_DIR, ok=True, detail=where)]
    for name in BUNDLE_PARTS:
        part = parts.get(name, {"error": "not collected"})
        size = int(part.get("bytes") or 0)
        error = str(part.get("error") or "")
        checks.append(
            Check(
                name=f"bundle:{name}",
                ok=size > 0 and not error,
                value=float(size),
                unit="bytes",
                detail=error or str(part.get("path", "")),
            )
        )
    return checks


def gpu_query(csv_text: str, expect_gpus: int, expect_width: int) -> list[Check]:
    """nvidia-smi's GPU list (`GPU_QUERY`): how many answer, and each one's PCIe width."""
    rows = [[c.strip() for c in line.split(",")] for line in csv_text.splitlines() if line.strip()]
    if any(len(row) != len(GPU_QUERY.split(",")) for row in rows):
        raise DiagnosticsError("nvidia-smi", f"expected the columns {GPU_QUERY}, got {rows[:1]}")
    count = Check(
        name="gpus:count",
        ok=len(rows) == expect_gpus,
        value=float(len(rows)),
        expect=f"== {expect_gpus}",
        detail=f"{len(rows)} GPUs answer",
    )
    return [count, *(_width(row, expect_width) for row in rows)]


def _width(row: list[str], expect: int) -> Check:
    index, bus, _gen, width, full = row
    try:
        now, most = int(width), int(full)
    except ValueError as exc:
        raise DiagnosticsError("nvidia-smi", f"GPU {index}: PCIe width {width!r}") from exc
    return Check(
        name="gpus:pcie width",
        ok=now >= expect,  # a GPU in a narrower slot (its maximum below) fails as well
        value=float(now),
        expect=f">= x{expect}",
        unit="lanes",
        gpu=int(index),
        detail=f"{bus} at x{now} of x{most}",
    )
