"""The console in a real browser against a running engine on the simulated fleet."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from gpuops.act.evidence import Evidence
from gpuops.clock import SystemClock
from gpuops.console import Console, Latest
from gpuops.http import HttpServer
from gpuops.inventory.hosts import Inventory
from gpuops.models import EVENT_ADAPTER, RunOutcome
from gpuops.record.approvals import ApprovalStatus
from gpuops.record.audit import read_audit
from gpuops.settings import ConsoleSettings
from gpuops.sim.fleet import envelope
from prometheus_client import CollectorRegistry

from tests.browser.conftest import TOKEN, LiveEngine, shot

pytestmark = [pytest.mark.browser, pytest.mark.integration]
HOT_NODE, HOT_GPU = "node-001", 3
HOT_RGB = (215, 25, 28)


def _wait(predicate: Any, limit_s: float, what: str) -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (StaleElementReferenceException, NoSuchElementException):
            # The page is navigating (a login's redirect): an element found a moment ago is
            # gone, or the next document has no body yet. Ask again once it has loaded.
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {limit_s}s: {what}")


def _pixel(driver: Any, node: str, gpu: int) -> tuple[int, int, int]:
    rgb = driver.execute_script(
        "const [x, y] = window.gpuopsFleet.centre(arguments[0], arguments[1]);"
        "const d = document.getElementById('heat').getContext('2d').getImageData(x, y, 1, 1).data;"
        "return [d[0], d[1], d[2]];",
        node,
        gpu,
    )
    return (int(rgb[0]), int(rgb[1]), int(rgb[2]))


def _message(driver: Any) -> str:
    """The answer the page shows after an action; empty while there is none."""
    found = driver.find_elements("id", "message")
    try:
        return str(found[0].text) if found else ""
    except Exception:  # the page reloaded while it was read: ask again
        return ""


async def _approved_by(live: LiveEngine, node: str) -> str:
    assert live.app is not None
    done = [a for a in await live.app.engine.approvals.all() if a.node == node]
    answered = (ApprovalStatus.APPROVED, ApprovalStatus.EXECUTED)
    return done[0].by if done and done[0].status in answered else ""


def _answer(driver: Any, node: str, tmp_path: Path) -> bool:
    """Fill in and approve the node's approval card; False to try again (none yet, or the
    page reloaded itself under the test because a count changed)."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        cards = driver.find_elements("css selector", ".approval")
        if not cards:
            driver.refresh()
            return False
        assert node in cards[0].text and "drift-needs-approval" in cards[0].text
        cards[0].find_element("name", "reason").send_keys("ECC back on, node idle")
        shot(driver, tmp_path / "approval.png")
        cards[0].find_element("css selector", "button.approve").click()
    except StaleElementReferenceException:
        return False
    return True


async def _overheat(live: LiveEngine) -> None:
    """Seventy seconds of samples, ending now: node-001's GPU 3 at 88 C (slowdown 89)."""
    now = time.time()
    for second in range(-70, 1, 5):
        for node in live.fleet.nodes:
            event = live.fleet.telemetry(node, now + second)
            assert event is not None
            if node == HOT_NODE:
                event["data"]["gpus"][HOT_GPU]["temp_c"] = 88.0
            await live.publish(event)


async def _runs(live: LiveEngine, node: str) -> list[RunOutcome]:
    assert live.bus is not None
    return [
        RunOutcome.model_validate(r.body)
        async for r in read_audit(live.bus.js, node)
        if r.type == "run"
    ]


def _ready(driver: Any) -> bool:
    return bool(driver.execute_script("return document.getElementById('heat').dataset.ready"))


def test_heatmap_shows_the_overheating_gpu_in_the_hot_colour(
    live: LiveEngine, browser: Any, tmp_path: Path
) -> None:
    live.call(_overheat(live))
    browser.get(f"{live.url}/console/fleet?by=temp")
    _wait(lambda: _ready(browser), 30, "the heatmap drew")
    hot = _wait(
        lambda: browser.execute_script("return document.getElementById('heat').dataset.hot"),
        30,
        "a hot cell",
    )
    assert hot.split(",") == [f"{HOT_NODE}/{HOT_GPU}"]
    assert _pixel(browser, HOT_NODE, HOT_GPU) == HOT_RGB
    cool = _pixel(browser, "node-002", HOT_GPU)
    assert cool != HOT_RGB and cool[1] > cool[0], f"an idle GPU is drawn green-ish, not {cool}"
    cells = browser.execute_script("return document.getElementById('heat').dataset.cells")
    assert int(cells) == len(live.fleet.nodes) * 8
    shot(browser, tmp_path / "fleet.png")
    # A new sample reaches the open page through the event stream, without a reload.
    browser.execute_script("document.getElementById('heat').dataset.loaded = 'first'")
    event = live.fleet.telemetry("node-002", time.time())
    assert event is not None
    event["data"]["gpus"][5]["temp_c"] = 95.0
    live.call(live.publish(event))
    _wait(
        lambda: (
            "node-002/5"
            in browser.execute_script("return document.getElementById('heat').dataset.hot")
        ),
        30,
        "the live update drew node-002/5 hot",
    )
    loaded = browser.execute_script("return document.getElementById('heat').dataset.loaded")
    assert loaded == "first", "the page was not reloaded"


def test_node_page_shows_the_timeline_of_a_remediation(
    live: LiveEngine, browser: Any, tmp_path: Path
) -> None:
    live.call(_overheat(live))  # idempotent for the engine: one episode, one drain
    runs = _wait(lambda: live.call(_runs(live, HOT_NODE)), 90, "the drain ran")
    assert runs[0].playbook == "drain.yml" and runs[0].run_id
    browser.get(f"{live.url}/console/node/{HOT_NODE}")
    entries = browser.find_elements("css selector", "#timeline li.entry")
    kinds = [(e.get_attribute("data-kind"), e.get_attribute("data-rule")) for e in entries]
    assert ("fault", "gpu-overheat") in kinds, kinds
    assert ("run", "gpu-overheat") in kinds, kinds
    run = next(e for e in entries if e.get_attribute("data-kind") == "run")
    assert "drain.yml successful" in run.text and "playbook revision" in run.text
    state = browser.find_element("id", "state").text
    assert state in ("needs_human", "quarantined", "remediating"), state
    _wait(
        lambda: browser.execute_script("return document.getElementById('charts').dataset.charts"),
        30,
        "the GPU charts drew",
    )
    shot(browser, tmp_path / "node.png")
    browser.execute_script("document.getElementById('timeline').scrollIntoView()")
    shot(browser, tmp_path / "node-timeline.png")
    link = run.find_element("css selector", "a.run-link")
    assert link.get_attribute("href").endswith(f"/console/runs/{runs[0].run_id}")
    link.click()
    # A run's output can show host variables: read-only visitors are sent to log in first.
    _wait(lambda: "/console/login" in browser.current_url, 20, "asked to log in")
    # The address changes before the login page has loaded: wait for its form.
    _wait(lambda: browser.find_element("id", "token"), 20, "the login form").send_keys(TOKEN)
    browser.find_element("id", "login").click()
    _wait(lambda: "PLAY [" in browser.find_element("tag name", "body").text, 20, "the output")


def test_approving_in_the_page_runs_the_playbook(
    live: LiveEngine, browser: Any, tmp_path: Path
) -> None:
    node = "node-003"
    live.fleet.inject(node, "drift", 0, setting="ecc_mode", value=False)
    drift = {"setting": "ecc_mode", "expected": True, "actual": False, "gpu": 0}
    live.call(live.publish(envelope("drift", node, time.time(), drift)))
    browser.get(f"{live.url}/console/login?next=/console/now")
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("id", "login").click()
    _wait(lambda: browser.current_url.endswith("/console/now"), 20, "logged in")

    def answered() -> bool:
        # A click that lands while a live update reloads the page is lost: answer again
        # (the card is still there) until the engine has the approval.
        if live.call(_approved_by(live, node)) == "console:alice":
            return True
        if _answer(browser, node, tmp_path):
            _wait(lambda: "/console/now" in browser.current_url, 10, "the form posted")
            time.sleep(1.0)
        return False

    _wait(answered, 60, "the approval answered by alice in the page")
    shown = _message(browser)
    assert shown == "" or shown.startswith("approved "), shown
    runs = _wait(lambda: live.call(_runs(live, node)), 90, "baseline.yml ran")
    assert [(r.playbook, r.status) for r in runs] == [("baseline.yml", "successful")]
    assert live.fleet.state(node)["gpus"][0]["ecc_mode"] is True


BIG_NODES, BIG_HOT = 1250, ("gpu-00777", 5)


async def _big_console(live: LiveEngine) -> tuple[HttpServer, int]:
    """A second console on the same bus over 1,250 nodes x 8 GPUs, each with a sample
    (the simulator's H200 sample, temperatures spread below the threshold, one above)."""
    assert live.app is not None
    names = [f"gpu-{i:05d}" for i in range(BIG_NODES)]
    half = len(names) // 2
    groups = {"rack-a": frozenset(names[:half]), "rack-b": frozenset(names[half:])}
    inventory = Inventory(live.root / "big", frozenset(names), groups, {})
    latest = Latest(inventory)
    template = live.fleet.telemetry("node-002", time.time())
    assert template is not None
    for i, name in enumerate(names):
        event = {**template, "id": f"big-{i}", "node": name}
        gpus = [{**g, "temp_c": 30.0 + (i * 8 + g["index"]) % 50} for g in template["data"]["gpus"]]
        if name == BIG_HOT[0]:
            gpus[BIG_HOT[1]]["temp_c"] = 95.0
        event["data"] = {"gpus": gpus}
        latest.observe(EVENT_ADAPTER.validate_python(event))
    registry = CollectorRegistry()  # the engine's already has its console's counters
    console = Console(
        live.app.commands(),
        ConsoleSettings(),
        latest,
        Evidence(live.root / "r"),
        bind="127.0.0.1:0",
        clock=SystemClock(),
        registry=registry,
        rules=lambda: live.app.rules,  # the heatmap's "at threshold" is the overheat rule's
    )
    server = HttpServer(registry, lambda: (True, {}), [console.mount])
    return server, await server.start("127.0.0.1:0")


def test_ten_thousand_gpus_render_on_one_canvas(
    live: LiveEngine, browser: Any, tmp_path: Path
) -> None:
    server, port = live.call(_big_console(live))
    try:
        started = time.monotonic()
        browser.get(f"http://127.0.0.1:{port}/console/fleet?by=temp")
        _wait(lambda: _ready(browser), 60, "10,000 GPUs drawn")
        wall_ms = (time.monotonic() - started) * 1000
        heat = browser.find_element("id", "heat")
        assert int(heat.get_attribute("data-cells")) == BIG_NODES * 8
        assert heat.get_attribute("data-hot") == "/".join(map(str, BIG_HOT))
        assert _pixel(browser, *BIG_HOT) == HOT_RGB
        assert _pixel(browser, BIG_HOT[0], 0) != HOT_RGB
        drawn = float(heat.get_attribute("data-drawn-ms"))
        print(f"10,000 GPUs: page load to first draw {wall_ms:.0f} ms (script {drawn:.0f} ms)")
        shot(browser, tmp_path / "fleet-10000.png")
        browser.get(f"http://127.0.0.1:{port}/console/fleet?group=rack-b")
        _wait(lambda: _ready(browser), 60, "rack-b drawn")
        heat = browser.find_element("id", "heat")
        assert int(heat.get_attribute("data-cells")) == BIG_NODES // 2 * 8
        assert heat.get_attribute("data-hot") == "/".join(map(str, BIG_HOT))
    finally:
        live.call(server.stop())
