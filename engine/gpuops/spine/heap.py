"""The engine process's heap, settled once rules and inventory are loaded.

CPython collects its youngest generation every 700 new container objects. The engine
makes thousands of short-lived dicts per telemetry batch (decoded samples, facts) that
reference counting frees anyway, so at that pace the collector mostly walks a batch
still in use: about 5% of the engine's CPU at 8,000 samples/s, and a full collection
now and then that held the loop for 90-180 ms (`gpuops bench intake` prints the
pauses). What is loaded at start (modules, rules, the inventory's hosts) lives as long
as the process: frozen, no collection walks it again (reference counting still frees a
frozen object whose last reference goes, such as the rules a reload replaces).
"""

from __future__ import annotations

import gc

# A young collection after this many new containers. A telemetry batch (256 messages of
# 8 GPUs) makes about 6,000 and each partition may have one in flight: with the default 8
# partitions, their short-lived objects are freed by reference counting before any
# collection walks them.
YOUNG = 50_000
# Middle and old collections stay rare: what survives a young one is mostly window state
# the engine keeps on purpose.
MIDDLE, OLD = 20, 100


def settle_heap() -> None:
    """Collect what loading left behind, freeze the rest, collect less often from now on."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
