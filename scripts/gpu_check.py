"""Check the agent against a real GPU: `gpuops agent --once --json`, validated against the
event schema, plus the NVML event listener's timeout path and per-sample cost, and the
interconnect reads: GPM metrics over two samples under a load (bf16 matmul, then a
memory copy; torch or cupy when installed, else idle), NVLink link states and counters,
InfiniBand sysfs, the PCI addresses kernel-log XIDs are placed by, and whether
/dev/kmsg is readable.

Usage on a GPU node:  python3 scripts/gpu_check.py OUTDIR
Writes OUTDIR/agent_once.jsonl and OUTDIR/gpu_check.json; exits 1 if a check fails.
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
    backend.close()
    ok = (
        done.returncode == 0
        and telemetry is not None
        and all(not e["schema_errors"] for e in report["events"])  # type: ignore[union-attr]
        and all(p["outcome"] == "pass" for p in report["probes"])
        and bool(links["gpm_ok"])
    )  # type: ignore[union-attr]
    report["ok"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


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


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check")))
