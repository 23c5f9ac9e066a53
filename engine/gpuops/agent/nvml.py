"""The NVML backend: every signal in GPU_FAULTS.md, read per call so one refusal costs one field.

NotSupported (and other per-call refusals) leave the field out (null); "GPU is lost"
becomes a `gpu_lost` health signal and the GPU drops out of the sample; nothing a device
says crashes the agent. `nvml` is the pynvml module, injected so tests can hand in one
that answers from a recorded H200 snapshot.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from gpuops.agent.backend import HealthSignal
from gpuops.agent.gpm import Gpm
from gpuops.agent.nvlink import NvLinks
from gpuops.errors import SourceError

log = logging.getLogger(__name__)


class _Lost(Exception):
    """The GPU answered "GPU is lost"."""


class NvmlBackend:
    """Reads every GPU of this node through pynvml."""

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self.nv: Any = nvml if nvml is not None else importlib.import_module("pynvml")
        self.nv.nvmlInit()
        self.handles = [
            self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(self.nv.nvmlDeviceGetCount())
        ]
        # An event names its GPU by handle: found here, not by asking NVML for the index,
        # which a GPU that fell off the bus (XID 79) answers with GPU_IS_LOST.
        self._by_address = {_address(h): i for i, h in enumerate(self.handles)}
        self.unmapped_events = 0  # events from a handle not among these: dropped
        self.lost: set[int] = set()
        self._events: Any = None
        self.gpm = Gpm(self.nv, self._get)
        self.nvlinks = NvLinks(self.nv, self._get, self._field)

    def gpu_count(self) -> int:
        return len(self.handles)

    def close(self) -> None:
        self.gpm.close()
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)

    # --- sampling -----------------------------------------------------------------

    def _get(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call: the value, or None when the device refused; _Lost when it is gone."""
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            if getattr(exc, "value", None) == self.nv.NVML_ERROR_GPU_IS_LOST:
                raise _Lost(str(exc)) from exc
            return None

    def _field(self, handle: Any, field_id: int) -> Any:
        values = self._get(self.nv.nvmlDeviceGetFieldValues, handle, [field_id])
        if not values or values[0].nvmlReturn != 0:
            return None
        v = values[0]
        kinds = {
            self.nv.NVML_VALUE_TYPE_DOUBLE: "dVal",
            self.nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            self.nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
            self.nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
            self.nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
            self.nv.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        }
        return getattr(v.value, kinds.get(v.valueType, "ullVal"))

    def sample(self) -> tuple[list[dict[str, Any]], list[HealthSignal]]:
        gpus, signals = [], []
        for index, handle in enumerate(self.handles):
            try:
                gpus.append(self._sample_gpu(index, handle))
                self.lost.discard(index)
            except _Lost as exc:
                self.gpm.forget(index)
                if index not in self.lost:
                    self.lost.add(index)
                    signals.append(HealthSignal("gpu_lost", {"gpu": index, "error": str(exc)}))
        return gpus, signals

    def _sample_gpu(self, index: int, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        out: dict[str, Any] = {
            "index": index,
            "uuid": _text(get(nv.nvmlDeviceGetUUID, h)),
            "name": _text(get(nv.nvmlDeviceGetName, h)),
        }
        out.update(self._thermal(h))
        out.update(self._power(h))
        out.update(self._clocks(h))
        out.update(self._memory(h))
        out.update(self._ecc(h))
        out.update(self._pcie(h))
        out.update(self._modes(h))
        out.update(self.nvlinks.read(index, h))
        out.update(self.gpm.read(index, h))
        return {k: v for k, v in out.items() if v is not None}

    def _thermal(self, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        threshold = nv.nvmlDeviceGetTemperatureThreshold
        return {
            "temp_c": get(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "mem_temp_c": self._field(h, nv.NVML_FI_DEV_MEMORY_TEMP),
            "temp_slowdown_c": get(threshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            "temp_shutdown_c": get(threshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            "temp_gpu_max_c": get(threshold, h, nv.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
            "temp_mem_max_c": get(threshold, h, nv.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
        }

    def _power(self, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        limits = get(nv.nvmlDeviceGetPowerManagementLimitConstraints, h) or (None, None)
        energy = get(nv.nvmlDeviceGetTotalEnergyConsumption, h)
        return {
            "power_w": _milli(get(nv.nvmlDeviceGetPowerUsage, h)),
            "power_limit_w": _milli(get(nv.nvmlDeviceGetEnforcedPowerLimit, h)),
            "power_default_limit_w": _milli(get(nv.nvmlDeviceGetPowerManagementDefaultLimit, h)),
            "power_min_limit_w": _milli(limits[0]),
            "power_max_limit_w": _milli(limits[1]),
            "energy_j": _milli(energy),
        }

    def _clocks(self, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        # Renamed in newer drivers; the old name still answers on older ones.
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        util = get(nv.nvmlDeviceGetUtilizationRates, h)
        return {
            "sm_clock_mhz": get(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": get(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM),
            "max_clock_sm_mhz": get(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
            "app_clock_sm_mhz": get(nv.nvmlDeviceGetApplicationsClock, h, nv.NVML_CLOCK_SM),
            "clocks_event_reasons": get(reasons, h),
            "util_gpu": util.gpu if util is not None else None,
            "util_mem": util.memory if util is not None else None,
            "pstate": get(nv.nvmlDeviceGetPerformanceState, h),
        }

    def _memory(self, h: Any) -> dict[str, Any]:
        mem = self._get(self.nv.nvmlDeviceGetMemoryInfo, h)
        return {
            "mem_used_bytes": mem.used if mem else None,
            "mem_total_bytes": mem.total if mem else None,
        }

    def _ecc(self, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        total = nv.nvmlDeviceGetTotalEccErrors
        corr, unc = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        rows = get(nv.nvmlDeviceGetRemappedRows, h) or (None, None, None, None)
        return {
            "ecc_sbe_volatile": get(total, h, corr, nv.NVML_VOLATILE_ECC),
            "ecc_dbe_volatile": get(total, h, unc, nv.NVML_VOLATILE_ECC),
            "ecc_sbe_aggregate": get(total, h, corr, nv.NVML_AGGREGATE_ECC),
            "ecc_dbe_aggregate": get(total, h, unc, nv.NVML_AGGREGATE_ECC),
            "remapped_rows_corrected": rows[0],
            "remapped_rows_uncorrected": rows[1],
            "remap_pending": None if rows[2] is None else bool(rows[2]),
            "remap_failure": None if rows[3] is None else bool(rows[3]),
            # What the driver says the GPU needs (0 while nothing): rules/recovery.yml.
            "recovery_action": self._field(h, nv.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION),
        }

    def _pcie(self, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        return {
            "pcie_gen": get(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            "pcie_width": get(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            "pcie_max_gen": get(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
            "pcie_max_width": get(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            "pcie_replay": get(nv.nvmlDeviceGetPcieReplayCounter, h),
        }

    def _modes(self, h: Any) -> dict[str, Any]:
        nv, get = self.nv, self._get
        ecc = get(nv.nvmlDeviceGetEccMode, h)
        mig = get(nv.nvmlDeviceGetMigMode, h)
        persistence = get(nv.nvmlDeviceGetPersistenceMode, h)
        return {
            "persistence_mode": None if persistence is None else bool(persistence),
            "ecc_mode": None if ecc is None else bool(ecc[0]),
            "mig_mode": None if mig is None else bool(mig[0]),
            "compute_mode": get(nv.nvmlDeviceGetComputeMode, h),
        }

    def pci_bus_ids(self) -> dict[tuple[int, int, int], int]:
        """GPU index by PCI (domain, bus, device); a GPU that does not answer is left out."""
        out = {}
        for index, handle in enumerate(self.handles):
            try:
                info = self._get(self.nv.nvmlDeviceGetPciInfo, handle)
            except _Lost:
                continue
            if info is not None:
                out[(int(info.domain), int(info.bus), int(info.device))] = index
        return out

    # --- events -----------------------------------------------------------------------

    def _event_set(self) -> Any:
        if self._events is None:
            nv = self.nv
            self._events = nv.nvmlEventSetCreate()
            mask = (
                nv.nvmlEventTypeXidCriticalError
                | nv.nvmlEventTypeSingleBitEccError
                | nv.nvmlEventTypeDoubleBitEccError
            )
            for h in self.handles:
                try:
                    nv.nvmlDeviceRegisterEvents(h, mask, self._events)
                except nv.NVMLError as exc:  # some boards refuse some types; keep the rest
                    log.warning("cannot register NVML events: %s", exc)
        return self._events

    def wait_events(self, timeout_ms: int) -> list[HealthSignal]:
        """XID and ECC events within `timeout_ms`; SourceError when NVML refuses the wait."""
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait_v2(self._event_set(), timeout_ms)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == nv.NVML_ERROR_TIMEOUT:
                return []  # nothing happened: the usual answer
            # Any other answer (a lost GPU's) comes at once, not after the timeout: the
            # caller must pause before asking again, so it is told rather than given [].
            raise SourceError("down", str(exc), target="NVML") from exc
        gpu = self._by_address.get(_address(data.device))
        if gpu is None:  # the events stream requires a GPU: a guess could fault a healthy one
            self.unmapped_events += 1
            log.warning(
                "NVML event (type %s, data %s) from a device not among this node's %d GPUs: "
                "dropped (the kernel log's report of an XID names its PCI address)",
                data.eventType,
                data.eventData,
                len(self.handles),
            )
            return []
        if data.eventType == nv.nvmlEventTypeXidCriticalError:
            return [
                HealthSignal(
                    "xid", {"gpu": gpu, "xid": int(data.eventData), "message": "NVML XID event"}
                )
            ]
        kind = "dbe" if data.eventType == nv.nvmlEventTypeDoubleBitEccError else "sbe"
        return [HealthSignal("ecc", {"gpu": gpu, "type": kind, "count": 1})]


def _address(handle: Any) -> Any:
    """What identifies a device handle. pynvml's are ctypes pointers, and an event's is a
    new pointer object on each read (== compares objects): their address is the same."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def _milli(value: Any) -> float | None:
    return None if value is None else float(value) / 1000.0


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
