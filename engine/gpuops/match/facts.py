"""What rules see of an event: one fact per GPU for telemetry, else one.

Telemetry is most of what the engine reads, so the intake decodes it straight to a
`Telemetry` (its envelope and the per-GPU facts) rather than to the pydantic model;
the matcher and the observers (density, the power controller, the console) read the
same facts, so a sample is expanded once.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Literal

from gpuops.models import Event, GpuSample, TelemetryEvent

Fact = dict[str, Any]

# Every fact of a GPU has every field of the model (null when the sample lacks it), in
# the model's order, then what the matcher adds: the same dict whichever decoder made it.
GPU_FIELDS: tuple[str, ...] = tuple(GpuSample.model_fields)


@dataclass(frozen=True, slots=True)
class Telemetry:
    """A telemetry event as facts: the envelope's fields and one fact per GPU."""

    id: str
    node: str
    epoch: float
    source: str
    facts: list[Fact]
    kind: Literal["telemetry"] = "telemetry"
    publisher: str = ""  # who the intake proved sent it (gpuops.bus.identity)

    @classmethod
    def of(cls, event: TelemetryEvent) -> Telemetry:
        """The facts of a validated model (replay, test-rules, the intake's slow path)."""
        facts = [dict(gpu.__dict__) for gpu in event.data.gpus]
        facts = with_derived(facts, event.node)
        return cls(
            event.id, event.node, event.epoch, event.source, facts, publisher=event.publisher
        )


def as_telemetry(event: Event | Telemetry) -> Telemetry | None:
    """A telemetry event's facts (None for any other kind)."""
    if isinstance(event, Telemetry):
        return event
    if isinstance(event, TelemetryEvent):
        return Telemetry.of(event)
    return None


def with_derived(facts: list[Fact], node: str) -> list[Fact]:
    """Add `node`, `gpu` and the peer medians to each GPU's fields (in place)."""
    for fact in facts:
        fact["node"] = node
        fact["gpu"] = fact["index"]
        fact["dram_bw_util_peer_median"] = None
    return with_medians(facts)


def with_medians(facts: list[Fact]) -> list[Fact]:
    """Set each GPU's peer medians (in place), its facts already holding `node` and `gpu`
    (a v2 sample's do from its node's static facts, telemetry v2)."""
    bandwidth: list[float | None] = [f["dram_bw_util"] for f in facts]
    # Without a None (the usual sample), sorted as it is: no generator to leave them out.
    ordered: list[float] = sorted(
        (v for v in bandwidth if v is not None) if None in bandwidth else bandwidth  # type: ignore[arg-type]
    )
    n = len(ordered)
    if n < 2:  # no GPU has two reporting peers: the medians stay null (hot path)
        return facts
    # Leaving out the element at k, the median is the same for every k before the middle
    # one (n - 1) // 2, and for every k after it: three values serve all GPUs.
    mid = (n - 1) // 2
    before = median_skipping(ordered, 0)
    at = median_skipping(ordered, mid)
    after = median_skipping(ordered, n - 1)
    # A GPU's own value's place k (bisect_left: how many are below it) is before the
    # middle when the value is at most ordered[mid - 1], at it when at most ordered[mid]:
    # two comparisons a GPU rather than a search.
    low = ordered[mid - 1] if mid else -math.inf
    high = ordered[mid]
    everyone = median_skipping(ordered, n) if n < len(bandwidth) else None  # GPUs without
    for fact, own in zip(facts, bandwidth, strict=True):
        fact["dram_bw_util_peer_median"] = (
            everyone if own is None else before if own <= low else at if own <= high else after
        )
    return facts


def median_skipping(ordered: list[float], skip: int, fewest: int = 2) -> float | None:
    """The median of `ordered` without its element at `skip` (none past the end), as
    `peer_median` computes it, without a copy; None with fewer than `fewest` left."""
    count = len(ordered) - (1 if skip < len(ordered) else 0)
    if count < fewest:
        return None
    # The others' j-th is ordered[j] before the skipped one, ordered[j + 1] from it on
    # (written out: this runs for every GPU of every sample).
    mid = count // 2
    upper = ordered[mid] if mid < skip else ordered[mid + 1]
    if count % 2:
        return upper
    lower = ordered[mid - 1] if mid - 1 < skip else ordered[mid]
    return (lower + upper) / 2


def facts_of(event: Event | Telemetry) -> list[Fact]:
    """What rules see of an event: one fact per GPU for telemetry, else one."""
    telemetry = as_telemetry(event)
    if telemetry is not None:
        return telemetry.facts
    assert not isinstance(event, Telemetry)
    fact = dict(event.data.__dict__)
    fact["node"] = event.node
    return [fact]


def peer_median(
    values: list[float | None], i: int, ordered: list[float] | None = None
) -> float | None:
    """The median of the others' values (not `values[i]`); None with fewer than 2 others.

    One peer is no consensus: with two GPUs the slow one would look as odd as the fast.
    `ordered` (the non-null values, sorted) saves sorting again for every GPU of a sample.
    """
    others = list(ordered) if ordered is not None else sorted(v for v in values if v is not None)
    own = values[i]
    if own is not None:
        del others[bisect.bisect_left(others, own)]
    if len(others) < 2:
        return None
    mid = len(others) // 2
    return others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
