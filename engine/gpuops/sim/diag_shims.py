"""The diagnostic tools on a simulated node: dcgmi, nvbandwidth, all_reduce_perf,
perftest's ib_write_bw and nvidia-bug-report.

Each prints its real tool's output format (gpuops.sim.diagtools renders them; the
parsers in gpuops.diagnose read the same) with the numbers of a healthy H200 node, or of
the faults put on it: `slow_d2d` (one GPU's NVLink links at `gbs`), `dcgm_fail` (a DCGM
plugin failing on a GPU), `pcie_narrow` (nvidia-smi's shim reports the link width),
`bad_hca` (one HCA of the node at `gbps`: its pair with any peer runs at that rate).
Those are the hardware's: a reboot keeps them, a reprovisioning (a fresh image and
firmware) clears them, as `gpuops.sim.shims` boots nodes.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path
from typing import Any

from gpuops.sim import diagtools
from gpuops.sim.state import read

# What a healthy 8x H200 SXM node measures (its expectations sit ~5% under these:
# gpuops/diagnose/skus.yml).
HEALTHY = {
    "h2d_gbs": 55.3,
    "d2h_gbs": 55.1,
    "d2d_gbs": 368.0,
    "busbw_gbs": 478.0,
    "ib_gbps": 392.4,  # NDR 400G with GPUDirect, as Azure's ND H200 v5 measure it
}


def _faults(s: dict[str, Any], kind: str) -> dict[int, dict[str, Any]]:
    return {g["index"]: g["faults"][kind] for g in s["gpus"] if kind in g["faults"]}


def dcgmi(node_dir: Path, argv: list[str]) -> int:
    """`dcgmi diag -r LEVEL -j`: every plugin of the level, Pass unless a fault fails it."""
    if argv[:1] != ["diag"] or "-r" not in argv or "-j" not in argv:
        print("dcgmi (simulated) answers `dcgmi diag -r LEVEL -j` only", file=sys.stderr)
        return 1
    level = int(argv[argv.index("-r") + 1])
    s = read(node_dir)
    failing: dict[str, dict[int, str]] = {}
    for gpu, fault in _faults(s, "dcgm_fail").items():
        failing.setdefault(str(fault["plugin"]), {})[gpu] = str(fault["message"])
    print(diagtools.dcgmi_diag_json(level, len(s["gpus"]), failing))
    # dcgmi exits non-zero when a test failed (DCGM_ST_NVVS_ERROR), as the playbook expects
    return 226 if failing else 0


def nvbandwidth(node_dir: Path, argv: list[str]) -> int:
    """`nvbandwidth -t ...`: host<->device and device<->device copies of every GPU."""
    s = read(node_dir)
    pairs: dict[tuple[int, int], float] = {}
    for gpu, fault in _faults(s, "slow_d2d").items():
        pairs.update(diagtools.slow_gpu_pairs(len(s["gpus"]), gpu, float(fault["gbs"])))
    print(
        diagtools.nvbandwidth_text(
            len(s["gpus"]),
            HEALTHY["h2d_gbs"],
            HEALTHY["d2h_gbs"],
            HEALTHY["d2d_gbs"],
            d2d_pairs=pairs,
        )
    )
    return 0


def all_reduce_perf(node_dir: Path, argv: list[str]) -> int:
    """`all_reduce_perf -b 1G -e 16G -f 2 -g GPUS`: the ring runs at its slowest link."""
    s = read(node_dir)
    gpus = int(argv[argv.index("-g") + 1]) if "-g" in argv else len(s["gpus"])
    slow = [float(f["gbs"]) for f in _faults(s, "slow_d2d").values()]
    busbw = min([HEALTHY["busbw_gbs"], *(gbs * 1.3 for gbs in slow)])
    print(diagtools.all_reduce_perf_table(gpus, round(busbw, 2)))
    return 0


def ib_write_bw(node_dir: Path, argv: list[str]) -> int:
    """`ib_write_bw ... -d HCA [PEER]`: the server (no peer) waits and prints nothing
    here; the client prints the report of the pair, which runs at its slower end's HCA
    (the peer is a sibling node directory of the simulated fleet)."""
    if "-d" not in argv:
        print("ib_write_bw (simulated): give the HCA with -d", file=sys.stderr)
        return 1
    hca = argv[argv.index("-d") + 1]
    peer = argv[-1] if argv[-1] != hca and not argv[-1].startswith("-") else None
    if peer is None:
        return 0
    peer_dir = node_dir.parent / peer
    if not (peer_dir / "state.json").exists():
        print(f" Couldn't connect to {peer}:18515", file=sys.stderr)
        return 1
    rates = [HEALTHY["ib_gbps"], *(_hca_rate(d, hca) for d in (node_dir, peer_dir))]
    print(diagtools.ib_write_bw_report(min(rates), hca=hca))
    return 0


def nvidia_bug_report(node_dir: Path, argv: list[str]) -> int:
    """`nvidia-bug-report.sh --output-file FILE`: the log, gzipped, at FILE.gz (the real
    script appends `.gz`), with the node's GPUs as `nvidia-smi -q` would list them."""
    if "--output-file" not in argv:
        print("nvidia-bug-report (simulated) writes only to --output-file FILE", file=sys.stderr)
        return 1
    target = Path(argv[argv.index("--output-file") + 1] + ".gz")
    s = read(node_dir)
    lines = [
        "____________________________________________",
        "",
        "Start of NVIDIA bug report log file.  Please include this file, along",
        "with a detailed description of your problem, when reporting a graphics",
        "driver bug via the NVIDIA Linux forum or by sending email to linux-bugs@nvidia.com.",
        "",
        f"nvidia-bug-report.sh Version: (simulated) on {node_dir.name}",
        "",
        *(f"GPU {g['index']:08x}: NVIDIA H200, faults {sorted(g['faults'])}" for g in s["gpus"]),
        "",
        "End of NVIDIA bug report log file.",
    ]
    target.write_bytes(gzip.compress("\n".join(lines).encode()))
    print(
        f"nvidia-bug-report.sh will now collect information about your system and create "
        f"the file '{target}' in the current directory.\n\nComplete."
    )
    return 0


def dmesg(node_dir: Path, argv: list[str]) -> int:
    """`dmesg [--level=...]`: the node's kernel log (its /dev/kmsg records, `prio,seq,
    usec,flags;message`) as dmesg prints it, `[seconds.micros] message`."""
    kmsg = node_dir / "kmsg"
    records = kmsg.read_text(errors="replace").splitlines() if kmsg.exists() else []
    print("[    0.000000] Linux version 6.8.0 (simulated)")
    for record in records:
        head, _, message = record.partition(";")
        fields = head.split(",")
        usec = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0
        print(f"[{usec // 1_000_000:5d}.{usec % 1_000_000:06d}] {message}")
    return 0


def _hca_rate(node_dir: Path, hca: str) -> float:
    bad = read(node_dir).get("bad_hcas", {})
    return float(bad.get(hca, HEALTHY["ib_gbps"]))
