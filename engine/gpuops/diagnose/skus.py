"""Per-SKU expectations for the graded diagnostics, each number with its sources.

The shipped `skus.yml` holds what public fleets enforce; a site's file, of the same
shape, replaces any number it names (value and sources together: a site's number must
say where it came from too) or adds SKUs of its own.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuops.errors import ConfigError

SHIPPED = "skus.yml"
NUMBERS = (
    "gpu_count",
    "pcie_gen",
    "pcie_width",
    "nccl_allreduce_busbw_gbs",
    "nvbandwidth_h2d_gbs",
    "nvbandwidth_d2h_gbs",
    "nvbandwidth_d2d_gbs",
    "ib_write_bw_gbps",
)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Sourced(_Frozen):
    """A number and where it comes from (a URL with the line or file it was read from)."""

    value: Annotated[float, Field(gt=0)]
    sources: Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Field(min_length=1)]


class SkuExpectations(_Frozen):
    """What a healthy node of one SKU reaches in each diagnostic."""

    description: str = ""
    gpu_count: Sourced
    pcie_gen: Sourced
    pcie_width: Sourced
    nccl_allreduce_busbw_gbs: Sourced  # 8-GPU all_reduce_perf, out-of-place busbw
    nvbandwidth_h2d_gbs: Sourced  # host_to_device_memcpy_ce, every GPU
    nvbandwidth_d2h_gbs: Sourced  # device_to_host_memcpy_ce, every GPU
    nvbandwidth_d2d_gbs: Sourced  # device_to_device_memcpy_read_ce, every pair
    ib_write_bw_gbps: Sourced  # ib_write_bw with GPUDirect, per HCA

    def nvbandwidth_expect(self) -> dict[str, float]:
        """The bounds `parsers.nvbandwidth` takes, by testcase."""
        return {
            "host_to_device_memcpy_ce": self.nvbandwidth_h2d_gbs.value,
            "device_to_host_memcpy_ce": self.nvbandwidth_d2h_gbs.value,
            "device_to_device_memcpy_read_ce": self.nvbandwidth_d2d_gbs.value,
        }


class SkuTable(_Frozen):
    """Every known SKU's expectations, by key (`h200-8gpu`)."""

    skus: dict[str, SkuExpectations]

    def get(self, sku: str) -> SkuExpectations:
        """The SKU's expectations; an unknown SKU is a configuration error, never a default."""
        try:
            return self.skus[sku]
        except KeyError:
            known = ", ".join(sorted(self.skus))
            raise ConfigError(
                f"no diagnostics expectations for SKU {sku!r} (known: {known}); "
                "add it to the site's skus file"
            ) from None


def load(path: Path | None = None) -> SkuTable:
    """The shipped expectations, with the site's file at `path` merged over them."""
    shipped = _read(resources.files("gpuops.diagnose").joinpath(SHIPPED).read_text(), SHIPPED)
    if path is None:
        return _table(shipped, SHIPPED)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: the diagnostics skus file cannot be read ({exc})") from exc
    return _table(_merge(shipped, _read(text, str(path)), str(path)), str(path))


def _read(text: str, where: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("skus", {}), dict):
        raise ConfigError(f"{where}: expected a mapping with a 'skus:' mapping of SKU keys")
    return doc


def _merge(shipped: dict[str, Any], site: dict[str, Any], where: str) -> dict[str, Any]:
    """Per SKU, per number: the site's entry replaces the shipped one whole."""
    skus = {key: dict(entry) for key, entry in shipped["skus"].items()}
    for key, entry in (site.get("skus") or {}).items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: skus.{key} must be a mapping of numbers")
        skus[key] = {**skus.get(key, {}), **entry}
    return {"skus": skus}


def _table(doc: dict[str, Any], where: str) -> SkuTable:
    try:
        return SkuTable.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ConfigError(f"{where}: diagnostics skus are invalid ({problems})") from exc
