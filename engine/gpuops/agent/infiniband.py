"""InfiniBand (and RoCE) ports from sysfs: one node-level `ib` event per telemetry interval.

    /sys/class/infiniband/<dev>/ports/<n>/state        "4: ACTIVE", "1: DOWN"
                                         /phys_state   "5: LinkUp", "2: Polling", "3: Disabled"
                                         /rate         "400 Gb/sec (4X NDR)"
                                         /link_layer   "InfiniBand" or "Ethernet"
                                         /counters/*   one integer per file

The root is configurable so tests (and the simulated fleet) build the same tree in a
directory of their own. No root, or no port under it, means no `ib` event: a node
without InfiniBand is not a fault. A file that cannot be read or parsed leaves that
value out; sizes are bounded (IB_MAX_PORTS ports, the counters in IB_COUNTERS).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpuops.models import IB_COUNTERS, IB_MAX_PORTS

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/sys/class/infiniband")
MAX_FILE = 256  # bytes read from one sysfs file; real ones are a few dozen


def read_ib(root: Path, seen_up: set[str] | None = None) -> dict[str, Any] | None:
    """The `ib` event data for every port under `root`, or None when there is none.

    With `seen_up` (the agent keeps it for its life), a port counts as down only once it
    has been ACTIVE: a spare port nobody cabled, or one whose peer is not there yet, is
    not a fault that drains the node at every start. Without it, every port not ACTIVE
    counts (a one-off reading for a person).
    """
    ports = list_ports(root)
    if not ports:
        return None
    detail = [read_port(device, port_dir) for device, port_dir in ports]
    if seen_up is not None:
        seen_up.update(_name(p) for p in detail if str(p["state"]).upper() == "ACTIVE")
    return summarise(detail, seen_up)


def list_ports(root: Path) -> list[tuple[str, Path]]:
    """(device, port directory) for each port, in name order, at most IB_MAX_PORTS."""
    out: list[tuple[str, Path]] = []
    try:
        devices = sorted(p for p in root.iterdir() if (p / "ports").is_dir())
    except OSError:
        return []
    for device in devices:
        try:
            numbers = sorted(int(p.name) for p in (device / "ports").iterdir() if p.name.isdigit())
        except OSError:
            continue
        out.extend((device.name, device / "ports" / str(n)) for n in numbers)
    if len(out) > IB_MAX_PORTS:
        log.warning(
            "%d InfiniBand ports under %s; reading the first %d", len(out), root, IB_MAX_PORTS
        )
    return out[:IB_MAX_PORTS]


def read_port(device: str, port_dir: Path) -> dict[str, Any]:
    """One port: state words without their numbers, rate, link layer, counters."""
    counters = {}
    for name in IB_COUNTERS:
        value = _integer(_text(port_dir / "counters" / name))
        if value is not None:
            counters[name] = value
    return {
        "device": device[:64],
        "port": int(port_dir.name),
        "state": _word(_text(port_dir / "state")),
        "phys_state": _word(_text(port_dir / "phys_state")),
        "rate": (_text(port_dir / "rate") or "")[:64],
        "link_layer": (_text(port_dir / "link_layer") or "")[:32],
        "counters": counters,
    }


def is_down(port: dict[str, Any]) -> bool:
    """Not ACTIVE, unless disabled on purpose (an unused port an operator switched off)."""
    state, phys = str(port["state"]), str(port["phys_state"])
    return state.upper() != "ACTIVE" and phys.lower() != "disabled"


def _name(port: dict[str, Any]) -> str:
    return f"{port['device']}/{port['port']}"


def summarise(detail: list[dict[str, Any]], seen_up: set[str] | None = None) -> dict[str, Any]:
    """The node-level fields rules use, with the ports for people."""
    down = [p for p in detail if is_down(p) and (seen_up is None or _name(p) in seen_up)]
    out: dict[str, Any] = {
        "ports": len(detail),
        "ports_active": sum(1 for p in detail if p["state"].upper() == "ACTIVE"),
        "ports_down": len(down),
        "down_ports": [_name(p) for p in down],
        "detail": detail,
    }
    for name in IB_COUNTERS:
        values = [p["counters"][name] for p in detail if name in p["counters"]]
        out[name] = sum(values) if values else None
    return out


def _text(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_FILE).decode("ascii", "replace").strip()
    except OSError:
        return None


def _word(text: str | None) -> str:
    """ "4: ACTIVE" -> "ACTIVE" (the number is the IBTA code of the word)."""
    if not text:
        return ""
    return text.split(":", 1)[-1].strip()[:32]


def _integer(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 <= value <= 2**64 else None
