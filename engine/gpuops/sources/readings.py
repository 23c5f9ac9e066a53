"""Scraped series to events: grouped per node and GPU, mapped through the DCGM table.

Each series comes with the node its scrape target is (gpuops.sources.binding): a
series that names no usable GPU, or whose value is NaN or infinite (a Prometheus stale
marker, or a field DCGM could not read) or larger than any reading can be, is dropped
and counted by reason; it never becomes a published value.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpuops.models import MAX_GPUS, MAX_MAGNITUDE, GpuSample, new_event
from gpuops.sources import dcgm

log = logging.getLogger(__name__)

SOURCE = "prometheus"
MAX_GPU_INDEX = MAX_GPUS - 1  # no node has more; a larger `gpu` label is junk
MAX_LABELS = 64  # GpuSample.labels holds at most this many, values of at most 1024 chars
MAX_LABEL_VALUE = 1024
_PER_LINK = frozenset(n for m in dcgm.MAPPING if m.per_link for n in m.metrics)


@dataclass(frozen=True, slots=True)
class Series:
    """One sample of one series: its metric name, labels, value and (maybe) own time."""

    name: str
    labels: dict[str, str]
    value: float
    ts: float | None = None


@dataclass(slots=True)
class GpuReading:
    """One GPU's series of one scrape: metric -> link ("" for none) -> value."""

    labels: dict[str, str]
    values: dict[str, dict[str, float]] = field(default_factory=dict)

    def flat(self) -> dict[str, float]:
        """One value per metric: summed over links where the table says so."""
        out: dict[str, float] = {}
        for name, links in self.values.items():
            if name in _PER_LINK:
                out[name] = sum(links.values())
            else:
                out[name] = links.get("", next(iter(links.values())))
        return out


@dataclass(slots=True)
class NodeReading:
    """Every GPU of one node in one scrape, and the newest timestamp its series carried."""

    gpus: dict[int, GpuReading] = field(default_factory=dict)
    ts: float | None = None


def instance_host(instance: str | None) -> str | None:
    """`host:port` (or `[v6]:port`) without the port."""
    if not instance:
        return None
    if instance.startswith("["):
        return instance[1 : instance.find("]")] or None
    host, sep, port = instance.rpartition(":")
    return host if sep and port.isdigit() else instance


def group(
    bound: dict[str, list[Series]], gpu_label: str, dropped: Counter[str]
) -> dict[str, NodeReading]:
    """Each node's series per GPU; what cannot be placed is counted in `dropped`."""
    nodes: dict[str, NodeReading] = {}
    for node, series in bound.items():
        reading = NodeReading()
        for s in series:
            why = _unusable(s, gpu_label)
            if why is not None:
                dropped[why] += 1
                continue
            gpu = reading.gpus.setdefault(int(s.labels[gpu_label]), GpuReading(labels=s.labels))
            link = dcgm.first_label(s.labels, dcgm.LINK_LABELS) or ""
            gpu.values.setdefault(s.name, {}).setdefault(link, s.value)
            if s.ts is not None:
                reading.ts = s.ts if reading.ts is None else max(reading.ts, s.ts)
        if reading.gpus:
            nodes[node] = reading
    return nodes


# A sample's own time is the event's: one no RFC 3339 text can hold (NaN, a year past
# 9999, before 1970) made the node's event raise and the whole scrape fail, every node's.
LAST_TIME = 253_402_300_799.0  # 9999-12-31T23:59:59Z


def _unusable(s: Series, gpu_label: str) -> str | None:
    if not math.isfinite(s.value):
        return "not_finite"
    # Past what an event may hold, a value is junk; and two finite ones near 1e308,
    # summed (FB used + free, per-link counters), overflow to inf and break conversion.
    if abs(s.value) > MAX_MAGNITUDE:
        return "out_of_range"
    if s.ts is not None and not 0.0 <= s.ts <= LAST_TIME:  # NaN fails both
        return "bad_timestamp"
    if s.labels.get(dcgm.MIG_LABEL):
        return "mig_instance"
    gpu = s.labels.get(gpu_label, "")
    # isascii: "²".isdigit() is true, and int("²") would break the whole scrape.
    if not (gpu.isascii() and gpu.isdigit()) or int(gpu) > MAX_GPU_INDEX:
        return "bad_gpu"
    return None


def gpu_sample(index: int, reading: GpuReading) -> dict[str, Any]:
    """The GpuSample of one GPU (validated), as published: nulls left out."""
    labels = reading.labels
    raw: dict[str, Any] = {
        "index": index,
        "uuid": dcgm.first_label(labels, dcgm.UUID_LABELS),
        "name": dcgm.first_label(labels, dcgm.MODEL_LABELS),
        **dcgm.convert(reading.flat()),
        "labels": kept_labels(labels),
    }
    for name, spellings in dcgm.WORKLOAD_LABELS.items():
        value = dcgm.first_label(labels, spellings)
        raw[name] = value[:253] if value else None
    return GpuSample.model_validate(raw).model_dump(mode="json", exclude_none=True)


def kept_labels(labels: dict[str, str]) -> dict[str, str]:
    """The raw labels, as many as GpuSample keeps, for people correlating."""
    names = sorted(n for n in labels if n != "__name__")[:MAX_LABELS]
    return {n: labels[n][:MAX_LABEL_VALUE] for n in names}


def telemetry_event(
    node: str, reading: NodeReading, now: float, dropped: Counter[str]
) -> dict[str, Any] | None:
    """One telemetry event for the node's GPUs, or None when none is valid."""
    gpus = []
    for index in sorted(reading.gpus):
        # One GPU's bad page costs its own sample only: anything its conversion raises
        # (ValidationError is a ValueError) would otherwise end the scrape of every node.
        try:
            gpus.append(gpu_sample(index, reading.gpus[index]))
        except (ValueError, ArithmeticError) as exc:
            dropped["invalid"] += 1
            why = f"{type(exc).__name__}: {exc}"
            log.warning("node %s GPU %d: not a valid sample, dropped (%s)", node, index, why)
    if not gpus:
        return None
    t = reading.ts if reading.ts is not None else now
    return new_event("telemetry", node, t, {"gpus": gpus}, SOURCE)


class XidWatch:
    """Remembers each GPU's last XID: a change to a non-zero value is an `xid` event.

    The first value seen after start is only remembered: DCGM keeps the last XID for as
    long as the driver runs, so it may be days old, and acting on it at every restart of
    the source would repeat an old remedy. The same XID twice in a row does not change
    the value, so DCGM_FI_DEV_XID_ERRORS cannot show it (the agent or kernel log can).
    """

    def __init__(self) -> None:
        self.last: dict[tuple[str, int], int] = {}

    def events(self, node: str, reading: NodeReading, now: float) -> list[dict[str, Any]]:
        """The XID events this scrape shows for one node."""
        out = []
        t = reading.ts if reading.ts is not None else now
        for index in sorted(reading.gpus):
            gpu = reading.gpus[index]
            value = gpu.flat().get(dcgm.XID_METRIC)
            if value is None or value < 0:
                continue
            xid, before = int(value), self.last.get((node, index))
            self.last[(node, index)] = xid
            if before is None or xid in (before, 0):
                continue
            data = {
                "gpu": index,
                "xid": xid,
                "message": f"{dcgm.XID_METRIC} changed from {before} to {xid}",
                "labels": kept_labels(gpu.labels),
            }
            out.append(new_event("xid", node, t, data, SOURCE))
        return out
