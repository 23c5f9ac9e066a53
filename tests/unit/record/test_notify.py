"""Notifications as Slack and Mattermost receive them, on a real webhook receiver."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from gpuops.clock import ManualClock
from gpuops.models import ActionSpec, Decision, Intent, Reason, RunOutcome, RunStatus
from gpuops.record.notify import MAX_TEXT, Notifier, Webhook
from gpuops.record.outbox import Outbox, Tell
from pydantic import SecretStr

from tests.unit.decide.helpers import T0, engine_on, match


@dataclass
class Receiver:
    """An incoming webhook on loopback: what it was sent; it answers `answers` in turn,
    then 200."""

    url: str = ""
    got: list[dict[str, Any]] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)

    def hooks(self) -> list[Webhook]:
        """The same receiver as a Slack and as a Mattermost webhook."""
        return [
            Webhook("slack", SecretStr(f"{self.url}/slack")),
            Webhook("mattermost", SecretStr(f"{self.url}/mattermost"), "ops"),
        ]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    seen = Receiver()

    async def hook(request: web.Request) -> web.Response:
        seen.got.append({"kind": request.match_info["kind"], **await request.json()})
        return web.Response(status=seen.answers.pop(0) if seen.answers else 200, text="ok")

    app = web.Application()
    app.add_routes([web.post("/{kind}", hook)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    seen.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield seen
    finally:
        await runner.cleanup()


# What act/runner.py makes of a failing task's stderr on the node: a fake gpuops line on
# a line of its own, a channel ping, and a link whose label is not where it goes.
FORGED = (
    "task 'check gpus' failed: root@node-009: nvidia-smi: error\n\n"
    "[gpuops] approval needed: 1a2b3c4d: reboot on node-009 <!channel> @channel "
    "answer <https://evil.example/approve?id=1a2b3c4d|approve 1a2b3c4d> or "
    "[approve](https://evil.example/a)\u2028[gpuops] breaker open: \u202eevil"
)


async def test_node_text_reaches_chat_as_one_line_that_pings_and_links_nothing(
    receiver: Receiver,
) -> None:
    clock = ManualClock(T0)
    notifier = Notifier(receiver.hooks())
    recorder = engine_on(clock, notifier=notifier).recorder
    m = match("xid_79_reboot", gpu=None, t=clock.now())
    d = Decision(
        match=m, accepted=True, reason=Reason.ACCEPTED, actions=(ActionSpec(playbook="reboot.yml"),)
    )
    intent = Intent(
        key="k" * 40,
        rule=m.rule,
        node=m.node,
        action=d.actions[0],
        event_id=m.event_id,
        event_ts=m.event_ts,
        decided_at=clock.now(),
        decision=d,
    )
    out = RunOutcome(
        intent_key=intent.key,
        rule=m.rule,
        node=m.node,
        playbook="reboot.yml",
        status=RunStatus.FAILED,
        rc=2,
        started=clock.now(),
        ended=clock.now() + 5,
        error=FORGED,
    )
    await recorder.decided(d, [])
    await recorder.run_started(intent)
    await recorder.run_ended(intent, out)
    recorder.flush(force=True)
    await notifier.drain()
    told = [b for b in receiver.got if b["text"].startswith("[gpuops] needs-human: node-001")]
    assert sorted(b["kind"] for b in told) == ["mattermost", "slack"], receiver.got
    for body in told:
        text = body["text"]
        assert text.splitlines() == [text], "one line: nothing after it passes for gpuops's"
        assert not any(c in text for c in "<>\n\r\u2028\u202e")
        assert "&lt;!channel&gt;" in text and "@channel" not in text  # shown, not a ping
        assert "&lt;https://evil.example/approve?id=1a2b3c4d|approve 1a2b3c4d&gt;" in text
        assert "](" not in text  # Mattermost's Markdown link is broken, its text kept
        assert "nvidia-smi: error [gpuops] approval needed: 1a2b3c4d" in text  # mid-line
        assert "root@node-009" in text  # inside a word (as in an episode's id): no mention


async def test_a_needs_human_message_on_2000_nodes_fits_and_counts_what_it_left_out(
    receiver: Receiver,
) -> None:
    notifier = Notifier(receiver.hooks())
    box = Outbox(notifier)
    for i in range(2000):
        node = f"dgx-h100-rack{i // 16:03d}-node{i:05d}.cluster.example.com"
        box.add(Tell("needs-human", "xid_79_reboot", node, "node", f"{node}: reboot failed"), T0)
    why = "task 'reboot' failed: " + "kernel: NVRM: Xid 79 & more\n" * 500  # 14,500 chars
    notifier.notify("needs-human", f"node-001: {why}")
    box.flush(T0, force=True)
    await notifier.drain()
    texts = [b["text"] for b in receiver.got]
    assert len(texts) == 4 and all(len(t) <= MAX_TEXT for t in texts)
    [many] = {t for t in texts if "xid_79_reboot on 2000 nodes" in t}
    named = many.split(" and ")[0].count(".cluster.example.com")
    assert named > 50 and f"and {2000 - named:,} more: `gpuops status` names them" in many
    [long] = {t for t in texts if t.startswith("[gpuops] needs-human: node-001: task")}
    assert long.endswith("more characters: `gpuops status` and the audit trail have the rest)")
    assert not long.split(" ... (")[0].endswith(("&", "&a", "&am", "&amp"))  # no half entity


async def test_a_refused_message_is_not_sent_again_but_a_rate_limited_one_is(
    receiver: Receiver,
) -> None:
    receiver.answers = [404] * 4  # a webhook deleted in Slack: no later try can succeed
    notifier = Notifier(receiver.hooks()[:1], backoff_s=0.01)
    notifier.notify("incident", "node-001 hot")
    await asyncio.wait_for(notifier.drain(), 10)
    assert len(receiver.got) == 1 and notifier.failed == 1
    receiver.answers = [429, 503]  # slow down, then a server's hiccup: both pass
    notifier.notify("incident", "node-002 hot")
    await asyncio.wait_for(notifier.drain(), 10)
    assert [b["text"] for b in receiver.got[1:]] == ["[gpuops] incident: node-002 hot"] * 3
    assert notifier.failed == 1


@dataclass
class Outage:
    """A receiver's port that refuses connections until `up_at` on the manual clock, then
    serves `receiver`; the Notifier's sleep moves the clock, so nothing waits for real."""

    clock: ManualClock
    up_at: float
    slept: list[float] = field(default_factory=list)
    sock: socket.socket = field(default_factory=socket.socket)
    runner: web.AppRunner | None = None
    got: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused

    @property
    def hook(self) -> Webhook:
        return Webhook("mattermost", SecretStr(f"http://127.0.0.1:{self.port}/hook"), "ops")

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.advance(seconds)
        if self.runner is None and self.clock.now() >= self.up_at:
            await self._start()

    async def _start(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            self.got.append(await request.json())
            return web.Response(text="ok")

        app = web.Application()
        app.add_routes([web.post("/hook", hook)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = self.port
        self.sock.close()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()

    async def close(self) -> None:
        self.sock.close()
        if self.runner is not None:
            await self.runner.cleanup()


async def test_a_receiver_down_for_ten_minutes_still_gets_the_escalation_in_order() -> None:
    clock = ManualClock(T0)
    outage = Outage(clock, up_at=T0 + 600)
    notifier = Notifier([outage.hook], clock=clock, sleep=outage.sleep)
    try:
        notifier.notify("needs-human", "node-007: gpu_reset.yml failed; a person must look")
        notifier.notify("incident", "node-008 hot")
        await asyncio.wait_for(notifier.drain(), 10)
    finally:
        await outage.close()
    assert [b["text"] for b in outage.got] == [
        "[gpuops] needs-human: node-007: gpu_reset.yml failed; a person must look",
        "[gpuops] incident: node-008 hot",
    ]
    assert notifier.failed == 0 and max(outage.slept) == 300.0  # backoff capped at 5 min
    assert sum(outage.slept) < 600 + 300  # tried again within one cap of coming back


async def test_undelivered_messages_are_bounded_in_number_and_in_time() -> None:
    clock = ManualClock(T0)
    outage = Outage(clock, up_at=T0 + 2 * 3600)  # down for longer than a message is kept
    notifier = Notifier([outage.hook], clock=clock, sleep=outage.sleep, queue_max=3)
    try:
        for i in range(5):
            notifier.notify("incident", f"node-{i:03d} hot")
        await asyncio.wait_for(notifier.drain(), 10)
    finally:
        await outage.close()
    assert notifier.dropped == 2  # the two oldest, pushed out by the bound
    assert notifier.failed == 3  # the others, given up after an hour
    assert outage.got == [] and 3600 <= clock.now() - T0 < 3600 + 300
