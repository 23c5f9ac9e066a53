"""The newest sample of every GPU in the inventory, kept in memory for the fleet heatmap.

Bounded by the inventory: a sample about a host it lacks is ignored (format v1 allows no GPU
index past `MAX_GPUS`). Each cell remembers the sequence number of the sample that wrote
it, so a live page asks only for what changed since the last frame it drew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from gpuops.inventory.domains import Domains
from gpuops.inventory.hosts import Inventory
from gpuops.match.facts import Telemetry, as_telemetry
from gpuops.models import Event

# The readings the heatmap colours by, in the order a cell carries them after
# [node position, gpu, seconds old]. Memory bandwidth is null where a source lacks it.
SIGNALS = ("temp_c", "temp_slowdown_c", "power_w", "power_limit_w", "util_gpu", "dram_bw_util")
_SIGNALS_OF = itemgetter(*SIGNALS)


class Cell(NamedTuple):
    """One GPU's newest readings, as the sample had them.

    A tuple, and rounded only when shown: one is made for every GPU sample the engine
    handles (8,000 a second at 1,000 nodes), and pages read a few of them."""

    seq: int
    at: float
    values: tuple[float | None, ...]

    @property
    def shown(self) -> tuple[float | None, ...]:
        """The readings to one decimal, as pages show them."""
        return tuple([None if v is None else round(v, 1) for v in self.values])


@dataclass(frozen=True, slots=True)
class Frame:
    """Cells of a set of nodes changed after a sequence number, as compact rows."""

    seq: int
    rows: list[list[float | int | None]]


class Latest:
    """The newest sample per GPU of the inventory's hosts."""

    def __init__(self, inventory: Inventory) -> None:
        self.nodes: tuple[str, ...] = tuple(sorted(inventory.hosts))
        # Failure domains are groups too (`rack:r1`, or the inventory group that names one).
        self.domains = Domains.of(inventory)
        every = {**self.domains.as_groups(), **inventory.groups}
        self.groups = {g: tuple(sorted(h)) for g, h in sorted(every.items())}
        self._index = {name: i for i, name in enumerate(self.nodes)}
        # Plain tuples (seq, at, values), made Cells when read: building a NamedTuple
        # costs twice a tuple, once per GPU sample, and pages read few of them.
        self._cells: list[dict[int, tuple[int, float, tuple[float | None, ...]]]] = [
            {} for _ in self.nodes
        ]
        self.seq = 0

    def observe(self, event: Event | Telemetry) -> None:
        """Keep the GPUs of a telemetry event about a host of the inventory."""
        telemetry = as_telemetry(event)
        if telemetry is None:
            return
        i = self._index.get(telemetry.node)
        if i is None:
            return
        self.seq += 1
        cells, at = self._cells[i], telemetry.epoch
        for fact in telemetry.facts:  # index < MAX_GPUS: format v1 refuses others
            cells[fact["index"]] = (self.seq, at, _SIGNALS_OF(fact))

    def nodes_of(self, group: str | None) -> Sequence[str] | None:
        """The nodes of a group in order (every node for none or `all`); None: no such group."""
        if not group or group == "all":
            return self.nodes
        return self.groups.get(group)

    def frame(self, nodes: Sequence[str], now: float, since: int = 0) -> Frame:
        """Rows `[position in nodes, gpu, seconds old, *SIGNALS]` of cells newer than `since`."""
        rows: list[list[float | int | None]] = []
        for pos, name in enumerate(nodes):
            i = self._index.get(name)
            if i is None:
                continue
            for gpu, held in sorted(self._cells[i].items()):
                if held[0] > since:
                    cell = Cell._make(held)
                    rows.append([pos, gpu, round(max(0.0, now - cell.at)), *cell.shown])
        return Frame(self.seq, rows)

    def gpus(self, node: str) -> dict[int, Cell]:
        """A node's newest cells by GPU index."""
        i = self._index.get(node)
        if i is None:
            return {}
        return {gpu: Cell._make(held) for gpu, held in self._cells[i].items()}
