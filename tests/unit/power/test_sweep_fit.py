"""The GPU check's power sweep calibrates the model: its fit gives back the model's
parameters from points the model produced."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from gpuops.sim.power_model import h200_model

from tests.conftest import ROOT


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_fit_recovers_alpha_and_the_reference_point() -> None:
    model = h200_model()
    burst = model.workload("training")
    rows = []
    for limit in _gpu_check().SWEEP_LIMITS_W:
        point = model.at(burst, limit)
        rows.append({"limit_w": limit, "power_w": point.power_w, "sm_clock_mhz": point.clock_mhz})
    fit = _gpu_check().fit_model(rows, model.idle_w)
    assert abs(fit["alpha"] - model.alpha) < 0.01
    assert (fit["ref_w"], fit["ref_clock_mhz"]) == (690.0, 1470.0)
