"""What the diagnostic tools print, rendered from numbers for the simulated fleet.

The simulated node's shims print these in place of `dcgmi diag -j`, nccl-tests'
`all_reduce_perf`, `nvbandwidth` and perftest's `ib_write_bw`, so the playbooks and the
parsers read the very format a real node prints. The layouts follow each tool's print
statements (DCGM dcgmi/Diag.cpp, nccl-tests src/util.cu, nvbandwidth inline_common.h
and output.cpp, perftest src/perftest_parameters.h); tests/unit/sim/test_diagtools.py
reads every rendering back through gpuops.diagnose.parsers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

# dcgmi diag's plugins by level (DCGM 4 names); each level runs the ones before it.
DCGM_TESTS: dict[int, tuple[tuple[str, str], ...]] = {
    1: (("Deployment", "software"),),
    2: (("Integration", "pcie"), ("Hardware", "memory")),
    3: (
        ("Hardware", "diagnostic"),
        ("Stress", "targeted_stress"),
        ("Stress", "targeted_power"),
        ("Stress", "memory_bandwidth"),
    ),
    4: (("Hardware", "memtest"), ("Stress", "pulse_test")),
}
H200_DEVICE_ID = "2335"  # PCI device id of the H200 SXM (entity_groups.entities.device_id)


def dcgmi_diag_json(
    level: int, gpus: int, failing: Mapping[str, Mapping[int, str]] | None = None
) -> str:
    """`dcgmi diag -r LEVEL -j` for `gpus` GPUs; `failing` maps a plugin (`pcie`) to the
    GPUs it fails on and the warning text for each."""
    failing = failing or {}
    tests = [t for lvl in sorted(DCGM_TESTS) if lvl <= level for t in DCGM_TESTS[lvl]]
    categories: dict[str, list[dict[str, object]]] = {}
    for category, name in tests:
        categories.setdefault(category, []).append(_dcgm_test(name, gpus, failing.get(name, {})))
    doc = {
        "DCGM Diagnostic": {
            "test_categories": [{"category": c, "tests": t} for c, t in categories.items()]
        },
        "entity_groups": [
            {
                "entity_group": "GPU",
                "entity_group_id": 1,
                "entities": [{"entity_id": i, "device_id": H200_DEVICE_ID} for i in range(gpus)],
            }
        ],
        "metadata": {"version": "4.2.3", "Driver Version Detected": "570.133.20"},
    }
    return json.dumps(doc, indent=4)


def _dcgm_test(name: str, gpus: int, failing: Mapping[int, str]) -> dict[str, object]:
    results: list[dict[str, object]] = []
    for gpu in range(gpus):
        result: dict[str, object] = {
            "entity_group": "GPU",
            "entity_group_id": 1,
            "entity_id": gpu,
            "status": "Fail" if gpu in failing else "Pass",
        }
        if gpu in failing:
            # category 13 hardware PCIe / 15 hardware other, severity 2 (isolate), as DCGM
            result["warnings"] = [
                {"warning": failing[gpu], "error_id": 30, "error_category": 13, "error_severity": 2}
            ]
        results.append(result)
    return {
        "name": name,
        "results": results,
        "test_summary": {"status": "Fail" if failing else "Pass"},
    }


def all_reduce_perf_table(gpus: int, busbw_gbs: float, *, wrong: int = 0) -> str:
    """`all_reduce_perf -b 1G -e 16G -f 2 -g GPUS`: busbw rises to `busbw_gbs` at 16 GiB;
    `wrong` elements come back wrong at the largest size."""
    lines = [
        "# nccl-tests version 2.16.4 nccl-headers=22603 nccl-library=22603",
        "# Collective test starting: all_reduce_perf",
        f"# nThread 1 nGpus {gpus} minBytes 1073741824 maxBytes 17179869184 step: 2(factor) "
        "warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0",
        "#",
        "# Using devices",
        *(
            f"#  Rank {g:2d} Group  0 Pid   4242 on {'sim-node':>10s} device {g:2d} "
            f"[0000:{0x18 + 0x10 * g:02x}:00] NVIDIA H200"
            for g in range(gpus)
        ),
        "#",
        "# "
        + "  ".join(f"{'':{w}s}" for w in (10, 12, 8, 6, 6))
        + "           out-of-place                       in-place          ",
        _nccl_header(
            ("size", "count", "type", "redop", "root"), ("time", "algbw", "busbw", "#wrong")
        ),
        _nccl_header(("(B)", "(elements)", "", "", ""), ("(us)", "(GB/s)", "(GB/s)", "")),
    ]
    factor = 2 * (gpus - 1) / gpus  # busbw = algbw * 2(n-1)/n for all-reduce
    sizes = [2**30 * 2**i for i in range(5)]
    bws = [busbw_gbs * s for s in (0.90, 0.94, 0.97, 0.99, 1.0)]
    for size, busbw in zip(sizes, bws, strict=True):
        bad = wrong if size == sizes[-1] else 0
        algbw = busbw / factor
        time_us = size / (algbw * 1e3)
        body = f"  {_g(time_us, 7)}  {_g(algbw, 6)}  {_g(busbw, 6)}  {bad:6g}"
        lines.append(
            f"{size:12d}  {size // 4:12d}  {'float':>8s}  {'sum':>6s}  {-1:6d}{body}{body}"
        )
    lines += [
        f"# {'Out of bounds values':<20s} : {0} {'OK'}",
        f"# {'Avg bus bandwidth':<20s} : {sum(bws) / len(bws):g} ",
        "#",
        "# Collective test concluded: all_reduce_perf",
        "",
    ]
    return "\n".join(lines) + "\n"


def _nccl_header(left: tuple[str, ...], right: tuple[str, ...]) -> str:
    widths = (10, 12, 8, 6, 6)
    head = "# " + "  ".join(f"{c:>{w}s}" for c, w in zip(left, widths, strict=True))
    place = "  ".join(f"{c:>{w}s}" for c, w in zip(right, (7, 6, 6, 6), strict=True))
    return f"{head}  {place}  {place} "


def _g(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: two decimals, fewer when the width would overflow."""
    for text in (f"{value:{width}.2f}", f"{value:{width}.1f}", f"{value:{width}.0f}"):
        if len(text) <= width:
            return text
    return f"{value:{width}.1e}"


def nvbandwidth_text(
    gpus: int,
    h2d_gbs: float,
    d2h_gbs: float,
    d2d_gbs: float,
    *,
    d2d_pairs: Mapping[tuple[int, int], float] | None = None,
) -> str:
    """`nvbandwidth -t host_to_device_memcpy_ce device_to_host_memcpy_ce
    device_to_device_memcpy_read_ce`; `d2d_pairs` overrides (row, column) cells, e.g.
    `slow_gpu_pairs` for one bad GPU."""
    pairs = d2d_pairs or {}
    devices = [f"Device {g}: NVIDIA H200 (00000000:{0x18 + 0x10 * g:02x}:00)" for g in range(gpus)]
    out = [
        "nvbandwidth Version: v0.8",
        "Built from Git version: v0.8",
        "",
        "CUDA Runtime Version: 12080",
        "CUDA Driver Version: 12080",
        "Driver Version: 570.133.20",
        "",
        "sim-node",
        *devices,
        "",
    ]
    host = {(0, g): v for g, v in enumerate([h2d_gbs] * gpus)}
    out += _nvb_block(
        "host_to_device_memcpy_ce", "memcpy CE CPU(row) -> GPU(column)", 1, gpus, host
    )
    back = {(0, g): d2h_gbs for g in range(gpus)}
    out += _nvb_block(
        "device_to_host_memcpy_ce", "memcpy CE CPU(row) <- GPU(column)", 1, gpus, back
    )
    d2d = {(r, c): pairs.get((r, c), d2d_gbs) for r in range(gpus) for c in range(gpus) if r != c}
    out += _nvb_block(
        "device_to_device_memcpy_read_ce", "memcpy CE GPU(row) -> GPU(column)", gpus, gpus, d2d
    )
    out += [
        "NOTE: The reported results may not reflect the full capabilities of the platform.",
        "Performance can vary with software drivers, hardware clocks, and system topology.",
        "",
    ]
    return "\n".join(out)


def slow_gpu_pairs(gpus: int, gpu: int, gbs: float) -> dict[tuple[int, int], float]:
    """Every device-to-device cell in `gpu`'s row and column at `gbs` (one bad GPU's links)."""
    return {(r, c): gbs for r in range(gpus) for c in range(gpus) if r != c and gpu in (r, c)}


def _nvb_block(
    testcase: str, title: str, rows: int, columns: int, cells: Mapping[tuple[int, int], float]
) -> list[str]:
    """One testcase as inline_common.h prints a PeerValueMatrix (N/A where no value)."""
    lines = [f"Running {testcase}.", f"{title} bandwidth (GB/s)"]
    lines.append("  " + "".join(f"{c:>10d}" for c in range(columns)))
    for r in range(rows):
        row = "".join(
            f"{cells[(r, c)]:>10.2f}" if (r, c) in cells else f"{'N/A':>10s}"
            for c in range(columns)
        )
        lines.append(f"{r:>2d}{row}")
    total = sum(cells.values())
    return [*lines, "", f"SUM {testcase} {total:.2f}", ""]


def ib_write_bw_report(gbps: float, *, hca: str = "mlx5_ib0", gpu: int = 0) -> str:
    """The client side of `ib_write_bw -s 8388608 -x 0 -F --report_gbits --use_cuda=GPU -d
    HCA host`, as Azure's GPUDirect check runs it."""
    size, iters = 8388608, 5000
    rate = gbps * 1e9 / 8 / size / 1e6  # messages per second, in millions
    line = "-" * 87
    return "\n".join(
        [
            "initializing CUDA",
            "Listing all CUDA devices in system:",
            *(f"CUDA device {g}: PCIe address is {0x18 + 0x10 * g:02X}:00" for g in range(8)),
            "",
            f"Picking device No. {gpu}",
            f"[pid = 4242, dev = {gpu}] device name = [NVIDIA H200]",
            "creating CUDA Ctx",
            "making it the current CUDA Ctx",
            "CUDA device integrated: 0",
            "allocated GPU buffer address at 0x7f2f4a000000",
            line,
            "                    RDMA_Write BW Test",
            f" Dual-port       : OFF\t\tDevice         : {hca}",
            " Number of qps   : 1\t\tTransport type : IB",
            " Connection type : RC\t\tUsing SRQ      : OFF",
            " PCIe relax order: ON\t\tLock-free      : OFF",
            " ibv_wr* API     : ON\t\tUsing Enhanced Reorder      : OFF",
            " TX depth        : 128",
            " CQ Moderation   : 1",
            " CQE Poll Batch  : 16",
            " Mtu             : 4096[B]",
            " Link type       : IB",
            " Max inline data : 0[B]",
            " rdma_cm QPs\t : OFF",
            " Data ex. method : Ethernet",
            line,
            " local address: LID 0x1b QPN 0x0127 PSN 0x3c5a1e RKey 0x1fff00 VAddr 0x007f2f4a800000",
            " remote address: LID 0x1b QPN 0x0126 PSN 0x8d21f4 RKey 0x1ffe00 "
            "VAddr 0x007f2f4a000000",
            line,
            " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]",
            # REPORT_FMT: " %-7lu    %-10lu       %-7.2lf            %-7.2lf\t\t     %-7.6lf"
            f" {size:<7d}    {iters:<10d}       {gbps * 1.001:<7.2f}            "
            f"{gbps:<7.2f}\t\t     {rate:<7.6f}",
            line,
            "destroying current CUDA Ctx",
            "",
        ]
    )
