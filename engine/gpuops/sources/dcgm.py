"""DCGM fields as dcgm-exporter publishes them, mapped to GpuSample fields: the one table.

The table is data: the scraper reads it, `gpuops validate --source dcgm` reads it to
say which rules cannot fire, and docs/sources.md prints it. Units are DCGM's (its
field catalogue and dcgm-exporter's counters CSV); each converter turns them into the
units of GpuSample (docs/events.md). A field the exporter does not publish stays null.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


def _num(v: float) -> float:
    return float(v)


def _int(v: float) -> int:
    return round(v)


def _bool(v: float) -> bool:
    return v != 0


def _percent(v: float) -> float:
    # DCGM's profiling fields are ratios (0..1); GpuSample holds percent of peak.
    return round(v * 100.0, 3)


def _mib(v: float) -> int:
    return round(v) * MIB


def _milli(v: float) -> float:
    return v / 1000.0


@dataclass(frozen=True, slots=True)
class FieldMap:
    """One GpuSample field and the DCGM metric(s) it comes from (the first present wins)."""

    field: str
    metrics: tuple[str, ...]
    unit: str  # the DCGM metric's unit, as DCGM documents it
    convert: Callable[[float], Any] = _num
    # Used when none of `metrics` is published: the sum of these, if all are present
    # (FB_RESERVED may be missing on older exporters, and then counts as 0).
    sum_of: tuple[str, ...] = ()
    sum_optional: tuple[str, ...] = ()
    # Summed over the series of distinct NVLink links, when an exporter publishes per link.
    per_link: bool = False
    # Published by dcgm-exporter's shipped etc/default-counters.csv (3.x) without editing
    # it: its DCP block lists GR_ENGINE, PIPE_TENSOR and DRAM_ACTIVE, not SM_ACTIVE/OCCUPANCY.
    default: bool = False


F = FieldMap
MAPPING: tuple[FieldMap, ...] = (
    F("temp_c", ("DCGM_FI_DEV_GPU_TEMP",), "C", default=True),
    F("mem_temp_c", ("DCGM_FI_DEV_MEMORY_TEMP",), "C", default=True),
    F("temp_slowdown_c", ("DCGM_FI_DEV_SLOWDOWN_TEMP",), "C"),
    F("temp_shutdown_c", ("DCGM_FI_DEV_SHUTDOWN_TEMP",), "C"),
    F("temp_gpu_max_c", ("DCGM_FI_DEV_GPU_MAX_OP_TEMP",), "C"),
    F("temp_mem_max_c", ("DCGM_FI_DEV_MEM_MAX_OP_TEMP",), "C"),
    F("power_w", ("DCGM_FI_DEV_POWER_USAGE",), "W", default=True),
    F("power_limit_w", ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"), "W"),
    F("power_default_limit_w", ("DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF",), "W"),
    F("power_min_limit_w", ("DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN",), "W"),
    F("power_max_limit_w", ("DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX",), "W"),
    F("energy_j", ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",), "mJ", _milli, default=True),
    F("sm_clock_mhz", ("DCGM_FI_DEV_SM_CLOCK",), "MHz", default=True),
    F("mem_clock_mhz", ("DCGM_FI_DEV_MEM_CLOCK",), "MHz", default=True),
    F("app_clock_sm_mhz", ("DCGM_FI_DEV_APP_SM_CLOCK",), "MHz"),
    F("max_clock_sm_mhz", ("DCGM_FI_DEV_MAX_SM_CLOCK",), "MHz"),
    F("util_gpu", ("DCGM_FI_DEV_GPU_UTIL",), "%", default=True),
    F("util_mem", ("DCGM_FI_DEV_MEM_COPY_UTIL",), "%", default=True),
    F("mem_used_bytes", ("DCGM_FI_DEV_FB_USED",), "MiB", _mib, default=True),
    F(
        "mem_total_bytes",
        ("DCGM_FI_DEV_FB_TOTAL",),
        "MiB",
        _mib,
        sum_of=("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"),
        sum_optional=("DCGM_FI_DEV_FB_RESERVED",),
        default=True,
    ),
    F(
        "clocks_event_reasons",
        ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"),
        "NVML bitmask",
        _int,
    ),
    F("ecc_sbe_volatile", ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",), "count", _int),
    F("ecc_dbe_volatile", ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",), "count", _int),
    F("ecc_sbe_aggregate", ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",), "count", _int),
    F("ecc_dbe_aggregate", ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",), "count", _int),
    F(
        "remapped_rows_corrected",
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",),
        "rows",
        _int,
        default=True,
    ),
    F(
        "remapped_rows_uncorrected",
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",),
        "rows",
        _int,
        default=True,
    ),
    F("remap_failure", ("DCGM_FI_DEV_ROW_REMAP_FAILURE",), "0/1", _bool, default=True),
    F("remap_pending", ("DCGM_FI_DEV_ROW_REMAP_PENDING",), "0/1", _bool),
    # Field 1523 (DCGM 4.x), NVML's nvmlDeviceGpuRecoveryAction_t: rules/recovery.yml.
    F("recovery_action", ("DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION",), "action", _int),
    F("pcie_gen", ("DCGM_FI_DEV_PCIE_LINK_GEN",), "generation", _int),
    F("pcie_width", ("DCGM_FI_DEV_PCIE_LINK_WIDTH",), "lanes", _int),
    F("pcie_max_gen", ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN",), "generation", _int),
    F("pcie_max_width", ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",), "lanes", _int),
    F("pcie_replay", ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER",), "count", _int, default=True),
    F("pstate", ("DCGM_FI_DEV_PSTATE",), "P-state", _int),
    F("persistence_mode", ("DCGM_FI_DEV_PERSISTENCE_MODE",), "0/1", _bool),
    F("ecc_mode", ("DCGM_FI_DEV_ECC_CURRENT",), "0/1", _bool),
    F("mig_mode", ("DCGM_FI_DEV_MIG_MODE",), "0/1", _bool),
    F("compute_mode", ("DCGM_FI_DEV_COMPUTE_MODE",), "mode", _int),
    F("dram_bw_util", ("DCGM_FI_PROF_DRAM_ACTIVE",), "ratio", _percent, default=True),
    F("sm_active", ("DCGM_FI_PROF_SM_ACTIVE",), "ratio", _percent),
    F("sm_occupancy", ("DCGM_FI_PROF_SM_OCCUPANCY",), "ratio", _percent),
    F("tensor_active", ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",), "ratio", _percent, default=True),
    F("nvlink_rx_bytes_s", ("DCGM_FI_PROF_NVLINK_RX_BYTES",), "B/s", per_link=True),
    F("nvlink_tx_bytes_s", ("DCGM_FI_PROF_NVLINK_TX_BYTES",), "B/s", per_link=True),
    F(
        "nvlink_crc_errors",
        ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",),
        "count",
        _int,
        per_link=True,
    ),
    F(
        "nvlink_replay_errors",
        ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",),
        "count",
        _int,
        per_link=True,
    ),
    F(
        "nvlink_recovery_errors",
        ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",),
        "count",
        _int,
        per_link=True,
    ),
)
del F

# The last XID the driver reported for a GPU (0: none yet); a change is an `xid` event.
XID_METRIC = "DCGM_FI_DEV_XID_ERRORS"
# Labels dcgm-exporter puts on every series: identity, and what runs on the GPU. The
# `pod_name`/`pod_namespace`/`container_name` spelling is dcgm-exporter 1.x's.
UUID_LABELS = ("UUID", "uuid")
MODEL_LABELS = ("modelName",)
WORKLOAD_LABELS = {
    "pod": ("pod", "pod_name"),
    "namespace": ("namespace", "pod_namespace"),
    "container": ("container", "container_name"),
}
LINK_LABELS = ("link", "nvlink")
# A series of one MIG instance (dcgm-exporter labels it so) is not the whole GPU.
MIG_LABEL = "GPU_I_ID"
# The event kinds this source publishes (an agent's other kinds never come from it).
KINDS = frozenset({"telemetry", "xid"})
# The kinds that gpuops's own checks, people and Alertmanager produce, whatever feeds
# the telemetry.
INDEPENDENT_KINDS = frozenset({"drift", "unreachable", "chatops", "alert"})


def metric_names() -> tuple[str, ...]:
    """Every DCGM metric the source reads, in table order (for the Prometheus query)."""
    names: list[str] = []
    for m in MAPPING:
        names += [n for n in (*m.metrics, *m.sum_of, *m.sum_optional) if n not in names]
    return (*names, XID_METRIC)


def filled_fields() -> frozenset[str]:
    """GpuSample fields this source can fill (with the exporter's counters set to publish)."""
    return (
        frozenset(m.field for m in MAPPING)
        | {"index", "uuid", "name", "labels"}
        | set(WORKLOAD_LABELS)
    )


def default_fields() -> frozenset[str]:
    """Fields filled by dcgm-exporter's shipped default counters, without editing them."""
    return frozenset(m.field for m in MAPPING if m.default) | {"index", "uuid", "name", "labels"}


def convert(values: dict[str, float]) -> dict[str, Any]:
    """GpuSample fields from one GPU's DCGM values (metric name -> value, in DCGM units)."""
    out: dict[str, Any] = {}
    for m in MAPPING:
        raw = next((values[n] for n in m.metrics if n in values), None)
        if raw is None and m.sum_of and all(n in values for n in m.sum_of):
            raw = sum(values[n] for n in m.sum_of) + sum(values.get(n, 0.0) for n in m.sum_optional)
        if raw is not None:
            out[m.field] = m.convert(raw)
    return out


def first_label(labels: dict[str, str], names: tuple[str, ...]) -> str | None:
    """The first non-empty label of `names` (dcgm-exporter writes "" for none)."""
    return next((labels[n] for n in names if labels.get(n)), None)


_HOW: dict[Callable[[float], Any], str] = {
    _num: "as is",
    _int: "integer",
    _bool: "non-zero is true",
    _percent: "x 100 (percent of peak)",
    _mib: "x 2^20 (bytes)",
    _milli: "/ 1000 (J)",
}


def markdown_table() -> str:
    """The mapping as docs/sources.md shows it (a unit test keeps the two equal)."""
    rows = [
        "| GpuSample field | DCGM field (the first published) | DCGM unit | conversion | default |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in MAPPING:
        names = " or ".join(f"`{n}`" for n in m.metrics)
        if m.sum_of:
            parts = " + ".join(f"`{n}`" for n in (*m.sum_of, *m.sum_optional))
            names += f", else {parts}"
        how = _HOW[m.convert] + ("; summed over links" if m.per_link else "")
        rows.append(f"| `{m.field}` | {names} | {m.unit} | {how} | {'yes' if m.default else ''} |")
    return "\n".join(rows) + "\n"
