"""A dcgm-exporter /metrics page for an 8-GPU H200 node, built from the recorded NVML snapshot.

The label set is the one dcgm-exporter emits per GPU (gpu, UUID, pci_bus_id, device,
modelName, Hostname, DCGM_FI_DRIVER_VERSION, and with the Kubernetes pod mapping
container, namespace, pod; "" where no pod holds the GPU). The metrics are the fields a
counters CSV enabling everything gpuops maps would publish, with the H200's idle
readings; `overrides` changes a DCGM field per GPU (e.g. GPU 3 at 92 C) and `claims` the
`Hostname` a GPU's series carry (a compromised exporter speaking for another node).
tests/fixtures/dcgm/h200-8gpu.prom is `exposition()`, kept for reading and for the
real-Prometheus test; a unit test keeps the two equal.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from aiohttp import web
from gpuops.inventory.hosts import Inventory

SNAPSHOT = json.loads(
    (Path(__file__).parent / "fixtures" / "nvml" / "h200_snapshot.json").read_text()
)
FIXTURE = Path(__file__).parent / "fixtures" / "dcgm" / "h200-8gpu.prom"
MIB = 1 << 20
# The PCI bus ids of an HGX H200 8-GPU baseboard.
BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
PODS = {  # GPU -> (container, namespace, pod); GPU 7 is idle
    **{i: ("trainer", "ml-train", "llama-pretrain-0") for i in range(4)},
    **{i: ("worker", "research", "bert-finetune-7f9c") for i in range(4, 7)},
}


def _idle() -> list[tuple[str, str, str, float]]:
    """(field, type, help, value) of an idle H200, in dcgm-exporter's order."""
    d = SNAPSHOT["devices"][0]
    fv, th, mem = d["field_values_ok"], d["temp_thresholds"], d["memory"]
    lo, hi = d["power_limit_constraints_mw"]
    used, free = round(mem["used"] / MIB), round(mem["free"] / MIB)
    rows = d["remapped_rows"]
    g = "gauge"
    c = "counter"
    return [
        ("DCGM_FI_DEV_SM_CLOCK", g, "SM clock frequency (in MHz).", d["clock_sm"]),
        ("DCGM_FI_DEV_MEM_CLOCK", g, "Memory clock frequency (in MHz).", d["clock_mem"]),
        ("DCGM_FI_DEV_APP_SM_CLOCK", g, "SM application clocks (in MHz).", d["app_clock_sm"]),
        ("DCGM_FI_DEV_MAX_SM_CLOCK", g, "Maximum SM clock (in MHz).", d["max_clock_sm"]),
        ("DCGM_FI_DEV_MEMORY_TEMP", g, "Memory temperature (in C).", fv["NVML_FI_DEV_MEMORY_TEMP"]),
        ("DCGM_FI_DEV_GPU_TEMP", g, "GPU temperature (in C).", d["temperature_gpu"]),
        ("DCGM_FI_DEV_SLOWDOWN_TEMP", g, "Slowdown temperature (in C).", th["gpu_slowdown"]),
        ("DCGM_FI_DEV_SHUTDOWN_TEMP", g, "Shutdown temperature (in C).", th["gpu_shutdown"]),
        ("DCGM_FI_DEV_GPU_MAX_OP_TEMP", g, "GPU maximum operating temperature.", th["gpu_max"]),
        ("DCGM_FI_DEV_MEM_MAX_OP_TEMP", g, "Memory maximum operating temperature.", th["mem_max"]),
        ("DCGM_FI_DEV_POWER_USAGE", g, "Power draw (in W).", d["power_usage_mw"] / 1000),
        (
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            c,
            "Total energy consumption since boot (in mJ).",
            d["energy_mj"],
        ),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT", g, "Power limit (in W).", d["power_limit_mw"] / 1000),
        (
            "DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF",
            g,
            "Default power limit (in W).",
            d["power_limit_default_mw"] / 1000,
        ),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN", g, "Minimum power limit (in W).", lo / 1000),
        ("DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX", g, "Maximum power limit (in W).", hi / 1000),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", c, "Total number of PCIe retries.", d["pcie_replay"]),
        ("DCGM_FI_DEV_PCIE_LINK_GEN", g, "PCIe current link generation.", d["pcie_gen"]),
        ("DCGM_FI_DEV_PCIE_LINK_WIDTH", g, "PCIe current link width.", d["pcie_width"]),
        ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", g, "PCIe max link generation.", d["pcie_max_gen"]),
        ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", g, "PCIe max link width.", d["pcie_max_width"]),
        ("DCGM_FI_DEV_GPU_UTIL", g, "GPU utilization (in %).", d["utilization"]["gpu"]),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", g, "Memory utilization (in %).", d["utilization"]["memory"]),
        ("DCGM_FI_DEV_XID_ERRORS", g, "Value of the last XID error encountered.", 0),
        ("DCGM_FI_DEV_FB_FREE", g, "Framebuffer memory free (in MiB).", free),
        ("DCGM_FI_DEV_FB_USED", g, "Framebuffer memory used (in MiB).", used),
        ("DCGM_FI_DEV_FB_RESERVED", g, "Framebuffer memory reserved (in MiB).", 0),
        (
            "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
            g,
            "Current clock event reasons (bitmask).",
            d["clocks_event_reasons"],
        ),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", c, "Single-bit volatile ECC errors.", 0),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", c, "Double-bit volatile ECC errors.", 0),
        ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", c, "Single-bit persistent ECC errors.", 0),
        ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", c, "Double-bit persistent ECC errors.", 0),
        (
            "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
            c,
            "Remapped rows for uncorrectable errors.",
            rows[1],
        ),
        (
            "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
            c,
            "Remapped rows for correctable errors.",
            rows[0],
        ),
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", g, "Whether remapping of rows has failed.", rows[3]),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", g, "Whether remapping of rows is pending.", rows[2]),
        ("DCGM_FI_DEV_PSTATE", g, "Performance state.", d["pstate"]),
        ("DCGM_FI_DEV_PERSISTENCE_MODE", g, "Persistence mode.", d["persistence_mode"]),
        ("DCGM_FI_DEV_ECC_CURRENT", g, "Current ECC mode.", d["ecc_mode"][0]),
        ("DCGM_FI_DEV_MIG_MODE", g, "MIG mode.", d["mig_mode"][0]),
        ("DCGM_FI_DEV_COMPUTE_MODE", g, "Compute mode.", d["compute_mode"]),
        ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", c, "NVLink flow-control CRC errors.", 0),
        ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", c, "NVLink retries.", 0),
        ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", c, "NVLink recovery errors.", 0),
        ("DCGM_FI_PROF_SM_ACTIVE", g, "Ratio of cycles an SM has at least 1 warp assigned.", 0),
        ("DCGM_FI_PROF_SM_OCCUPANCY", g, "Ratio of warps resident on an SM.", 0),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", g, "Ratio of cycles the tensor pipe is active.", 0),
        ("DCGM_FI_PROF_DRAM_ACTIVE", g, "Ratio of cycles the memory interface is active.", 0),
        ("DCGM_FI_PROF_NVLINK_TX_BYTES", g, "NVLink bytes transmitted per second.", 0),
        ("DCGM_FI_PROF_NVLINK_RX_BYTES", g, "NVLink bytes received per second.", 0),
    ]


def uuid(gpu: int) -> str:
    """The snapshot's UUID, its last digits made the GPU's own."""
    base = SNAPSHOT["devices"][0]["uuid"]
    return f"{base[:-2]}{gpu:02x}"


def labels(node: str, gpu: int) -> str:
    """The label set dcgm-exporter writes for one GPU."""
    container, namespace, pod = PODS.get(gpu, ("", "", ""))
    pairs = [
        ("gpu", str(gpu)),
        ("UUID", uuid(gpu)),
        ("pci_bus_id", f"00000000:{BUS_IDS[gpu % 8]}:00.0"),
        ("device", f"nvidia{gpu}"),
        ("modelName", SNAPSHOT["devices"][0]["name"]),
        ("Hostname", node),
        ("DCGM_FI_DRIVER_VERSION", SNAPSHOT["driver"]),
        ("container", container),
        ("namespace", namespace),
        ("pod", pod),
    ]
    return ",".join(f'{k}="{v}"' for k, v in pairs)


def _value(v: float) -> str:
    """As dcgm-exporter prints: integers bare, floats with six decimals; NaN and Inf as
    the text format spells them."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.6f}"
    return str(int(v))


def exposition(
    node: str = "gpu-node-07",
    gpus: int = 8,
    overrides: dict[int, dict[str, float]] | None = None,
    claims: dict[int, str] | None = None,
) -> str:
    """The /metrics page: every field for every GPU, `overrides[gpu][field]` replacing."""
    overrides, claims = overrides or {}, claims or {}
    lines: list[str] = []
    for name, kind, text, idle in _idle():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for gpu in range(gpus):
            value = overrides.get(gpu, {}).get(name, idle)
            lines.append(f"{name}{{{labels(claims.get(gpu, node), gpu)}}} {_value(value)}")
    return "\n".join(lines) + "\n"


def inventory(**hosts: str | None) -> Inventory:
    """An inventory of these hosts, each with its `ansible_host` (the address scraped)."""
    hostvars = {h: ({"ansible_host": a} if a else {}) for h, a in hosts.items()}
    return Inventory(Path("inventory.yml"), frozenset(hosts), {}, hostvars)


@contextlib.asynccontextmanager
async def serve(
    pages: dict[str, str], extra: Sequence[web.RouteDef] = (), host: str = "127.0.0.1"
) -> AsyncIterator[int]:
    """Serve `pages` (path -> text, read at each request, so tests change them) on a
    loopback port (of `host`: 127.0.0.2 is a second node's), as dcgm-exporter serves
    /metrics; yields the port."""

    async def page(request: web.Request) -> web.Response:
        if request.path not in pages:
            raise web.HTTPNotFound()
        return web.Response(text=pages[request.path], content_type="text/plain")

    app = web.Application()
    app.add_routes([*extra, web.get("/{path:.*}", page)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(exposition())
