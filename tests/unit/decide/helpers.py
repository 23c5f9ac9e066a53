"""The live engine's stages, built by `build_engine` on in-memory buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher, Publisher
from gpuops.catalog import load_catalog
from gpuops.clock import ManualClock
from gpuops.inventory.hosts import Inventory
from gpuops.match.rules import RuleSet
from gpuops.models import Match
from gpuops.record.notify import Notifier
from gpuops.settings import SafetySettings, Settings
from gpuops.spine.build import Engine, build_engine

ROOT = Path(__file__).resolve().parents[3]
T0 = 1_800_000_000.0
NODES = frozenset(f"node-{i:03d}" for i in range(1, 21))
INVENTORY = Inventory(
    Path("inv"),
    NODES,
    {"rack-a": frozenset({"node-001", "node-002"})},
    {n: {"rack": "a" if n < "node-011" else "b"} for n in NODES},
)


def engine_on(
    clock: ManualClock,
    buckets: Buckets | None = None,
    notifier: Notifier | None = None,
    rules: RuleSet | None = None,
    inventory: Inventory = INVENTORY,
    dry_run: bool = False,
    publisher: Publisher | None = None,
    **safety: Any,
) -> Engine:
    """An engine as `run` builds it, on memory buckets (pass the same buckets for replicas)."""
    # The breaker and the domain budgets are tested on their own; elsewhere they must not
    # interfere.
    safety = {"breaker_share": 1.0, "breaker_absolute": 1000, "domain_budgets": {}, **safety}
    settings = Settings(safety=SafetySettings(**safety), dry_run=dry_run)
    return build_engine(
        settings,
        rules=rules or RuleSet(rules=()),
        inventory=inventory,
        catalog=load_catalog(ROOT / "playbooks"),
        buckets=buckets or Buckets.memory(),
        publisher=publisher or MemoryPublisher(),
        clock=clock,
        signing_key=b"k" * 32,
        notifier=notifier,
    )


def match(
    rule: str,
    node: str = "node-001",
    t: float = T0,
    gpu: int | None = 3,
    kind: str = "xid",
    event_id: str | None = None,
    **facts: Any,
) -> Match:
    """A match of `rule` on `node` at `t`, as the matcher makes one."""
    key = f"{node}/{gpu}" if gpu is not None else node
    return Match(
        rule=rule,
        kind=kind,
        node=node,
        gpu=gpu,
        key=key,
        event_id=event_id or f"e-{rule}-{node}-{gpu}-{t}",
        event_ts=t,
        at=t,
        facts={"node": node, "gpu": gpu, "xid": 79, "temp_c": 88.0, **facts},
    )
