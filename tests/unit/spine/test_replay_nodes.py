"""Replay without an inventory: the recording names the nodes, read without decoding the
events (they are decoded once, as they are fed)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gpuops.bus import wire
from gpuops.match.loader import load_rules
from gpuops.settings import Settings
from gpuops.sim.fleet import envelope
from gpuops.spine.replay import _nodes_in, replay

from tests.conftest import ROOT

T0 = 1_900_000_000.0


def test_the_first_pass_reads_only_nodes_and_the_feed_refuses_what_does_not_decode(
    tmp_path: Path,
) -> None:
    lines = [
        envelope("heartbeat", "node-001", T0, {"seq": 1}),
        envelope("heartbeat", "node-002", T0 + 1, {"seq": 1}),
        {"id": "x", "node": "../etc", "kind": "heartbeat"},  # no node a subject may carry
        # `$` in Python's re takes a final newline: the first pass must not.
        envelope("heartbeat", "node-003\n", T0 + 2, {"seq": 1}),
        {"id": "y", "node": 7, "kind": "heartbeat"},
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")
    assert _nodes_in(path) == {"node-001", "node-002"}
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    shadow, report = asyncio.run(replay(path, rules, None))
    assert shadow.hosts == {"node-001", "node-002"}
    assert report.events == 2 and report.refusals() == 4


def test_the_first_pass_names_the_nodes_the_feed_takes(tmp_path: Path) -> None:
    """The first pass parses as the feed does: a NaN in an event's open fields (as
    json.dumps writes one) names its node; a line nested deeper than a parser recurses
    is refused by both, and the replay goes on."""
    ok = envelope("heartbeat", "node-001", T0, {"seq": 1})
    odd = envelope("heartbeat", "node-002", T0 + 1, {"seq": 1, "x": float("nan")})
    deep = b'{"x":' + b"[" * 3000 + b"]" * 3000 + b',"node":"node-003"}\n'
    path = tmp_path / "r.jsonl"
    path.write_bytes((json.dumps(ok) + "\n" + json.dumps(odd) + "\n").encode() + deep)
    assert _nodes_in(path) == {"node-001", "node-002"}
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    shadow, report = asyncio.run(replay(path, rules, None))
    assert shadow.hosts == {"node-001", "node-002"}
    assert report.events == 2 and report.refusals() == 1 and not report.unknown


def test_a_v2_sample_names_its_node_and_one_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """A v2 line's node is read by msgspec, the parser its feed uses: a sample whose raw
    rows nest deeper than msgspec recurses, or hold a NaN, names no node, is refused as
    `json` by the feed, and the replay goes on."""
    gpus = [{"index": 0, "uuid": "GPU-1", "power_limit_w": 700.0, "temp_c": 40.0}]
    writer = wire.TelemetryWriter("agent", json=True)
    ok = writer.encode("node-001", T0, gpus, "e1")
    deep = wire.TelemetryWriter("agent", json=True).encode("node-002", T0 + 1, gpus, "e2")
    deep = deep.replace(b'"gpus":[[', b'"gpus":[' + b"[" * 5000 + b"[", 1)
    deep = deep.replace(b"]]}", b"]" * 5000 + b"]]}", 1)
    # JSON has no NaN: msgspec, the v2 feed's parser, refuses the token (pydantic-core,
    # the first pass's parser before, took it and named the node).
    nan = writer.encode("node-003", T0 + 2, gpus, "e3").replace(b"40.0", b"NaN", 1)
    path = tmp_path / "r.jsonl"
    path.write_bytes(ok + b"\n" + deep + b"\n" + nan + b"\n")
    assert _nodes_in(path) == {"node-001"}
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    shadow, report = asyncio.run(replay(path, rules, None))
    assert shadow.hosts == {"node-001"}
    assert report.events == 1 and report.refusals("json") == report.refusals() == 2


def test_a_v2_keyframe_refused_as_future_teaches_replay_nothing(tmp_path: Path) -> None:
    """Review of issue 30: replay joined (and learnt) a v2 sample's static facts as it read
    the line, and judged its time after; the intake judges the time first, so a keyframe
    it refuses as `future` teaches it nothing and the samples after it that name its
    facts are `facts_unknown` until the next keyframe. Replay now does the same."""
    writer = wire.TelemetryWriter("agent", json=True)
    gpus = [{"index": 0, "uuid": "GPU-1", "power_limit_w": 700.0, "temp_c": 40.0}]
    lines = []
    for i in range(0, 60, 5):
        lines.append(json.dumps(envelope("heartbeat", "node-002", T0 + i, {"seq": i})).encode())
        # The agent's clock 100 s ahead at boot, then set right (NTP) before its next
        # keyframe: the samples after the first name the first one's facts.
        lines.append(writer.encode("node-001", T0 + i + (100 if i == 0 else 0), gpus))
    assert writer.keyframes == 1
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    rules = load_rules([ROOT / "rules"], ROOT / "playbooks")
    settings = Settings(max_future_skew_s=60)
    _, report = asyncio.run(replay(path, rules, None, settings))
    refused = {
        reason: r.count for (reason, node), r in report.refused.items() if node == "node-001"
    }
    assert refused == {"future": 1, "facts_unknown": 11}, refused
