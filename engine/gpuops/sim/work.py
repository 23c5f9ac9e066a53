"""Running work on a simulated node: Slurm jobs and Kubernetes pods, kept in its state.

A job ends by itself at `ends_at`; a pod runs until it is evicted (then it stops
`grace_s` later) or, when given a duration, until it ends. What left the node, and how
(completed, evicted, killed by a reboot), is kept in `work_log`, so a test can tell a
job that finished from one a reboot killed.

Times are wall-clock epoch seconds, passed in by the caller: the tool shims run as
processes on the wall clock, and so do the playbooks' waits, even when the fleet's
telemetry runs on a scaled clock.
"""

from __future__ import annotations

import zlib
from typing import Any

Work = dict[str, Any]


def add_job(state: dict[str, Any], now: float, duration_s: float, **params: Any) -> Work:
    """A Slurm job that started now and ends by itself after `duration_s`."""
    job_id = int(params.get("id", state.get("next_job_id", 1001)))
    state["next_job_id"] = max(job_id, int(state.get("next_job_id", 1001))) + 1
    job = {
        "id": job_id,
        "name": str(params.get("name", f"job-{job_id}")),
        "started_at": now,
        "ends_at": now + duration_s,
        "gpus": _gpus(state, params.get("gpus")),
    }
    state.setdefault("jobs", []).append(job)
    return job


def add_pod(state: dict[str, Any], now: float, **params: Any) -> Work:
    """A Kubernetes pod bound to this node; `pdb` makes its PodDisruptionBudget refuse eviction."""
    duration = params.get("duration_s")
    pod = {
        "name": str(params.get("name", f"pod-{len(state.get('pods', [])) + 1}")),
        "namespace": str(params.get("namespace", "default")),
        "grace_s": float(params.get("grace_s", 30.0)),  # Kubernetes' default grace period
        "pdb": bool(params.get("pdb", False)),
        "started_at": now,
        "ends_at": None if duration is None else now + float(duration),
        "evicted_at": None,
        "gpus": _gpus(state, params.get("gpus")),
    }
    state.setdefault("pods", []).append(pod)
    return pod


def _gpus(state: dict[str, Any], wanted: Any) -> list[int]:
    """The GPUs the work holds: the listed ones, or (as most GPU jobs do) all of them."""
    if wanted is None:
        return [g["index"] for g in state["gpus"]]
    return [int(i) for i in (wanted if isinstance(wanted, list) else [wanted])]


def pod_gone_at(pod: Work) -> float | None:
    """When a pod stops: its own end, or the end of its grace period after eviction."""
    ends = [t for t in (pod["ends_at"],) if t is not None]
    if pod["evicted_at"] is not None:
        ends.append(pod["evicted_at"] + pod["grace_s"])
    return min(ends) if ends else None


def running_jobs(state: dict[str, Any], now: float) -> list[Work]:
    """Jobs still running at `now`."""
    return [j for j in state.get("jobs", []) if j["ends_at"] > now]


def running_pods(state: dict[str, Any], now: float) -> list[Work]:
    """Pods still on the node at `now` (terminating ones included, as kubectl lists them)."""
    return [p for p in state.get("pods", []) if (gone := pod_gone_at(p)) is None or gone > now]


def settle(state: dict[str, Any], now: float) -> None:
    """Move work that ended by `now` to the log, at the time it really ended."""
    for job in [j for j in state.get("jobs", []) if j["ends_at"] <= now]:
        _log(state, "job", job, "completed", job["ends_at"])
    state["jobs"] = running_jobs(state, now)
    for pod in [p for p in state.get("pods", []) if p not in running_pods(state, now)]:
        how = "evicted" if pod["evicted_at"] is not None else "completed"
        _log(state, "pod", pod, how, pod_gone_at(pod) or now)
    state["pods"] = running_pods(state, now)


def kill_all(state: dict[str, Any], now: float) -> None:
    """What a reboot does to work still running: it dies."""
    settle(state, now)
    for job in state.get("jobs", []):
        _log(state, "job", job, "killed", now)
    for pod in state.get("pods", []):
        _log(state, "pod", pod, "killed", now)
    state["jobs"], state["pods"] = [], []


def _log(state: dict[str, Any], kind: str, work: Work, how: str, at: float) -> None:
    name = work["id"] if kind == "job" else f"{work['namespace']}/{work['name']}"
    state.setdefault("work_log", []).append({"kind": kind, "name": name, "how": how, "at": at})


def pids(state: dict[str, Any], gpu: int, now: float) -> list[int]:
    """Processes on one GPU: a stray one (the busy fault) and those of running work."""
    stray = [g.get("processes", []) for g in state["gpus"] if g["index"] == gpu]
    jobs = [100_000 + j["id"] for j in running_jobs(state, now) if gpu in j["gpus"]]
    pods = [
        200_000 + zlib.crc32(p["name"].encode()) % 100_000
        for p in running_pods(state, now)
        if gpu in p["gpus"]
    ]
    return [*(stray[0] if stray else []), *jobs, *pods]
