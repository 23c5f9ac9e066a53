"""Typed values passed between stages: events (format v1), matches, decisions, intents, runs."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from gpuops import subjects
from gpuops.clock import rfc3339
from gpuops.diagnose.results import GradeResult

NODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
# The same for Python's re and for msgspec (which uses it): there `$` also matches before
# a final newline, so "node-1\n" would pass as a node.
NODE_PATTERN_PY = NODE_PATTERN.removesuffix("$") + r"\Z"
# NVML's widest counters are unsigned 64-bit: no reading is larger. Anything beyond is
# a forged or broken sample (10^400 would parse to inf), and rejecting it at the door
# keeps every condition's arithmetic finite.
MAX_MAGNITUDE = 2**64
# Checked in pydantic's core, not in Python: telemetry is every GPU every few seconds.
Num = Annotated[float, Field(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]
Int = Annotated[int, Field(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]
# No node NVML reports has more GPUs; an index past it is a broken or forged sample, and
# every per-GPU state (windows, the power controller, the density day) is keyed by it.
MAX_GPUS = 64
# Free text a node or another system writes (a driver message, a kernel line, an
# alert's annotation) is cut, not refused: the event is still decided, and every record
# that copies its facts (audit, intent, episode) stays far under NATS's 1 MiB.
MAX_TEXT = 4096


def cut_text(text: str, limit: int) -> str:
    """`text`, or its first characters and a marker saying how many were cut and the
    SHA-256 of the whole (what the original was stays provable), in at most `limit`
    characters (so cutting again changes nothing)."""
    if len(text) <= limit:
        return text
    # Surrogates pass: JSON may hold a lone "\ud800", which strict UTF-8 cannot encode.
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    longest = f"…[cut {len(text)} chars, sha256 {digest}]"  # the count has at most its digits
    keep = max(0, limit - len(longest))
    return f"{text[:keep]}…[cut {len(text) - keep} chars, sha256 {digest}]"


@dataclass(frozen=True, slots=True)
class Cut:
    """A free-text string's bound: longer text is cut to `limit` characters, marked.

    Text within the bound is checked in pydantic's core alone (the first branch), so the
    telemetry fast path pays a length check; only longer text calls `cut_text`.
    """

    limit: int
    min_length: int | None = None

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        limit = self.limit
        bounded = core_schema.union_schema(
            [
                core_schema.str_schema(max_length=limit),
                core_schema.no_info_after_validator_function(
                    lambda text: cut_text(text, limit), core_schema.str_schema()
                ),
            ],
            mode="left_to_right",
            custom_error_type="string_type",  # one error for a non-string, not one per branch
        )
        if self.min_length is None:
            return bounded
        shortest = core_schema.str_schema(min_length=self.min_length)
        return core_schema.chain_schema([bounded, shortest])  # "too short" said as such

    def __get_pydantic_json_schema__(
        self, core: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        shortest = {} if self.min_length is None else {"minLength": self.min_length}
        return {
            "type": "string",
            **shortest,
            "description": f"free text, cut to {self.limit} characters",
        }


Text = Annotated[str, Cut(MAX_TEXT)]


def subject_token(node: str) -> str:
    """A node name as one NATS subject token (see gpuops.subjects)."""
    return subjects.token(node)


def subject_for(kind: str, node: str) -> str:
    """Where an event is published (see gpuops.subjects)."""
    return subjects.event(kind, node)


def action_subject(node: str) -> str:
    """Where intents for a node go (see gpuops.subjects)."""
    return subjects.action(node)


def new_event(kind: str, node: str, t: float, data: dict[str, Any], source: str) -> dict[str, Any]:
    """A fresh event in format v1, as publishers (agent, simulator, checks, ChatOps) send it."""
    return {
        "id": str(uuid.uuid4()),
        "kind": kind,
        "node": node,
        "ts": rfc3339(t),
        "source": source,
        "data": data,
    }


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _bad_number(value: Any) -> str | None:
    """Why a number in event data is not acceptable (NaN, infinite, absurdly large), if so."""
    stack = [value]
    while stack:  # iterative: `Any` fields may hold nested lists and mappings
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, float) and not math.isfinite(item):
            return f"{item} is not a finite number"
        if isinstance(item, int | float) and abs(item) > MAX_MAGNITUDE:
            return "magnitude above 2**64"
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return None


class _Finite(BaseModel):
    """Numbers inside `Any` fields: pydantic's own checks do not look into those."""

    @model_validator(mode="after")
    def _finite(self) -> _Finite:
        for name, value in self.__dict__.items():
            why = _bad_number(value)
            if why is not None:
                raise ValueError(f"{name}: {why}")
        return self


class _Open(BaseModel):
    # Event data may gain fields in later versions; an older engine ignores them.
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


# Alertmanager's labels and annotations are free text from another system: bounded, so
# one alert cannot carry megabytes into every record that copies its facts.
MAX_ALERT_LABELS = 64
MAX_ALERT_TEXT = 1024
AlertKey = Annotated[str, Field(min_length=1, max_length=128)]
AlertText = Annotated[str, Cut(MAX_ALERT_TEXT)]


# --- event data, one model per kind -------------------------------------------------


class GpuSample(_Open):
    """One GPU's readings in a telemetry event; a field NVML did not support is null."""

    index: int = Field(ge=0, lt=MAX_GPUS)
    uuid: Text | None = None
    name: Text | None = None
    temp_c: Num | None = None
    mem_temp_c: Num | None = None
    temp_slowdown_c: Num | None = None
    temp_shutdown_c: Num | None = None
    temp_gpu_max_c: Num | None = None
    temp_mem_max_c: Num | None = None
    power_w: Num | None = None
    power_limit_w: Num | None = None
    power_default_limit_w: Num | None = None
    power_min_limit_w: Num | None = None
    power_max_limit_w: Num | None = None
    energy_j: Num | None = None
    sm_clock_mhz: Num | None = None
    mem_clock_mhz: Num | None = None
    app_clock_sm_mhz: Num | None = None
    max_clock_sm_mhz: Num | None = None
    util_gpu: Num | None = None
    util_mem: Num | None = None
    mem_used_bytes: Int | None = None
    mem_total_bytes: Int | None = None
    clocks_event_reasons: Int | None = None
    ecc_sbe_volatile: Int | None = None
    ecc_dbe_volatile: Int | None = None
    ecc_sbe_aggregate: Int | None = None
    ecc_dbe_aggregate: Int | None = None
    remapped_rows_corrected: Int | None = None
    remapped_rows_uncorrected: Int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    # The driver's own advice (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): 0 none, 1 GPU reset,
    # 2 node reboot, 3 drain peer-to-peer, 4 drain and reset (5-7 on newer drivers).
    recovery_action: Int | None = None
    pcie_gen: Int | None = None
    pcie_width: Int | None = None
    pcie_max_gen: Int | None = None
    pcie_max_width: Int | None = None
    pcie_replay: Int | None = None
    pstate: Int | None = None
    persistence_mode: bool | None = None
    ecc_mode: bool | None = None
    mig_mode: bool | None = None
    compute_mode: Int | None = None
    # Memory bandwidth and activity (NVML GPM on Hopper and later, DCGM_FI_PROF_*), in
    # percent of peak over the sampling interval, like util_gpu.
    dram_bw_util: Num | None = None
    sm_active: Num | None = None
    sm_occupancy: Num | None = None
    tensor_active: Num | None = None
    # NVLink: bandwidth over all links (bytes/s), link counts, and error counters summed
    # over the links (monotonic, so rules use `increase`).
    nvlink_rx_bytes_s: Num | None = None
    nvlink_tx_bytes_s: Num | None = None
    nvlink_links_active: Int | None = None
    nvlink_links_down: Int | None = None
    nvlink_crc_errors: Int | None = None
    nvlink_replay_errors: Int | None = None
    nvlink_recovery_errors: Int | None = None
    # What runs on the GPU, where a source knows (dcgm-exporter's Kubernetes labels).
    pod: str | None = Field(default=None, max_length=253)
    namespace: str | None = Field(default=None, max_length=253)
    container: str | None = Field(default=None, max_length=253)
    # The raw labels of a scraped series (source prometheus), for people correlating.
    labels: dict[str, AlertText] | None = Field(default=None, max_length=64)


# The readings that move from one second to the next on a working GPU: temperatures,
# power and energy, clocks, utilisation, memory in use, bandwidths, the performance
# state and the PCIe link's generation (it drops while the GPU idles). Every other
# field changes on an event (a counter on an error, a flag, a limit, a link, the
# driver's advice) or never; the matcher skips the rules that read only those for a
# GPU whose values did not change (match.codegen.Quiet). The H200 recording of a load
# burst (fixtures/nvml) changed clocks_event_reasons 3 times in 27 s at 10 Hz.
MOVING_FIELDS = frozenset(
    {
        "temp_c",
        "mem_temp_c",
        "power_w",
        "energy_j",
        "sm_clock_mhz",
        "mem_clock_mhz",
        "util_gpu",
        "util_mem",
        "mem_used_bytes",
        "pstate",
        "pcie_gen",
        "dram_bw_util",
        "sm_active",
        "sm_occupancy",
        "tensor_active",
        "nvlink_rx_bytes_s",
        "nvlink_tx_bytes_s",
    }
)
# What rules may read of a GPU that changes only on events: its fields but the moving
# ones, and its node and index (the medians the matcher adds move with their fields).
QUIET_FIELDS = frozenset(GpuSample.model_fields).difference(MOVING_FIELDS) | {"node", "gpu"}


class TelemetryData(_Open):
    """Every GPU of a node in one sample."""

    gpus: list[GpuSample] = Field(min_length=1, max_length=MAX_GPUS)


class XidData(_Open):
    """An XID error reported by the driver for one GPU."""

    gpu: int = Field(ge=0, le=MAX_MAGNITUDE)
    xid: int = Field(ge=0, le=MAX_MAGNITUDE)
    message: Text = ""


class EccData(_Open):
    """A single- or double-bit ECC event from NVML's event set."""

    gpu: int = Field(ge=0, le=MAX_MAGNITUDE)
    type: Literal["sbe", "dbe"]
    count: int = Field(default=1, ge=0, le=MAX_MAGNITUDE)


class GpuLostData(_Open):
    """NVML answered "GPU is lost" for a device."""

    gpu: int = Field(ge=0, le=MAX_MAGNITUDE)
    error: Text = ""


class ProbeData(_Open):
    """A known-answer GPU probe; `unavailable` means it could not run, which is not a pass."""

    gpu: int | None = Field(default=None, ge=0, le=MAX_MAGNITUDE)
    ok: bool
    outcome: Literal["pass", "fail", "timeout", "unavailable"] = "pass"
    error: Text | None = None
    duration_s: float | None = Field(default=None, ge=0, le=MAX_MAGNITUDE)
    # The validation request's nonce this probe answers (none: a scheduled probe).
    nonce: str | None = Field(default=None, pattern=r"^[0-9a-f]{1,64}$")

    @field_validator("outcome")
    @classmethod
    def _outcome_matches_ok(cls, v: str, info: Any) -> str:
        ok = info.data.get("ok")
        if ok is not None and ok != (v == "pass"):
            raise ValueError(f"ok={ok} contradicts outcome={v!r}")
        return v


class HeartbeatData(_Open):
    """The agent is alive."""

    seq: int = Field(default=0, ge=0, le=MAX_MAGNITUDE)
    agent_version: Text = ""
    uptime_s: Num | None = None
    spool_dropped: int = Field(default=0, ge=0, le=MAX_MAGNITUDE)


class DriftData(_Open, _Finite):
    """A setting of the baseline differs from what the node reports."""

    setting: Annotated[str, Cut(MAX_TEXT, min_length=1)]
    expected: Any = None
    actual: Any = None
    gpu: int | None = Field(default=None, ge=0, le=MAX_MAGNITUDE)

    @field_validator("expected", "actual")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        """A value longer than MAX_TEXT as JSON becomes its JSON text, cut: an `Any` can
        grow when written again (`9e15` is `9000000000000000.0`), and every record of
        a decision copies it."""
        if isinstance(value, bool | int | float | None):
            return value
        why = _bad_number(value)  # before it may become text, which is not looked into
        if why is not None:
            raise ValueError(why)
        text = json.dumps(value)  # parsed from JSON: only lists, mappings and scalars
        return value if len(text) <= MAX_TEXT else cut_text(text, MAX_TEXT)


class UnreachableData(_Open):
    """A host could not be reached by a check or a run."""

    error: Text = ""
    check: Text = ""


# Counters every ConnectX port exposes under ports/<n>/counters (InfiniBand and RoCE).
IB_COUNTERS: tuple[str, ...] = (
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
IB_MAX_PORTS = 64  # a node with more HCA ports than this is not a GPU node we know


class IbPort(_Open):
    """One InfiniBand (or RoCE) port as sysfs shows it, for people reading the event."""

    device: str = Field(max_length=64)
    port: int = Field(ge=0, le=MAX_MAGNITUDE)
    state: str = Field(default="", max_length=32)  # ACTIVE, DOWN, INIT, ARMED
    phys_state: str = Field(default="", max_length=32)  # LinkUp, Polling, Disabled, ...
    rate: str = Field(default="", max_length=64)  # "400 Gb/sec (4X NDR)"
    link_layer: str = Field(default="", max_length=32)
    counters: dict[str, Int] = Field(default_factory=dict, max_length=64)


class IbData(_Open):
    """A node's InfiniBand ports in one sample: the summary rules use, and each port.

    A port counts as down when it is not ACTIVE, unless it was disabled on purpose
    (phys_state Disabled) or, for the agent, it has not been ACTIVE since the agent
    started (a spare port nobody cabled is not a fault). Counters are summed over the
    ports that expose them (null when none does); they only grow until a reset, so rules
    use `increase`.
    """

    ports: int = Field(default=0, ge=0, le=MAX_MAGNITUDE)
    ports_active: int = Field(default=0, ge=0, le=MAX_MAGNITUDE)
    ports_down: int = Field(default=0, ge=0, le=MAX_MAGNITUDE)
    down_ports: list[Annotated[str, Field(max_length=80)]] = Field(
        default_factory=list, max_length=IB_MAX_PORTS
    )
    symbol_error: Int | None = None
    link_downed: Int | None = None
    link_error_recovery: Int | None = None
    port_rcv_errors: Int | None = None
    port_rcv_remote_physical_errors: Int | None = None
    port_xmit_discards: Int | None = None
    local_link_integrity_errors: Int | None = None
    excessive_buffer_overrun_errors: Int | None = None
    detail: list[IbPort] = Field(default_factory=list, max_length=IB_MAX_PORTS)


class SxidData(_Open):
    """An NVSwitch error (SXid) from the kernel log."""

    switch: str = Field(default="", max_length=64)  # nvidia-nvswitch3
    pci: str = Field(default="", max_length=32)  # 0000:8a:00.0
    sxid: int = Field(ge=0, le=MAX_MAGNITUDE)
    fatal: bool | None = None  # the driver's "Fatal" / "Non-fatal" word, when it says
    message: AlertText = ""


class TopologyData(_Open):
    """The node differs from its topology manifest (gpuops.diagnose.topology), as its
    agent found: the check (`pcie_width`, `pcie_gen`, `numa`, `nvlinks`, `gpu_missing`,
    `nic_missing`, `nic_rate`, `nic_numa`, `nic_level`, `nic_gpu`), the GPU or HCA, and
    what the manifest says against what the node has."""

    check: Annotated[str, Cut(64, min_length=1)]
    gpu: int | None = Field(default=None, ge=0, le=MAX_MAGNITUDE)
    device: Annotated[str, Cut(64)] = ""
    expected: Num | Text | bool | None = None
    actual: Num | Text | bool | None = None
    detail: Text = ""


class FacilityData(_Open):
    """One facility reading over Redfish (gpuops.sources.redfish): a chassis inlet
    temperature, a PSU's input power, a fan, a cooling unit's supply temperature, flow or
    pump, a leak detector's state. `sensor` names it within the node (the BMC or CDU the
    inventory knows), `metric` what it measures; the node's failure domains come with it,
    as the inventory names them, so a rule can group by the loop."""

    sensor: Annotated[str, Cut(128, min_length=1)]  # cdu-1/primary/supply_temp_c
    metric: Literal[
        "inlet_temp_c",
        "supply_temp_c",
        "return_temp_c",
        "flow_lpm",
        "pump_speed_pct",
        "fan_rpm",
        "psu_input_w",
        "power_consumed_w",
        "leak",
    ]
    value: Num | None = None
    state: Literal["OK", "Warning", "Critical", "Unavailable"] | None = None
    resource: Annotated[str, Cut(256)] = ""  # the Redfish resource it was read from
    rack: Annotated[str, Cut(64)] = ""
    pdu: Annotated[str, Cut(64)] = ""
    cooling_loop: Annotated[str, Cut(64)] = ""


class DraTaintData(_Open):
    """A taint the Kubernetes DRA driver published on one of the node's GPUs in its
    ResourceSlice (NVIDIA's `gpu.nvidia.com/xid=79:NoSchedule`), read by
    `gpuops ingest dra`: the GPU by index and NVML UUID, where the driver publishes it,
    and the taint."""

    gpu: int | None = Field(default=None, ge=0, le=MAX_MAGNITUDE)
    uuid: Annotated[str, Cut(96)] = ""
    driver: Annotated[str, Cut(253)] = ""
    pool: Annotated[str, Cut(253)] = ""
    device: Annotated[str, Cut(253)] = ""
    key: Annotated[str, Cut(253, min_length=1)]
    value: Annotated[str, Cut(63)] = ""
    effect: Literal["None", "NoSchedule", "NoExecute"] | Annotated[str, Cut(32)] = "None"


class DiagnosticsData(_Open):
    """A grade of diagnostics ran on the node (gpuops.diagnose), told by the executor that
    ran it: whether it passed, and the first failing check with its number. `gate`: it
    was the gate back into service, judging the remediation of `fault_rule`'s fault
    (group key `fault_key`); a failed gate is decided as that fault again (its ladder)."""

    grade: int = Field(ge=1, le=5)
    ok: bool
    summary: Text = ""
    failed: Text = ""  # the first failing check (`nvbandwidth:device_to_device_memcpy_read_ce`)
    value: Num | None = None  # its number
    checks: int = Field(default=0, ge=0, le=MAX_MAGNITUDE)
    gate: bool = False
    fault_rule: Text = ""
    fault_key: Text = ""
    run_id: Text = ""
    # What the fleet compares (GradeResult.measures; null where the grade measured none).
    busbw_gbs: Num | None = None  # NCCL all-reduce busbw, GB/s (grade 3)
    d2d_gbs: Num | None = None  # nvbandwidth's lowest device<->device cell, GB/s (2, 3)
    h2d_gbs: Num | None = None  # nvbandwidth's lowest host<->device cell, GB/s (2, 3)


class ChatopsData(_Open):
    """A command typed by a person in Slack or Mattermost."""

    command: Annotated[str, Cut(MAX_TEXT, min_length=1)]
    args: list[Text] = Field(default_factory=list)
    user: Text = ""  # the principal: slack:TEAM/USER, mattermost:TEAM/USER, console:U, cli:U
    name: Text = ""  # the person's display name there, for reading only
    channel: Text = ""
    platform: Literal["slack", "mattermost", "cli", "console"] = "cli"
    reason: Text = ""  # the free text after a command's arguments (drain NODE REASON)


class AlertData(_Open):
    """One alert of an Alertmanager notification, firing or resolved (source `alertmanager`).

    `gpu` comes from the alert's `gpu` label when that is a GPU index; every label is
    kept under `labels` so people and rules (`label(labels, "xid")`) can correlate.
    """

    name: str = Field(min_length=1, max_length=MAX_ALERT_TEXT)
    status: Literal["firing", "resolved"]
    labels: dict[AlertKey, AlertText] = Field(default_factory=dict, max_length=MAX_ALERT_LABELS)
    annotations: dict[AlertKey, AlertText] = Field(
        default_factory=dict, max_length=MAX_ALERT_LABELS
    )
    fingerprint: str = Field(min_length=1, max_length=128)
    gpu: int | None = Field(default=None, ge=0, le=MAX_MAGNITUDE)
    starts_at: AwareDatetime | None = None
    ends_at: AwareDatetime | None = None


# --- the envelope ---------------------------------------------------------------------


class _Envelope(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    id: str = Field(min_length=1, max_length=200)
    node: str = Field(pattern=NODE_PATTERN)
    ts: AwareDatetime
    source: str = Field(min_length=1, max_length=200)
    # Who published it, as the intake proved (gpuops.bus.identity): the node itself,
    # `source:<name>` or `engine`. Set by the intake, never taken from the payload.
    publisher: str = Field(default="", max_length=128)

    @field_validator("ts")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        try:
            return v.astimezone(UTC)
        except OverflowError as exc:  # year 1 east of UTC: a schema error, not a crash
            raise ValueError(f"{v.isoformat()} has no UTC time") from exc

    @property
    def epoch(self) -> float:
        """The event's own time, in epoch seconds."""
        return self.ts.timestamp()


class TelemetryEvent(_Envelope):
    kind: Literal["telemetry"]
    data: TelemetryData


class XidEvent(_Envelope):
    kind: Literal["xid"]
    data: XidData


class EccEvent(_Envelope):
    kind: Literal["ecc"]
    data: EccData


class GpuLostEvent(_Envelope):
    kind: Literal["gpu_lost"]
    data: GpuLostData


class ProbeEvent(_Envelope):
    kind: Literal["probe"]
    data: ProbeData


class HeartbeatEvent(_Envelope):
    kind: Literal["heartbeat"]
    data: HeartbeatData = HeartbeatData()


class DriftEvent(_Envelope):
    kind: Literal["drift"]
    data: DriftData


class UnreachableEvent(_Envelope):
    kind: Literal["unreachable"]
    data: UnreachableData = UnreachableData()


class IbEvent(_Envelope):
    kind: Literal["ib"]
    data: IbData


class SxidEvent(_Envelope):
    kind: Literal["sxid"]
    data: SxidData


class TopologyEvent(_Envelope):
    kind: Literal["topology"]
    data: TopologyData


class FacilityEvent(_Envelope):
    kind: Literal["facility"]
    data: FacilityData


class DraTaintEvent(_Envelope):
    kind: Literal["dra_taint"]
    data: DraTaintData


class DiagnosticsEvent(_Envelope):
    kind: Literal["diagnostics"]
    data: DiagnosticsData


class ChatopsEvent(_Envelope):
    kind: Literal["chatops"]
    data: ChatopsData


class AlertEvent(_Envelope):
    kind: Literal["alert"]
    data: AlertData


Event = Annotated[
    TelemetryEvent
    | XidEvent
    | EccEvent
    | GpuLostEvent
    | ProbeEvent
    | HeartbeatEvent
    | DriftEvent
    | UnreachableEvent
    | ChatopsEvent
    | IbEvent
    | SxidEvent
    | AlertEvent
    | DiagnosticsEvent
    | TopologyEvent
    | FacilityEvent
    | DraTaintEvent,
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

DATA_MODELS: dict[str, type[BaseModel]] = {
    "telemetry": GpuSample,  # telemetry rules see one fact per GPU
    "xid": XidData,
    "ecc": EccData,
    "gpu_lost": GpuLostData,
    "probe": ProbeData,
    "heartbeat": HeartbeatData,
    "drift": DriftData,
    "unreachable": UnreachableData,
    "chatops": ChatopsData,
    "ib": IbData,
    "sxid": SxidData,
    "alert": AlertData,
    "diagnostics": DiagnosticsData,
    "topology": TopologyData,
    "facility": FacilityData,
    "dra_taint": DraTaintData,
}
EVENT_KINDS: tuple[str, ...] = tuple(DATA_MODELS)
# Kinds that state a condition rather than report an occurrence: a rule's episode on them
# ends when its condition goes false for the key that fired (a GPU cooled, an alert resolved).
STATEFUL_KINDS = frozenset({"telemetry", "alert", "facility"})


# Facts the matcher computes when it expands an event (gpuops.match.matcher.facts_of),
# beside the event's own fields: a GPU compared with the other GPUs of its node.
DERIVED_FACTS: dict[str, dict[str, type]] = {
    "telemetry": {
        "dram_bw_util_peer_median": float,
        # The fleet baseline (gpuops.match.baselines): the node's mean, its peers' median.
        "node_dram_bw_util": float,
        "dram_bw_util_fleet_median": float,
    },
    # The grades' baseline (gpuops.match.baselines): the other nodes' median of the same
    # SKU, each node's latest result.
    "diagnostics": {
        "busbw_gbs_fleet_median": float,
        "d2d_gbs_fleet_median": float,
        "h2d_gbs_fleet_median": float,
    },
}
# The event field each derived fact is computed from: a source that fills the field
# serves the fact too.
DERIVED_FROM: dict[str, str] = {
    "dram_bw_util_peer_median": "dram_bw_util",
    "node_dram_bw_util": "dram_bw_util",
    "dram_bw_util_fleet_median": "dram_bw_util",
    "busbw_gbs_fleet_median": "busbw_gbs",
    "d2d_gbs_fleet_median": "d2d_gbs",
    "h2d_gbs_fleet_median": "h2d_gbs",
}


def fact_fields(kind: str) -> frozenset[str]:
    """Names a rule on `kind` may use: the data fields plus `node` (and `gpu` for telemetry)."""
    names = set(DATA_MODELS[kind].model_fields) | {"node"} | set(DERIVED_FACTS.get(kind, {}))
    if kind == "telemetry":
        names.add("gpu")
    return frozenset(names)


def event_json_schema() -> dict[str, Any]:
    """The JSON Schema of event format v1, generated from the models."""
    schema = EVENT_ADAPTER.json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://gpuops.dev/schemas/event-v1.json"
    schema["title"] = "gpuops event v1"
    return schema


# The kinds of failure domain a host may name (gpuops.inventory.domains reads them; the
# settings budget them, a rule's `domain:` correlates by one).
DomainKind = Literal["rack", "pdu", "cooling_loop", "leaf_switch", "nvlink_domain"]
DOMAIN_KINDS: tuple[str, ...] = get_args(DomainKind)


# --- what flows between stages ---------------------------------------------------------


class Reason(StrEnum):
    """Why a match did not become an action; the audit record and the metric label."""

    ACCEPTED = "accepted"
    UNKNOWN_NODE = "unknown_node"
    STALE = "stale"
    SILENCED = "silenced"
    COOLDOWN = "cooldown"
    SUPERSEDED = "superseded"
    LOCKED = "locked"
    NEEDS_HUMAN = "needs_human"
    ATTEMPT_CAP = "attempt_cap"
    BREAKER_OPEN = "breaker_open"
    DOMAIN_BUDGET = "domain_budget"  # a rack, PDU or loop has lost its budget's worth of nodes
    # A rule with `domain:`: the node's fault waits for its domain's others (domain_wait),
    # or the domain's episode holds it while the domain's response runs (domain_held).
    DOMAIN_WAIT = "domain_wait"
    DOMAIN_HELD = "domain_held"
    APPROVAL_PENDING = "approval_pending"
    NO_ACTION = "no_action"
    DRY_RUN = "dry_run"
    NOT_APPLICABLE = "not_applicable"  # a built-in rule for another node state: not audited
    POWER_BUDGET = "power_budget"  # the power controller keeps this GPU's limit (a budget)
    # A record a stage reads (lock, cooldown, attempts, breaker, silence, node state) does
    # not decode: nothing acts until a person repairs it (gpuops.errors.StateUnreadable).
    STATE_UNREADABLE = "state_unreadable"


class Match(_Frozen):
    """A rule fired for one group key."""

    rule: str
    kind: str
    node: str
    gpu: int | None = None  # the GPU, when the match is about exactly one
    gpus: tuple[int, ...] = ()  # every GPU the match is about (one per node: several)
    key: str
    event_id: str
    event_ts: float
    at: float
    severity: str = "warning"
    facts: dict[str, Any] = Field(default_factory=dict)


# Match kinds that come from the engine's own requests, never from the bus: a decision
# the power controller asks for is not a fault (nor is a person's command, `chatops`).
POWER_KIND = "power"
# The kind of a failed gate decided as its fault again (gpuops.spine.pipeline): not a new
# occurrence of the fault, so no cooldown holds it; its ladder counts it.
GATE_KIND = "gate"
REQUEST_KINDS = frozenset({POWER_KIND})
NOT_FAULT_KINDS = REQUEST_KINDS | {"chatops"}


class Request(_Frozen):
    """A decision the engine asks for itself, handed to the pipeline's one entry beside the
    events: a power change the controller planned (its match names the power rule), or a
    held match a person approved (decided again, with who approved it)."""

    match: Match
    approved_by: str | None = None


class Decide(Protocol):
    """The pipeline's one entry as the engine's own requesters hold it (handed to them at
    construction): a request in, the decisions made out."""

    async def __call__(self, item: Request, /) -> list[Decision]:
        """Decide the request's match through every safety stage."""
        ...


class ActionSpec(_Frozen):
    """One playbook to run for a match, with its rendered vars."""

    playbook: str
    ref: str | None = None
    vars: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float = 600.0


class Decision(_Frozen):
    """The outcome of the decide stages for one match."""

    match: Match
    accepted: bool
    reason: Reason
    detail: str = ""
    actions: tuple[ActionSpec, ...] = ()
    notify: bool = False
    rung: int | None = None
    holds_lock: bool = False  # the node's lock is held for this decision's run
    peers_locked: tuple[str, ...] = ()  # a fabric check's peers, held with the node
    closes_breaker: bool = False  # the half-open breaker closes when this runs
    approved_by: str | None = None
    episode: str = ""  # the open episode it folds into, when an acting proposal found one
    gate: int = 0  # the grade the gate back into service holds this remediation to


class Intent(_Frozen):
    """A decided action, written to the actions work queue before the event is acked."""

    key: str  # idempotency key: rule, group key and triggering event
    rule: str
    node: str
    gpu: int | None = None
    gpus: tuple[int, ...] = ()  # per-GPU playbooks act on all of them in one run
    action: ActionSpec
    event_id: str
    event_ts: float
    decided_at: float
    decision: Decision | None = None  # the accepted decision, so the intent is its record too
    episode: str = ""  # the episode it remediates (`rule@node:opened`), for people's tools
    signature: str = ""  # HMAC of the engine over everything above (gpuops/signing.py)

    @property
    def holds_lock(self) -> bool:
        """Whether the node's lock was taken for this intent's decision (the run gives it back)."""
        return self.decision is not None and self.decision.holds_lock

    @property
    def locked(self) -> tuple[str, ...]:
        """The nodes whose locks the run gives back: its node and a fabric check's peers."""
        if not self.holds_lock:
            return ()
        assert self.decision is not None
        return (self.node, *self.decision.peers_locked)


class RunStatus(StrEnum):
    """How a playbook run ended."""

    SUCCESSFUL = "successful"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    CANCELED = "canceled"
    ERROR = "error"
    SKIPPED = "skipped"
    INTERRUPTED = "interrupted"  # the executor died mid-run; found when the intent came back
    REFUSED = "refused"  # unsigned, not catalogued, or not exactly one inventory host


class RunOutcome(_Frozen):
    """What a playbook run did: status, per-host stats, and exactly which playbook ran."""

    intent_key: str
    rule: str
    node: str
    playbook: str
    status: RunStatus
    rc: int | None = None
    stats: dict[str, dict[str, int]] = Field(default_factory=dict)
    started: float
    ended: float
    revision: str | None = None
    sha256: str | None = None
    error: str | None = None
    changed: list[str] = Field(default_factory=list)
    run_id: str | None = None  # the ansible-runner call (its evidence: STATE/runs/<run_id>)
    hosts_in_run: int = 1  # the run's batch: this host and the others it ran with
    failed_task: str | None = None  # for a failed host: the task that failed, and why
    failed_message: str | None = None
    grade: GradeResult | None = None  # diagnose.yml's judged checks, with their numbers
    held_by_person: str | None = None  # a person's reason the node is out for (Slurm)

    @property
    def duration_s(self) -> float:
        """Wall seconds the run took."""
        return self.ended - self.started

    @classmethod
    def of(
        cls,
        intent: Intent,
        status: RunStatus,
        started: float,
        ended: float,
        error: str | None = None,
    ) -> RunOutcome:
        """An outcome that no ansible-runner call produced (refused, interrupted, shadow)."""
        return cls(
            intent_key=intent.key,
            rule=intent.rule,
            node=intent.node,
            playbook=intent.action.playbook,
            status=status,
            started=started,
            ended=ended,
            error=error,
        )


class AuditRecord(_Frozen):
    """One line of the audit trail."""

    type: Literal["match", "decision", "intent", "run", "dead_letter", "note"]
    at: float
    node: str = ""
    rule: str = ""
    summary: str = ""
    body: dict[str, Any] = Field(default_factory=dict)
