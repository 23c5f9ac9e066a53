"""Check the agent against a real GPU: `gpuops agent --once --json`, validated against the
event schema, plus the NVML event listener's timeout path and per-sample cost.

Usage on a GPU node:  python3 scripts/gpu_check.py OUTDIR
Writes OUTDIR/agent_once.jsonl and OUTDIR/gpu_check.json; exits 1 if a check fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
    backend.close()
    ok = (
        done.returncode == 0
        and telemetry is not None
        and all(not e["schema_errors"] for e in report["events"])  # type: ignore[union-attr]
        and all(p["outcome"] == "pass" for p in report["probes"])
    )  # type: ignore[union-attr]
    report["ok"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check")))
