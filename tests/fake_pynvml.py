"""A pynvml stand-in whose answers come from the recorded H200 snapshot.

Only the device is fake: the error classes and constants are pynvml's own, so the
backend's error handling is exercised against the real library's types. Calls the
H200 answered "Not Supported" raise NotSupported here too.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

SNAPSHOT = json.loads(
    (Path(__file__).parent / "fixtures" / "nvml" / "h200_snapshot.json").read_text()
)


class FakeNvml:
    """Looks like the pynvml module for the calls the agent makes."""

    def __init__(self, gpus: int = 1) -> None:
        self.dev = SNAPSHOT["devices"][0]
        self.gpus = gpus
        self.lost: set[int] = set()
        self.events: deque[Any] = deque()
        self.calls = 0
        self.shutdown = False
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")) or name.startswith("NVMLError"):
                setattr(self, name, getattr(pynvml, name))

    def _dev(self, h: int) -> dict[str, Any]:
        self.calls += 1
        if h in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.dev

    @staticmethod
    def _value(v: Any) -> Any:
        if isinstance(v, dict) and "error" in v:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return v

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"{self._dev(h)['uuid']}-{h}" if h else self._dev(h)["uuid"]

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self._dev(h)["name"])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return int(self._dev(h)["temperature_gpu"])

    def nvmlDeviceGetTemperatureThreshold(self, h: int, which: int) -> int:
        th = self._dev(h)["temp_thresholds"]
        key = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "gpu_slowdown",
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "gpu_shutdown",
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: "gpu_max",
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: "mem_max",
        }.get(which, "acoustic_curr")
        return int(self._value(th[key]))

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        fields = self._dev(h)["field_values_ok"]
        out = []
        for fid in ids:
            name = next(
                (n for n in dir(pynvml) if n.startswith("NVML_FI_") and getattr(pynvml, n) == fid),
                "",
            )
            if name in fields:
                out.append(
                    SimpleNamespace(
                        nvmlReturn=0,
                        valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                        value=SimpleNamespace(uiVal=fields[name]),
                    )
                )
            else:
                out.append(
                    SimpleNamespace(
                        nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=0, value=None
                    )
                )
        return out

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(self._dev(h)["power_usage_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return int(self._dev(h)["power_enforced_limit_mw"])

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return int(self._dev(h)["power_limit_default_mw"])

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: int) -> tuple[int, int]:
        lo, hi = self._dev(h)["power_limit_constraints_mw"]
        return lo, hi

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return int(self._dev(h)["energy_mj"])

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return int(self._dev(h)["clock_sm" if clock == pynvml.NVML_CLOCK_SM else "clock_mem"])

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        return int(
            self._dev(h)["max_clock_sm" if clock == pynvml.NVML_CLOCK_SM else "max_clock_mem"]
        )

    def nvmlDeviceGetApplicationsClock(self, h: int, clock: int) -> int:
        return int(self._dev(h)["app_clock_sm"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return int(self._dev(h)["clocks_event_reasons"])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        u = self._dev(h)["utilization"]
        return SimpleNamespace(gpu=u["gpu"], memory=u["memory"])

    def nvmlDeviceGetPerformanceState(self, h: int) -> int:
        return int(self._dev(h)["pstate"])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(**self._dev(h)["memory"])

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        d = self._dev(h)
        if kind == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(d["ecc_corrected_volatile"]) if counter == pynvml.NVML_VOLATILE_ECC else 0
        return int(
            d[
                "ecc_uncorrected_volatile"
                if counter == pynvml.NVML_VOLATILE_ECC
                else "ecc_uncorrected_aggregate"
            ]
        )

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        a, b, c, d = self._dev(h)["remapped_rows"]
        return a, b, c, d

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return int(self._value(self._dev(h)["retired_pending"]))

    def nvmlDeviceGetFanSpeed(self, h: int) -> int:
        return int(self._value(self._dev(h)["fan"]))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return int(self._dev(h)["pcie_gen"])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return int(self._dev(h)["pcie_width"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return int(self._dev(h)["pcie_max_gen"])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return int(self._dev(h)["pcie_max_width"])

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return int(self._dev(h)["pcie_replay"])

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:
        return int(self._dev(h)["persistence_mode"])

    def nvmlDeviceGetEccMode(self, h: int) -> tuple[int, int]:
        a, b = self._dev(h)["ecc_mode"]
        return a, b

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        a, b = self._dev(h)["mig_mode"]
        return a, b

    def nvmlDeviceGetComputeMode(self, h: int) -> int:
        return int(self._dev(h)["compute_mode"])

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, mask: int, event_set: str) -> None:
        self.registered = mask

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.popleft()
