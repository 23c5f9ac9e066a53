"""Check the agent against a real GPU: `gpuops agent --once --json`, validated against the
event schema, plus the NVML event listener's timeout path and per-sample cost, and the
interconnect reads: GPM metrics over two samples under a load (bf16 matmul, then a
memory copy; torch or cupy when installed, else idle), NVLink link states and counters,
InfiniBand sysfs, the PCI addresses kernel-log XIDs are placed by, and whether
/dev/kmsg is readable. Then the graded diagnostics on the real tools: grade 1 (nvidia-smi's
GPU list, `dcgmi diag -r 1 -j`) and grade 2 where nvbandwidth is installed, judged by
gpuops.diagnose against the H200's numbers for as many GPUs as the machine has (their
outputs kept in OUTDIR), and the node's topology as `gpuops topology learn` would write it
(OUTDIR/topology.yml). A tool that is not installed is reported, not failed: the lent
machine need not have DCGM.

Usage on a GPU node:  python3 scripts/gpu_check.py OUTDIR
Writes OUTDIR/agent_once.jsonl and OUTDIR/gpu_check.json; exits 1 if a check fails.

    python3 scripts/gpu_check.py OUTDIR --power-sweep   (root: it sets power limits)
A power-limit sweep of GPU 0 under a bf16 matmul (PyTorch or CuPy): at each limit from
300 to 700 W, the SM clock, board power and matmul TFLOP/s, printed as a table and written
to OUTDIR/power_sweep.json with the fitted `alpha` and `ref_w`/`ref_clock_mhz` of
gpuops/sim/data/power_model.yml. The limit the GPU had is set back at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuops.agent.infiniband import DEFAULT_ROOT, read_ib  # noqa: E402
from gpuops.agent.kmsg import DEFAULT_PATH  # noqa: E402
from gpuops.agent.nvml import NvmlBackend  # noqa: E402
from gpuops.models import EVENT_ADAPTER, event_json_schema  # noqa: E402


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gpuops.cli", "agent", "--once", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    report["agent_once_s"] = round(time.perf_counter() - started, 3)
    report["agent_once_rc"] = done.returncode
    report["agent_once_stderr"] = done.stderr[-2000:]
    (out / "agent_once.jsonl").write_text(done.stdout)
    validator = jsonschema.Draft202012Validator(event_json_schema())
    events = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    report["events"] = [
        {
            "kind": e["kind"],
            "schema_errors": [x.message for x in validator.iter_errors(e)],
            "model_ok": bool(EVENT_ADAPTER.validate_python(e)),
        }
        for e in events
    ]
    telemetry = next((e for e in events if e["kind"] == "telemetry"), None)
    if telemetry:
        gpus = telemetry["data"]["gpus"]
        report["gpu_fields_present"] = sorted(gpus[0])
        report["gpu0"] = gpus[0]
    report["probes"] = [e["data"] for e in events if e["kind"] == "probe"]
    backend = NvmlBackend()
    t0 = time.perf_counter()
    waited = backend.wait_events(200)
    report["event_wait_200ms"] = {"signals": len(waited), "s": round(time.perf_counter() - t0, 3)}
    t0 = time.perf_counter()
    for _ in range(20):
        backend.sample()
    report["sample_ms_per_node"] = round((time.perf_counter() - t0) / 20 * 1000, 2)
    try:
        links = interconnect(backend)
    except Exception as exc:  # report what failed; the checks above still count
        links = {"error": repr(exc), "gpm_ok": False}
    report["interconnect"] = links
    report["topology"] = learn_topology(backend, events, out)
    backend.close()
    report["grades"] = graded(out)
    ok = (
        done.returncode == 0
        and telemetry is not None
        and all(not e["schema_errors"] for e in report["events"])  # type: ignore[union-attr]
        and all(p["outcome"] == "pass" for p in report["probes"])
        and bool(links["gpm_ok"])
        and all(g.get("ok", True) for g in report["grades"].values())  # type: ignore[union-attr]
    )  # type: ignore[union-attr]
    report["ok"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


def _run(argv: list[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return -1, ""
    except subprocess.TimeoutExpired:
        return -2, ""
    return done.returncode, done.stdout


def graded(out: Path) -> dict[str, dict[str, object]]:
    """Grades 1 and 2 on the real tools, judged as the gate judges them (a tool that is
    not installed is said, and that grade left unjudged)."""
    from gpuops.diagnose.grades import GPU_QUERY, judge
    from gpuops.diagnose.skus import load

    _, gpus = _run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"], 60)
    count = len([line for line in gpus.splitlines() if line.strip()])
    base = load().get("h200-8gpu")
    sku = base.model_copy(
        update={"gpu_count": base.gpu_count.model_copy(update={"value": max(count, 1)})}
    )
    (out / "gpus.csv").write_text(gpus)
    outputs = {"gpus": gpus}
    report: dict[str, dict[str, object]] = {}
    for grade, tools in (
        (1, [("dcgm", ["dcgmi", "diag", "-r", "1", "-j"], 600)]),
        (
            2,
            [
                ("dcgm", ["dcgmi", "diag", "-r", "2", "-j"], 1800),
                (
                    "nvbandwidth",
                    [
                        "nvbandwidth",
                        "-t",
                        "host_to_device_memcpy_ce",
                        "device_to_host_memcpy_ce",
                        "device_to_device_memcpy_read_ce",
                    ],
                    900,
                ),
            ],
        ),
    ):
        missing = []
        for name, argv, timeout in tools:
            code, text = _run(argv, timeout)
            if code == -1:
                missing.append(argv[0])
            (out / f"grade-{grade}-{name}.txt").write_text(text)
            outputs[name] = text
        if missing:
            report[f"grade{grade}"] = {"skipped": f"not installed: {', '.join(missing)}"}
            continue
        result = judge(grade, outputs, sku)
        report[f"grade{grade}"] = {
            "ok": result.ok,
            "summary": result.summary(),
            "checks": [c.model_dump(exclude_none=True) for c in result.checks],
        }
    return report


def learn_topology(backend: NvmlBackend, events: list[dict], out: Path) -> dict[str, object]:
    """The node's topology at its links' maxima, as `gpuops topology learn` writes it."""
    from gpuops.agent.topology import observe
    from gpuops.diagnose.topology import dump, learned

    telemetry = next((e for e in events if e["kind"] == "telemetry"), None)
    if telemetry is None:
        return {"error": "no telemetry to read the links from"}
    ib = read_ib(DEFAULT_ROOT) if DEFAULT_ROOT.is_dir() else None
    seen = observe(
        telemetry["data"]["gpus"],
        backend.pci_bus_ids(),
        Path("/sys"),
        ib,
        DEFAULT_ROOT,
        maxima=True,
    )
    text = dump(learned(seen, os.uname().nodename, "h200", time.strftime("%Y-%m-%dT%H:%M:%SZ")))
    (out / "topology.yml").write_text(text)
    return seen.model_dump(mode="json", exclude_none=True)


# A load for GPU 0 that prints "ready" once warm, then runs PHASE for SECONDS.
LOAD = """
import sys, time
phase, seconds = sys.argv[1], float(sys.argv[2])
try:
    import torch
    dev = "cuda:0"
    if phase == "matmul":
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        op = lambda: a @ b
    else:
        x = torch.empty(4 << 30, device=dev, dtype=torch.uint8)
        y = torch.empty_like(x)
        op = lambda: y.copy_(x)
    sync = torch.cuda.synchronize
except ImportError:
    import cupy
    if phase == "matmul":
        a = cupy.random.rand(8192, 8192, dtype=cupy.float32).astype(cupy.float16)
        b = a.copy()
        op = lambda: a @ b
    else:
        x = cupy.zeros(4 << 30, dtype=cupy.uint8)
        y = cupy.empty_like(x)
        op = lambda: y.__setitem__(slice(None), x)
    sync = cupy.cuda.Device(0).synchronize
op(); sync()
print("ready", flush=True)
end = time.time() + seconds
while time.time() < end:
    for _ in range(10):
        op()
    sync()
"""
GPM_FIELDS = ("dram_bw_util", "sm_active", "sm_occupancy", "tensor_active")
NVLINK_FIELDS = (
    "nvlink_rx_bytes_s",
    "nvlink_tx_bytes_s",
    "nvlink_links_active",
    "nvlink_links_down",
    "nvlink_crc_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
)


def gpm_under(backend: NvmlBackend, phase: str, seconds: float = 4.0) -> dict[str, object]:
    """GPU 0's GPM fields over a sample taken once the load is warm and one after it ends."""
    if phase == "idle":
        backend.sample()
        time.sleep(seconds)
        gpu = backend.sample()[0][0]
        return {"load": "idle", **{f: gpu.get(f) for f in GPM_FIELDS + NVLINK_FIELDS[:2]}}
    load = subprocess.Popen(
        [sys.executable, "-c", LOAD, phase, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert load.stdout is not None
    ready = load.stdout.readline().strip() == "ready"
    backend.sample()  # the first of the two samples
    _, err = load.communicate(timeout=120)
    gpu = backend.sample()[0][0]
    return {
        "load": "ran" if ready and load.returncode == 0 else f"none ({err.strip()[-300:]})",
        **{f: gpu.get(f) for f in GPM_FIELDS + NVLINK_FIELDS[:2]},
    }


def nvlink(backend: NvmlBackend) -> dict[str, object]:
    """Which links each GPU answered for, and link 0's raw answer (the recorded H200: none)."""
    nv = backend.nv
    try:
        link0: object = nv.nvmlDeviceGetNvLinkState(backend.handles[0], 0)
    except nv.NVMLError as exc:
        link0 = f"error: {exc}"
    gpu = backend.sample()[0][0]
    return {
        "links": {str(i): list(links) for i, links in backend.nvlinks.links.items()},
        "link0_state": link0,
        **{f: gpu.get(f) for f in NVLINK_FIELDS[2:]},
    }


def kmsg_readable(path: Path = DEFAULT_PATH) -> dict[str, object]:
    """Whether the agent could follow the kernel log here, and how many NVRM lines it holds."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return {"path": str(path), "readable": False, "error": str(exc)}
    records = nvrm = 0
    try:
        while records < 100_000:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: overwritten while reading; the next read goes on
                continue
            if not record:
                break
            records += 1
            nvrm += b"NVRM: Xid" in record or b"SXid" in record
    finally:
        os.close(fd)
    return {"path": str(path), "readable": True, "records": records, "xid_or_sxid_lines": nvrm}


def interconnect(backend: NvmlBackend) -> dict[str, object]:
    """Every interconnect and bandwidth read the agent makes, as this machine answers it."""
    out: dict[str, object] = {
        "gpm_supported": {str(k): v for k, v in backend.gpm.supported.items()},
        "gpm_idle": gpm_under(backend, "idle", 2.0),
        "gpm_matmul": gpm_under(backend, "matmul"),
        "gpm_copy": gpm_under(backend, "copy"),
        "nvlink": nvlink(backend),
        "infiniband": read_ib(DEFAULT_ROOT),
        "pci_bus_ids": {
            f"{d:04x}:{b:02x}:{v:02x}": i for (d, b, v), i in backend.pci_bus_ids().items()
        },
        "kmsg": kmsg_readable(),
    }
    supported = {str(k): v for k, v in backend.gpm.supported.items()}  # known by now
    out["gpm_supported"] = supported
    matmul = out["gpm_matmul"]
    assert isinstance(matmul, dict)
    # On Hopper the fields must come back after two samples; under the loads they move.
    out["gpm_ok"] = not any(supported.values()) or all(
        matmul.get(f) is not None for f in GPM_FIELDS
    )
    return out


SWEEP_LIMITS_W = tuple(range(300, 701, 50))
SWEEP_SECONDS = 8.0
MATMUL_N = 8192


def _matmul() -> tuple[object, object]:
    """A bf16 matmul step on GPU 0 and a synchronize, with whichever library is there."""
    try:
        import torch

        a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
        return (lambda: a @ b), torch.cuda.synchronize
    except ImportError:
        import cupy

        a = cupy.random.rand(MATMUL_N, MATMUL_N, dtype=cupy.float32).astype(cupy.float16)
        b = cupy.random.rand(MATMUL_N, MATMUL_N, dtype=cupy.float32).astype(cupy.float16)
        return (lambda: a @ b), cupy.cuda.Device(0).synchronize


def _at_limit(pynvml: object, handle: object, watts: int, step: object, sync: object) -> dict:
    """Run the matmul for SWEEP_SECONDS under `watts`; power and clock of the second half."""
    nv: object = pynvml
    nv.nvmlDeviceSetPowerManagementLimit(handle, watts * 1000)  # type: ignore[attr-defined]
    samples, done, t0 = [], 0, time.perf_counter()
    while (now := time.perf_counter()) - t0 < SWEEP_SECONDS:
        for _ in range(4):
            step()  # type: ignore[operator]
        sync()  # type: ignore[operator]
        done += 4
        if now - t0 >= SWEEP_SECONDS / 2:
            samples.append(
                (
                    now,
                    done,
                    nv.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # type: ignore[attr-defined]
                    nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),  # type: ignore[attr-defined]
                    nv.nvmlDeviceGetCurrentClocksEventReasons(handle),  # type: ignore[attr-defined]
                )
            )
    (ta, na, *_), (tb, nb, *_) = samples[0], samples[-1]
    flops = 2 * MATMUL_N**3 * (nb - na) / max(tb - ta, 1e-9)
    return {
        "limit_w": watts,
        "power_w": round(sum(x[2] for x in samples) / len(samples), 1),
        "sm_clock_mhz": round(sum(x[3] for x in samples) / len(samples)),
        "tflops": round(flops / 1e12, 1),
        "clocks_event_reasons": sorted({int(x[4]) for x in samples}),
    }


def fit_model(rows: list[dict], idle_w: float) -> dict[str, float]:
    """alpha in P = idle + k * f^alpha, least squares in logs over the power-capped rows;
    ref_w/ref_clock_mhz: the highest limit's point."""
    import math

    pts = [
        (math.log(r["sm_clock_mhz"]), math.log(r["power_w"] - idle_w))
        for r in rows
        if r["power_w"] > idle_w and r["sm_clock_mhz"] > 0
    ]
    if len(pts) < 2:
        return {}
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    alpha = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    top = max(rows, key=lambda r: r["limit_w"])
    return {
        "alpha": round(alpha, 3),
        "ref_w": top["power_w"],
        "ref_clock_mhz": top["sm_clock_mhz"],
        "idle_w": idle_w,
    }


def power_sweep(out: Path) -> int:
    """Sweep GPU 0's power limit under a bf16 matmul; the table, and OUTDIR/power_sweep.json."""
    import pynvml

    out.mkdir(parents=True, exist_ok=True)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    before = pynvml.nvmlDeviceGetPowerManagementLimit(handle)
    lo, hi = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    idle_w = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    step, sync = _matmul()
    rows = []
    try:
        for watts in SWEEP_LIMITS_W:
            if lo <= watts * 1000 <= hi:
                rows.append(_at_limit(pynvml, handle, watts, step, sync))
    finally:
        pynvml.nvmlDeviceSetPowerManagementLimit(handle, before)
        pynvml.nvmlShutdown()
    print(f"{'limit W':>8} {'power W':>8} {'SM MHz':>7} {'TFLOP/s':>8}  reasons")
    for r in rows:
        print(
            f"{r['limit_w']:>8} {r['power_w']:>8} {r['sm_clock_mhz']:>7} {r['tflops']:>8}  "
            f"{r['clocks_event_reasons']}"
        )
    report = {"idle_w": idle_w, "rows": rows, "model": fit_model(rows, idle_w)}
    print(f"fitted for gpuops/sim/data/power_model.yml: {report['model']}")
    (out / "power_sweep.json").write_text(json.dumps(report, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    _args = [a for a in sys.argv[1:] if not a.startswith("--")]
    _out = Path(_args[0] if _args else "gpu-check")
    sys.exit(power_sweep(_out) if "--power-sweep" in sys.argv[1:] else main(_out))
