"""The known-answer GPU probe: a deterministic matrix product on the GPU checked on the CPU.

It runs in a child process so a GPU that hangs can be killed on timeout without taking
the agent with it. CuPy or PyTorch is used when installed; a configured command can
stand in for both; with none of them the probe is `unavailable`, which is not a pass.
Run as `python -m gpuops.agent.probe GPU [GPU ...]`: one JSON result per line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

SIZE = 1024
TOLERANCE = 1e-6


def _result(gpu: int, outcome: str, started: float, error: str | None = None) -> dict[str, Any]:
    return {
        "gpu": gpu,
        "ok": outcome == "pass",
        "outcome": outcome,
        "error": error,
        "duration_s": round(time.perf_counter() - started, 4),
    }


def _with_torch(gpu: int) -> tuple[float, str]:
    import torch

    if not torch.cuda.is_available():
        raise ImportError("torch has no CUDA device")
    idx = torch.arange(SIZE * SIZE, dtype=torch.float64).reshape(SIZE, SIZE)
    a, b = (idx % 7 - 3) / 3, (idx % 5 - 2) / 5
    got = (a.to(f"cuda:{gpu}") @ b.to(f"cuda:{gpu}")).cpu()
    return float((got - a @ b).abs().max()), "torch"


def _with_cupy(gpu: int) -> tuple[float, str]:
    import cupy
    import numpy

    idx = numpy.arange(SIZE * SIZE, dtype=numpy.float64).reshape(SIZE, SIZE)
    a, b = (idx % 7 - 3) / 3, (idx % 5 - 2) / 5
    with cupy.cuda.Device(gpu):
        got = cupy.asnumpy(cupy.asarray(a) @ cupy.asarray(b))
    return float(numpy.abs(got - a @ b).max()), "cupy"


def probe_in_process(gpu: int) -> dict[str, Any]:
    """Probe one GPU here (the child process does this)."""
    started = time.perf_counter()
    for attempt in (_with_cupy, _with_torch):
        try:
            err, lib = attempt(gpu)
        except ImportError:
            continue
        except Exception as exc:
            return _result(gpu, "fail", started, f"{type(exc).__name__}: {exc}")
        if err <= TOLERANCE:
            return {**_result(gpu, "pass", started), "library": lib, "max_abs_err": err}
        return _result(gpu, "fail", started, f"max abs error {err:.3g} > {TOLERANCE} ({lib})")
    return _result(gpu, "unavailable", started, "neither CuPy nor PyTorch with CUDA is installed")


def run_probe(
    gpus: list[int], timeout_s: float, command: list[str] | None = None
) -> list[dict[str, Any]]:
    """Probe GPUs in a child process (or run `command`); a hang past the timeout is a timeout."""
    started = time.perf_counter()
    if command:
        return [_run_command(gpu, command, timeout_s) for gpu in gpus]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gpuops.agent.probe", *map(str, gpus)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return [_result(g, "timeout", started, f"no answer within {timeout_s}s") for g in gpus]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(results) != len(gpus):
        why = (done.stderr or "no output").strip()[-300:]
        return [
            _result(g, "fail", started, f"probe process exited {done.returncode}: {why}")
            for g in gpus
        ]
    return results


def _run_command(gpu: int, command: list[str], timeout_s: float) -> dict[str, Any]:
    started = time.perf_counter()
    argv = [part.replace("{gpu}", str(gpu)) for part in command]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return _result(gpu, "timeout", started, f"no answer within {timeout_s}s")
    except OSError as exc:
        return _result(gpu, "unavailable", started, f"probe command: {exc}")
    if done.returncode == 0:
        return _result(gpu, "pass", started)
    return _result(
        gpu, "fail", started, (done.stderr or done.stdout).strip()[-300:] or f"rc={done.returncode}"
    )


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(probe_in_process(int(arg))), flush=True)


_NONCE = re.compile(r"[0-9a-f]{1,64}")


def requested_nonce(request: bytes) -> str | None:
    """The nonce a validation request carries (`{"nonce": "..."}`), for the probe's
    answer to echo; None for anything else (bounded: a request is read from the bus)."""
    if len(request) > 256:
        return None
    try:
        nonce = json.loads(request).get("nonce")
    except (ValueError, AttributeError):
        return None
    return nonce if isinstance(nonce, str) and _NONCE.fullmatch(nonce) else None
