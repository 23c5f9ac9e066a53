"""Issue 25: a Prometheus target may speak only for its own node.

A real Prometheus scrapes three dcgm-exporter pages: node-a's (compromised: two of its
four GPUs' series say `Hostname="node-b"`, and `node="node-b"` too), node-b's, and one
of a host that is not in the inventory. The source asks that Prometheus and publishes,
as the source's user and signed with its key, to a real nats-server with its
permissions. An XID 79 on node-a's own GPU and one on a series claiming node-b appear
together: only node-a's is an event; the forged series are refused (counted, logged
once, one dead letter `forged`), and no event about node-b comes from node-a's page.
Both ways a site binds a target to its node are run: Prometheus's `instance` found in
the inventory by `ansible_host`, and a `node` label that the scrape config sets on each
target (the exporter's own `node` is then renamed `exported_node` by Prometheus,
honor_labels being false).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpuops import subjects
from gpuops.agent.spool import Spool
from gpuops.bus.conn import DLQ, Bus, open_bus
from gpuops.bus.embedded import enrol, publisher_signer
from gpuops.bus.identity import KeyRing, Verifier, source
from gpuops.bus.publish import JetStreamPublisher
from gpuops.clock import ManualClock
from gpuops.errors import EventError
from gpuops.settings import NatsSettings, PrometheusSourceSettings
from gpuops.signing import load_key
from gpuops.sources import dcgm
from gpuops.sources.binding import Binding
from gpuops.sources.prometheus import PromSource, promql

from tests.conftest import wait_for
from tests.dcgm_exposition import exposition, inventory, serve
from tests.support import AsEvents, ask, prometheus

pytestmark = pytest.mark.faults
XID, TEMP = dcgm.XID_METRIC, "DCGM_FI_DEV_GPU_TEMP"
ADDRESS = {"node-a": "127.0.0.2", "node-b": "127.0.0.3", "node-x": "127.0.0.4"}
OWN, FORGED = 0, 2  # node-a's GPU whose XID is its own; the first one claiming node-b
CLAIMS = {2: "node-b", 3: "node-b"}


def _page_a(xid: int) -> str:
    """node-a's page: its GPUs 2 and 3 claim node-b (99 C, so a leak would show)."""
    hot = {FORGED: {XID: xid, TEMP: 99}, 3: {TEMP: 99}}
    page = exposition("node-a", 4, {OWN: {XID: xid}, **hot}, CLAIMS)
    return page.replace('Hostname="node-b"', 'Hostname="node-b",node="node-b"')


@dataclass
class Fleet:
    """Each node's exporter on its own loopback address: the pages it serves, its port."""

    pages: dict[str, dict[str, str]]
    ports: dict[str, int] = field(default_factory=dict)

    def instance(self, node: str) -> str:
        """The target as Prometheus names it (`instance`)."""
        return f"{ADDRESS[node]}:{self.ports[node]}"

    def job(self, by_label: bool) -> str:
        """The scrape config: honor_labels false; `by_label` sets `node` on each target."""
        job = "  - job_name: dcgm\n    honor_labels: false\n    static_configs:\n"
        for node in self.pages:
            labels = f", labels: {{node: {node}}}" if by_label else ""
            job += f"      - {{targets: ['{self.instance(node)}']{labels}}}\n"
        return job


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet(
        {
            "node-a": {"/metrics": _page_a(0)},
            "node-b": {"/metrics": exposition("node-b", 2)},
            "node-x": {"/metrics": exposition("node-x", 2)},
        }
    )
    async with AsyncExitStack() as stack:
        for node, pages in f.pages.items():
            f.ports[node] = await stack.enter_async_context(serve(pages, host=ADDRESS[node]))
        yield f


async def _count(url: str, instance: str) -> int:
    """How many mapped series Prometheus holds of one target: what its exporter published."""
    answer = await ask(url, "count(" + promql(f'instance="{instance}"') + ")")
    return int(answer[0]["value"][1])


async def _seen_by(url: str, query: str, n: int) -> None:
    async def ready() -> bool:
        return len(await ask(url, query)) == n

    await wait_for(ready, 20, 0.3)


@pytest.mark.parametrize("by_label", [False, True], ids=["instance", "target_label"])
async def test_node_as_xid_for_node_b_is_refused_and_its_own_is_published(
    tmp_path: Path,
    fleet: Fleet,
    by_label: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Instance mode finds nodes by address; label mode by name (no address needed).
    hosts = {n: (None if by_label else ADDRESS[n]) for n in ("node-a", "node-b")}
    state = tmp_path / "state"
    # The source's user and key, as an engine on this state dir writes them at start.
    identity_key = load_key(state / "keys" / "identity.key", "identity key")
    enrol(state, ["node-a", "node-b"], identity_key)
    with prometheus(tmp_path, fleet.job(by_label)) as url:
        await _seen_by(url, XID, 8)
        async with (
            open_bus(NatsSettings(), state) as engine,
            open_bus(NatsSettings(), state, "source", role="source") as agent,
        ):
            seen, signers = await _watch(engine, Verifier(KeyRing(identity_key)))
            cfg = PrometheusSourceSettings(
                prometheus=url, selector='job="dcgm"', target_label="node" if by_label else None
            )
            binding = Binding(inventory(**hosts), cfg.node_label, cfg.target_label)
            clock = ManualClock(1_800_000_000.0)
            spool = Spool(tmp_path / "spool.jsonl")
            signer = publisher_signer(state, source("prometheus"))
            prom = PromSource(cfg, binding, JetStreamPublisher(agent.js, signer), clock, spool)
            caplog.set_level(logging.WARNING, "gpuops.sources")
            first = await prom.scrape_once()  # every XID 0: remembered, not an event

            fleet.pages["node-a"]["/metrics"] = _page_a(79)
            await _seen_by(url, f"{XID} == 79", 2)
            clock.advance(10)
            second = await prom.scrape_once()
            await wait_for(lambda: len(seen) == 5, 10)  # 2 + 2 telemetry, 1 XID

            assert set(signers) == {"source:prometheus"}, "each one the source's, signed"
            xids = [(e["node"], e["data"]["gpu"], e["data"]["xid"]) for e in _of(seen, "xid")]
            assert xids == [("node-a", OWN, 79)], "node-a's own XID, and nothing for node-b"
            for e in _of(seen, "telemetry"):
                gpus = {g["index"]: g["temp_c"] for g in e["data"]["gpus"]}
                expected = {"node-a": {0: 34, 1: 34}, "node-b": {0: 34, 1: 34}}[e["node"]]
                assert gpus == expected, "no forged GPU in anybody's telemetry"

            published_by_a = await _count(url, fleet.instance("node-a"))
            published_by_x = await _count(url, fleet.instance("node-x"))
            for report in (first, second):
                refused = report.dropped["forged"]
                assert refused == published_by_a // 2 > 0, "GPUs 2 and 3: half of node-a's page"
                assert report.forwarded["node-a"] + refused == published_by_a
                assert report.forwarded["node-b"] == await _count(url, fleet.instance("node-b"))
                assert report.dropped["unknown_target"] == published_by_x > 0
                assert set(report.forwarded) == {"node-a", "node-b"}

            letters = await _dead_letters(engine)
            assert sorted(letters) == ["forged", "unknown_target"], "one each, not per scrape"
            forged = letters["forged"]
            assert forged["subject"] == f"scrape:{fleet.instance('node-a')}"
            detail = json.loads(forged["payload"])
            assert (detail["node"], detail["claim"], detail["series"]) == (
                "node-a",
                "node-b",
                published_by_a // 2,
            )
            unknown = json.loads(letters["unknown_target"]["payload"])
            assert (unknown["target"], unknown["node"]) == (fleet.instance("node-x"), None)

            logged = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
            assert len(logged) == 1 and fleet.instance("node-a") in logged[0]
            dropped = {
                s.labels["reason"]: s.value
                for f in prom.metrics.dropped.collect()
                for s in f.samples
                if s.name.endswith("_total")
            }
            assert dropped["forged"] == 2 * (published_by_a // 2)


async def _watch(bus: Bus, verifier: Verifier) -> tuple[list[dict[str, Any]], list[str]]:
    """Every event and sample published from now on, as the engine would read them, and
    who published each (the engine's check of its MAC: EventError if forged)."""
    seen: list[dict[str, Any]] = []
    signers: list[str] = []
    read = AsEvents()  # telemetry v2, as the source sends it, joined to its keyframes

    async def keep(msg: Any) -> None:
        kind, node = subjects.parse_event(msg.subject)
        try:
            signers.append(verifier.publisher(msg.headers, msg.data, kind, node))
        except EventError as exc:
            signers.append(f"forged: {exc}")
        seen.append(read(msg.data))

    await bus.nc.subscribe("gpuops.events.>", cb=keep)
    await bus.nc.subscribe("gpuops.telemetry.>", cb=keep)
    return seen, signers


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


async def _dead_letters(bus: Bus) -> dict[str, dict[str, Any]]:
    """The stored dead letters by reason (each reason's last; the count must be one each)."""
    info = await bus.js.stream_info(DLQ)
    out: dict[str, dict[str, Any]] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        letter = json.loads((await bus.js.get_msg(DLQ, seq)).data)
        assert letter["reason"] not in out, f"a second {letter['reason']} dead letter"
        out[letter["reason"]] = letter
    return out
