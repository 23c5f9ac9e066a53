"""The real tools' output read into checks.

Each parser takes the text a tool printed and the bound it is held to, and gives back
checks; text that is not what the tool prints (empty, cut short, another tool's) raises
`DiagnosticsError` naming the tool and what was missing, never a bare KeyError. The
formats, and the public captures and source lines they follow, are described in
tests/fixtures/diag/README.md.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from gpuops.diagnose.results import Check
from gpuops.errors import DiagnosticsError

# -- dcgmi diag -j -------------------------------------------------------------------

DCGMI = "dcgmi diag"
# DCGM 4 names the root "DCGM Diagnostic"; 3.x named it "DCGM GPU Diagnostic".
DCGM_ROOTS = ("DCGM Diagnostic", "DCGM GPU Diagnostic")
DCGM_FAIL = "fail"


def dcgm_diag(json_text: str) -> list[Check]:
    """One check per test (plugin) and GPU of a `dcgmi diag -r N -j` report.

    A Fail fails with the plugin's warning and info text; Pass, Warn and Skip pass (DCGM
    itself exits zero on them; a skipped plugin did not find a fault).
    """
    body = _dcgm_body(json_text)
    if isinstance(body.get("runtime_error"), str):
        # The diagnostic did not run: the grade cannot pass, and this is why.
        return [Check(name="dcgm:runtime", ok=False, detail=body["runtime_error"])]
    checks = [check for test in _dcgm_tests(body) for check in _dcgm_test_checks(test)]
    if not checks:
        raise DiagnosticsError(DCGMI, "no test results in the report (test_categories empty)")
    return checks


def loads(tool: str, text: str) -> Any:
    """A tool's JSON output, as `json.loads` reads it; DiagnosticsError when it nests
    deeper than that parser recurses (a node's output is not trusted: its check fails)."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise DiagnosticsError(tool, "output nested deeper than a report is") from exc


def _dcgm_body(json_text: str) -> dict[str, Any]:
    try:
        doc = loads(DCGMI, json_text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise DiagnosticsError(DCGMI, f"output is not JSON (cut short?): {exc}") from exc
    body = next((doc[k] for k in DCGM_ROOTS if isinstance(doc, dict) and k in doc), None)
    if not isinstance(body, dict):
        raise DiagnosticsError(DCGMI, f"no {' or '.join(map(repr, DCGM_ROOTS))} object")
    return body


def _dcgm_tests(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    categories = body.get("test_categories")
    if not isinstance(categories, list):
        raise DiagnosticsError(DCGMI, "no test_categories list in the report")
    for category in categories:
        tests = category.get("tests") if isinstance(category, dict) else None
        if not isinstance(tests, list):
            raise DiagnosticsError(DCGMI, f"a category without a tests list: {category!r:.80}")
        yield from (t for t in tests if isinstance(t, dict))


def _dcgm_test_checks(test: dict[str, Any]) -> list[Check]:
    name = test.get("name")
    if not isinstance(name, str):
        raise DiagnosticsError(DCGMI, f"a test without a name: {test!r:.80}")
    key = "dcgm:" + re.sub(r"\W+", "_", name.strip().lower()).strip("_")
    results = [r for r in test.get("results") or [] if isinstance(r, dict)]
    if not results and isinstance(test.get("test_summary"), dict):
        results = [test["test_summary"]]  # a test that reports no entity, only its verdict
    checks = []
    for result in results:
        status = result.get("status")
        if not isinstance(status, str):
            raise DiagnosticsError(DCGMI, f"test {name!r}: a result without a status")
        checks += [_dcgm_check(key, status, gpu, result) for gpu in _dcgm_gpus(result)]
    return checks


def _dcgm_gpus(result: dict[str, Any]) -> list[int | None]:
    """The GPUs a result is about: DCGM 4's entity, 3.x's `gpu_ids` list, or none."""
    if "entity_id" in result:
        is_gpu = str(result.get("entity_group", "GPU")).upper() == "GPU"
        return [int(result["entity_id"])] if is_gpu else [None]
    ids = str(result.get("gpu_ids", "")).strip()
    return [int(i) for i in ids.split(",") if i.strip().isdigit()] or [None]


def _dcgm_check(key: str, status: str, gpu: int | None, result: dict[str, Any]) -> Check:
    texts = [w.get("warning", "") for w in result.get("warnings") or [] if isinstance(w, dict)]
    texts += [str(i) for i in result.get("info") or []]
    if result.get("entity_group") not in (None, "GPU"):
        texts.insert(0, f"{result['entity_group']} {result.get('entity_id')}")
    detail = "; ".join(t for t in texts if t)
    verdict = status.strip().lower()
    return Check(
        name=key,
        ok=verdict != DCGM_FAIL,
        gpu=gpu,
        detail=f"{status}: {detail}" if detail else status,
    )


# -- nccl-tests all_reduce_perf ------------------------------------------------------

NCCL = "all_reduce_perf"
GBS = "GB/s"
AVG_LINE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)\s*(\w*)", re.M)
OOB_LINE = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)", re.M)


def all_reduce_perf(text: str, expect_busbw_gbs: float) -> list[Check]:
    """The largest message's out-of-place busbw against the bound, the run's average, and
    whether any size's data came back wrong (`#wrong` non-zero, out-of-bounds values)."""
    header, rows = _nccl_table(text)
    busbw_at = header.index("busbw")
    size, biggest = max(((int(r[0]), r) for r in rows), key=lambda sr: sr[0])
    busbw = _number(NCCL, biggest[busbw_at], "busbw")
    avg = AVG_LINE.search(text)
    if avg is None:
        raise DiagnosticsError(NCCL, "no '# Avg bus bandwidth' line: the run did not finish")
    return [
        Check(
            name="nccl:all_reduce busbw",
            ok=busbw >= expect_busbw_gbs,
            value=busbw,
            expect=f">= {expect_busbw_gbs:g} {GBS}",
            unit=GBS,
            detail=f"out-of-place busbw at {size} bytes, the largest size run",
        ),
        Check(
            name="nccl:all_reduce avg busbw",
            # The average spans every size run (small ones are latency-bound), so it is
            # held to no bound here; only the tool's own verdict (-C) can fail it.
            ok=avg.group(2) != "FAILED",
            value=_number(NCCL, avg.group(1), "Avg bus bandwidth"),
            unit=GBS,
            detail=f"average over {len(rows)} sizes"
            + (f", {avg.group(2)}" if avg.group(2) else ""),
        ),
        _nccl_data_check(text, header, rows),
    ]


def _nccl_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The column names (the header line naming size and busbw) and the rows under it."""
    header = next(
        (line.lstrip("#").split() for line in text.splitlines() if _is_nccl_header(line)), None
    )
    if header is None:
        raise DiagnosticsError(NCCL, "no result table header (# size count type ... busbw)")
    rows = [
        tokens
        for tokens in (line.split() for line in text.splitlines())
        if len(tokens) == len(header) and tokens[0].isdigit()
    ]
    if not rows:
        raise DiagnosticsError(NCCL, "the result table has no rows: the run did not finish")
    return header, rows


def _is_nccl_header(line: str) -> bool:
    words = line.lstrip("#").split()
    return line.startswith("#") and words[:1] == ["size"] and "busbw" in words


def _nccl_data_check(text: str, header: list[str], rows: list[list[str]]) -> Check:
    """Wrong data in any row (either place) or any out-of-bounds value fails the run."""
    columns = [i for i, name in enumerate(header) if name == "#wrong"]
    wrong = {
        row[0]: sum(_wrong(row[i]) for i in columns)
        for row in rows
        if any(_wrong(row[i]) for i in columns)
    }
    oob = OOB_LINE.search(text)
    out_of_bounds = int(oob.group(1)) if oob else 0
    total = sum(wrong.values()) + out_of_bounds
    where = ", ".join(f"{n:g} at {size} bytes" for size, n in wrong.items())
    detail = "every size validated" if columns else "the table has no #wrong column"
    if total:
        detail = f"wrong elements: {where or 'none in the table'}; out of bounds: {out_of_bounds}"
    return Check(
        name="nccl:all_reduce data", ok=total == 0, value=total, expect="== 0", detail=detail
    )


def _wrong(cell: str) -> float:
    # "N/A" when the run did not validate (-c 0): nothing was found wrong.
    return 0.0 if cell == "N/A" else _number(NCCL, cell, "#wrong")


# -- nvbandwidth ---------------------------------------------------------------------

NVB = "nvbandwidth"
RUNNING = re.compile(r"^Running (\w+)\.\s*$", re.M)
MATRIX_TITLE = re.compile(r"bandwidth \(GB/s\)\s*$")


def nvbandwidth(text: str, expect: Mapping[str, float]) -> list[Check]:
    """The lowest cell of each expected testcase's matrix against its bound.

    `expect` maps a testcase (`host_to_device_memcpy_ce`) or its short name
    (`host_to_device`, see `short_name`) to GB/s. A testcase expected but not in the
    output (waived, cut short) raises: a missing matrix proves nothing.
    """
    matrices = {short_name(name): (name, cells) for name, cells in _nvb_matrices(text)}
    checks = []
    for wanted, bound in expect.items():
        short = short_name(wanted)
        if short not in matrices:
            raise DiagnosticsError(NVB, f"no {wanted} matrix in the output (waived or cut short)")
        checks.append(_nvb_check(short, *matrices[short], bound))
    return checks


def short_name(testcase: str) -> str:
    """`device_to_device_memcpy_read_ce` -> `device_to_device`: the copy engine and the read
    direction are the defaults; others stay in the name (`device_to_device_write_sm`)."""
    return re.sub(r"_ce$", "", testcase).replace("_memcpy", "").replace("_read", "")


Cells = dict[tuple[int, int], float]


def _nvb_matrices(text: str) -> Iterator[tuple[str, Cells]]:
    starts = list(RUNNING.finditer(text))
    if not starts:
        raise DiagnosticsError(NVB, "no 'Running <testcase>.' line: not nvbandwidth output")
    for start, end in zip(starts, [*starts[1:], None], strict=True):
        block = text[start.end() : end.start() if end else len(text)]
        cells = _nvb_cells(start.group(1), block)
        if cells is not None:
            yield start.group(1), cells


def _nvb_cells(testcase: str, block: str) -> Cells | None:
    """The matrix under a testcase's title, keyed (row, column); None when it has none."""
    lines = block.splitlines()
    title = next((i for i, line in enumerate(lines) if MATRIX_TITLE.search(line)), None)
    if title is None:
        return None
    columns = [int(c) for c in lines[title + 1].split()] if title + 1 < len(lines) else []
    cells: Cells = {}
    for line in lines[title + 2 :]:
        tokens = line.split()
        if not tokens or not tokens[0].isdigit():
            break
        if len(tokens) != len(columns) + 1:
            raise DiagnosticsError(NVB, f"{testcase}: a matrix row is cut short: {line!r}")
        row = int(tokens[0])
        for column, cell in zip(columns, tokens[1:], strict=True):
            if cell != "N/A":
                cells[(row, column)] = _number(NVB, cell, f"{testcase} cell")
    if not cells:
        raise DiagnosticsError(NVB, f"{testcase}: the matrix has no values (cut short?)")
    return cells


def _nvb_check(short: str, testcase: str, cells: Cells, bound: float) -> Check:
    host = "host" in testcase  # a CPU(row) matrix: its columns are the GPUs
    # A GPU's copy to itself is not a link; older versions print 0.00 there, not N/A.
    links = {rc: v for rc, v in cells.items() if host or rc[0] != rc[1]}
    (row, column), low = min(links.items(), key=lambda kv: (kv[1], kv[0]))
    if host:
        gpu, where = column, f"lowest: GPU {column} ({testcase}, CPU row {row})"
    else:
        gpu = _weakest_gpu(links)
        where = f"lowest: GPU {row} (row) with GPU {column} (column); weakest GPU {gpu}"
    return Check(
        name=f"nvbandwidth:{short}",
        ok=low >= bound,
        value=low,
        expect=f">= {bound:g} {GBS}",
        unit=GBS,
        gpu=gpu,
        detail=where,
    )


def _weakest_gpu(links: Cells) -> int:
    """The GPU whose row and column average lowest: one bad GPU drags down both, while the
    lowest cell alone cannot say which end of a pair is at fault."""
    sums: dict[int, list[float]] = {}
    for (row, column), value in links.items():
        for gpu in (row, column):
            sums.setdefault(gpu, []).append(value)
    return min(sums, key=lambda g: (sum(sums[g]) / len(sums[g]), g))


# -- perftest ib_write_bw ------------------------------------------------------------

IB = "ib_write_bw"
GBPS = "Gb/s"
IB_HEADER = re.compile(r"#bytes\s+#iterations\s+BW peak\[([^\]]+)\]\s+BW average\[([^\]]+)\]")
# perftest's "MB/sec" (MiB/sec since 2023) is bytes / 2^20; --report_gbits is bits / 10^9.
MIB_IN_GBIT = 2**20 * 8 / 1e9


def ib_write_bw(text: str, expect_gbps: float, hca: str) -> list[Check]:
    """The BW average of the largest message size run on `hca`, in Gb/s, against the bound."""
    header = IB_HEADER.search(text)
    if header is None:
        raise DiagnosticsError(IB, f"{hca}: no '#bytes #iterations BW peak BW average' header")
    rows = [
        tokens
        for tokens in (line.split() for line in text[header.end() :].splitlines())
        if len(tokens) >= 4 and tokens[0].isdigit() and tokens[1].isdigit()
    ]
    if not rows:
        raise DiagnosticsError(IB, f"{hca}: no result row under the header: the run did not finish")
    size, row = max(((int(r[0]), r) for r in rows), key=lambda sr: sr[0])
    average = _number(IB, row[3], "BW average")
    unit = header.group(2)
    gbps = average if unit.startswith("Gb") else average * MIB_IN_GBIT
    return [
        Check(
            name=f"ib_write_bw:{hca}",
            ok=gbps >= expect_gbps,
            value=round(gbps, 2),
            expect=f">= {expect_gbps:g} {GBPS}",
            unit=GBPS,
            detail=f"BW average at {size} bytes"
            + ("" if unit.startswith("Gb") else f" ({average} {unit})"),
        )
    ]


def _number(tool: str, cell: str, what: str) -> float:
    try:
        value = float(cell)
    except ValueError as exc:
        raise DiagnosticsError(tool, f"{what} is not a number: {cell!r}") from exc
    if not math.isfinite(value):
        raise DiagnosticsError(tool, f"{what} is not finite: {cell!r}")
    return value
