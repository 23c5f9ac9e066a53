"""Topology as code: what a node must have, and what differs on one that is running.

A manifest (YAML in git: `topology/<sku>.yml`) names each GPU by index with its PCI
address, PCIe generation and width, NUMA node and NVLink link count, and each HCA with
its NUMA node, rate and nearest GPU (its `nvidia-smi topo -m` level: PIX, PXB, PHB,
NODE, SYS); `hosts:` gives a host the parts that differ for it (a board in another slot).
`gpuops topology learn NODE` writes one from a known-good node (`learned`); the agent
compares its node with it on start and on an interval (`differences`), and each
difference is a `topology` event the shipped rules act on (rules/topology.yml).

What is compared, and when:
- a GPU or HCA of the manifest that is not there;
- PCIe width below the manifest's, always (a link does not narrow to save power);
- PCIe generation below the manifest's only on a loaded GPU: an idle one trains down
  to Gen1 by design (GPU_FAULTS.md), so that is no fault;
- NUMA node, NVLink links active, HCA rate, and the HCA's level to its GPU, where the
  node reports them (a value the node cannot read is not compared).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuops.errors import ConfigError

Level = Literal["PIX", "PXB", "PHB", "NODE", "SYS"]
# A GPU doing work at or above this utilisation runs its link at full generation.
LOADED_UTIL = 30.0


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuPlace(_Frozen):
    """One GPU as it must be (a manifest) or as it is (`pcie_*` the current link)."""

    pci: str = Field(min_length=1, max_length=32)  # 0000:18:00.0
    pcie_gen: int | None = Field(default=None, ge=1, le=8)
    pcie_width: int | None = Field(default=None, ge=1, le=32)
    numa: int | None = Field(default=None, ge=-1, le=1024)
    nvlinks: int | None = Field(default=None, ge=0, le=64)


class NicPlace(_Frozen):
    """One HCA: NUMA node, rate, and the GPU it sits nearest with the path's level."""

    numa: int | None = Field(default=None, ge=-1, le=1024)
    rate_gbps: float | None = Field(default=None, gt=0, le=10_000)
    gpu: int | None = Field(default=None, ge=0, le=63)
    level: Level | None = None


class Topology(_Frozen):
    """A node's GPUs by index and HCAs by device name."""

    gpus: dict[int, GpuPlace] = Field(default_factory=dict, max_length=64)
    nics: dict[str, NicPlace] = Field(default_factory=dict, max_length=64)


class Manifest(Topology):
    """A SKU's topology, and the hosts that differ from it."""

    sku: str = ""
    sources: tuple[str, ...] = ()  # where it was learnt: `learned from node-001 at ...`
    hosts: dict[str, Topology] = Field(default_factory=dict)

    def for_host(self, node: str) -> Topology:
        """The topology `node` must have: the SKU's, with the host's own parts over it."""
        own = self.hosts.get(node)
        if own is None:
            return Topology(gpus=self.gpus, nics=self.nics)
        return Topology(gpus={**self.gpus, **own.gpus}, nics={**self.nics, **own.nics})


class Difference(_Frozen):
    """One way the node differs from its manifest: what a `topology` event carries."""

    check: str  # gpu_missing, pcie_width, pcie_gen, numa, nvlinks, nic_missing, nic_*
    gpu: int | None = None
    device: str = ""
    expected: Any = None
    actual: Any = None
    detail: str = ""


def load_manifest(path: Path) -> Manifest:
    """A manifest file; ConfigError with the file and the problem when it does not read."""
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return Manifest.model_validate(doc)
    except OSError as exc:
        raise ConfigError(f"{path}: the topology manifest cannot be read ({exc})") from exc
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{path}: not a topology manifest ({exc})") from exc


class Manifests:
    """A site's manifests by SKU (each file's `sku`): every `*.yml` of a directory in git.
    A host is held to its SKU's (the inventory's `gpu_sku`); a SKU with none is not
    compared."""

    def __init__(self, by_sku: Mapping[str, Manifest]) -> None:
        self.by_sku = dict(by_sku)

    @classmethod
    def load(cls, directory: Path | None) -> Manifests:
        """The directory's manifests (none without one); ConfigError names a file that does
        not read, or two for one SKU."""
        found: dict[str, tuple[Path, Manifest]] = {}
        if directory is not None and not directory.is_dir():
            raise ConfigError(f"{directory}: no such directory of topology manifests")
        for path in sorted(directory.glob("*.yml")) if directory is not None else ():
            manifest = load_manifest(path)
            if not manifest.sku:
                raise ConfigError(f"{path}: a topology manifest names its sku")
            if manifest.sku in found:
                first = found[manifest.sku][0]
                raise ConfigError(f"{path}: sku {manifest.sku} has a manifest already ({first})")
            found[manifest.sku] = (path, manifest)
        return cls({sku: manifest for sku, (_, manifest) in found.items()})

    def for_host(self, node: str, sku: str) -> Topology | None:
        """What `node` of `sku` must have; None when the SKU has no manifest."""
        manifest = self.by_sku.get(sku)
        return manifest.for_host(node) if manifest else None


def pci_of(bus_id: str) -> str:
    """nvidia-smi's bus id (`00000000:18:00.0`) as sysfs and manifests spell it."""
    text = bus_id.strip().lower()
    return text[4:] if len(text) == 16 and text.startswith("0000") else text


def from_readings(
    links: Sequence[str], numa: Sequence[str]
) -> tuple[Topology, dict[int, float | None]]:
    """A node's GPUs and their load from baseline.yml's readings: nvidia-smi's rows of
    `index, pci.bus_id, pcie.link.gen.current, pcie.link.width.current, utilization.gpu`
    and grep's `<sysfs>/bus/pci/devices/ADDR/numa_node:N` lines. A row that does not read
    is left out (its GPU is then missing, as the node reports it); `[N/A]` is unknown."""
    numa_of = {}
    for line in numa:
        path, _, value = line.rpartition(":")
        parts = path.split("/")
        if len(parts) >= 2 and value.strip().lstrip("-").isdigit():
            numa_of[parts[-2].lower()] = int(value)
    gpus, util = {}, {}
    for row in links:
        cells = [c.strip() for c in row.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        index, pci = int(cells[0]), pci_of(cells[1])
        try:
            gpus[index] = GpuPlace(
                pci=pci,
                pcie_gen=_int(cells[2]),
                pcie_width=_int(cells[3]),
                numa=numa_of.get(pci),
            )
        except ValidationError:
            continue
        util[index] = _float(cells[4])
    return Topology(gpus=gpus), util


def _int(cell: str) -> int | None:
    return int(cell) if cell.isdigit() else None


def _float(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def learned(seen: Topology, node: str, sku: str, at: str) -> Manifest:
    """A manifest from a known-good node: every GPU at its link's maximum (`seen` holds
    the maxima there: an idle GPU's current generation says nothing)."""
    return Manifest(
        sku=sku, sources=(f"learned from {node} at {at}",), gpus=seen.gpus, nics=seen.nics
    )


def dump(manifest: Manifest) -> str:
    """The manifest as the YAML kept in git."""
    doc = manifest.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    first: dict[str, Any] = {k: doc.pop(k) for k in ("sku", "sources") if k in doc}  # on top
    doc = {**first, **doc}
    return "# gpuops topology manifest (docs/operations.md, 'Topology as code')\n" + yaml.safe_dump(
        doc, sort_keys=False
    )


def differences(
    want: Topology, seen: Topology, util: Mapping[int, float | None]
) -> list[Difference]:
    """How `seen` differs from `want`; `util` is each GPU's utilisation now (its load)."""
    out: list[Difference] = []
    for index, place in sorted(want.gpus.items()):
        got = seen.gpus.get(index)
        if got is None or got.pci.lower() != place.pci.lower():
            actual = got.pci if got else None
            out.append(_gpu("gpu_missing", index, place.pci, actual, "no GPU at its PCI address"))
            continue
        loaded = (util.get(index) or 0.0) >= LOADED_UTIL
        out += _gpu_links(index, place, got, loaded)
    for name, nic in sorted(want.nics.items()):
        have = seen.nics.get(name)
        if have is None:
            out.append(Difference(check="nic_missing", device=name, detail=f"{name} is not there"))
            continue
        out += _nic(name, nic, have)
    return out


def _gpu(check: str, gpu: int, expected: Any, actual: Any, detail: str) -> Difference:
    said = f"GPU {gpu}: {detail}"
    return Difference(check=check, gpu=gpu, expected=expected, actual=actual, detail=said)


def _gpu_links(index: int, want: GpuPlace, got: GpuPlace, loaded: bool) -> list[Difference]:
    out = []
    if _below(got.pcie_width, want.pcie_width):
        out.append(
            _gpu("pcie_width", index, want.pcie_width, got.pcie_width, f"x{got.pcie_width} link")
        )
    if loaded and _below(got.pcie_gen, want.pcie_gen):
        out.append(
            _gpu("pcie_gen", index, want.pcie_gen, got.pcie_gen, f"Gen{got.pcie_gen} under load")
        )
    if None not in (want.numa, got.numa) and want.numa != got.numa:
        out.append(_gpu("numa", index, want.numa, got.numa, f"on NUMA node {got.numa}"))
    if _below(got.nvlinks, want.nvlinks):
        out.append(_gpu("nvlinks", index, want.nvlinks, got.nvlinks, "NVLink links down"))
    return out


def _nic(name: str, want: NicPlace, have: NicPlace) -> list[Difference]:
    out = []
    for field, check in (("numa", "nic_numa"), ("level", "nic_level"), ("gpu", "nic_gpu")):
        expected, actual = getattr(want, field), getattr(have, field)
        if None not in (expected, actual) and expected != actual:
            out.append(
                Difference(
                    check=check,
                    device=name,
                    expected=expected,
                    actual=actual,
                    detail=f"{name}: {field} {actual}",
                )
            )
    if _below(have.rate_gbps, want.rate_gbps):
        out.append(
            Difference(
                check="nic_rate",
                device=name,
                expected=want.rate_gbps,
                actual=have.rate_gbps,
                detail=f"{name} at {have.rate_gbps:g} Gb/s",
            )
        )
    return out


def _below(actual: float | None, expected: float | None) -> bool:
    return actual is not None and expected is not None and actual < expected
