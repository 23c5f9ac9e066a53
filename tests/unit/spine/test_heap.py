"""The engine's heap settings: a telemetry batch's short-lived objects cost no collection."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuops.bench.intake import GcPauses
from gpuops.cli.shadow_cmds import _replayed
from gpuops.match.loader import load_rules
from gpuops.settings import Settings
from gpuops.sim.fleet import envelope
from gpuops.spine.heap import YOUNG, settle_heap

from tests.conftest import ROOT


@pytest.fixture
def restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _batch() -> int:
    """What decoding a batch of 8-GPU samples makes and drops: 10,000 live dicts at once."""
    batch = [{"gpu": i % 8, "temp_c": 40.0 + i % 30, "util": {"gpu": i % 100}} for i in range(5000)]
    return len(batch)


def test_a_batch_of_short_lived_dicts_starts_no_collection_once_settled(restored: None) -> None:
    with GcPauses() as before:
        _batch()
    assert before.summary()["0"]["n"] > 0  # at the default threshold, it did
    settle_heap()
    assert gc.get_threshold()[0] == YOUNG
    with GcPauses() as after:
        _batch()
    assert after.summary()["0"]["n"] == 0, after.summary()


def test_what_was_loaded_is_frozen_out_of_every_collection(restored: None) -> None:
    kept = [{"host": f"node-{i}"} for i in range(1000)]  # an inventory loaded at start
    settle_heap()
    assert gc.get_freeze_count() >= len(kept)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in kept)  # no generation holds them now


def test_gpuops_replay_settles_its_heap_as_the_engine_does(restored: None, tmp_path: Path) -> None:
    """Replay runs the engine's code on a recording: with the engine's heap, not the
    default collector's (a tenth of its CPU, walking samples reference counting frees)."""
    gc.set_threshold(700, 10, 10)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(envelope("heartbeat", "node-001", 1_900_000_000.0, {"seq": 1})))
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    report = _replayed(path, rules, Settings())
    assert report.events == 1
    assert gc.get_threshold()[0] == YOUNG
