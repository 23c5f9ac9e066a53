"""An engine on the simulated fleet serving the console, and a headless Chromium driving it.

The engine runs in a thread with its own event loop for the whole module (starting one
per test would cost more than the tests); the tests are plain functions that drive the
browser and hand coroutines to that loop (`LiveEngine.call`).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
from gpuops import subjects
from gpuops.bus.conn import Bus, connect
from gpuops.bus.identity import ENGINE, ENGINE_ONLY_KINDS
from gpuops.bus.server import EmbeddedNats
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App

from tests.conftest import engine_settings, running_engine, wait_for
from tests.support import as_node

T = TypeVar("T")
TOKEN = "console-test-token-0123456789"
# The flags the issue names: no GPU, no sandbox (root in CI), nothing fetched from outside.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
GRANTED = {"users": ["console:alice"]}


class LiveEngine:
    """A running engine (embedded nats-server, sim fleet, HTTP with the console)."""

    def __init__(self, root: Path, nodes: int = 4, gpus: int = 8) -> None:
        self.root = root
        self.fleet = SimFleet.create(root / "sim", nodes=nodes, gpus=gpus)
        self.nats = EmbeddedNats(root / "nats").start()
        self.loop = asyncio.new_event_loop()
        self.ready: Future[None] = Future()
        self._stop: asyncio.Event | None = None
        self.app: App | None = None
        self.bus: Bus | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),))

    @property
    def url(self) -> str:
        """The console's base URL."""
        assert self.app is not None
        return f"http://127.0.0.1:{self.app.http_port}"

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        settings = engine_settings(
            self.root,
            self.fleet,
            self.nats.url,
            http="127.0.0.1:0",
            console={"tokens": [{"user": "alice", "token": TOKEN}], "push_s": 0.5},
            chatops={"permissions": {c: GRANTED for c in ("approve", "deny", "silence")}},
        )
        try:
            self.bus = await connect(self.nats.url, NatsSettings())
            async with running_engine(settings, self.bus) as app:
                await wait_for(lambda: app.http_port, 30)
                self.app = app
                self.ready.set_result(None)
                await self._stop.wait()
            await self.bus.close()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc)
            raise

    def start(self) -> LiveEngine:
        """Start the thread; return once the console answers."""
        self.thread.start()
        self.ready.result(timeout=120)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def publish(self, event: dict[str, Any]) -> None:
        """Publish an event as its sender would: the node's agent, signed with its key;
        a drift report or an alert, as the engine's drift check or receiver."""
        assert self.bus is not None and self.app is not None
        subject = subjects.event(event["kind"], event["node"])
        data = json.dumps(event).encode()
        headers = as_node(self.app.keys, subject, data, event["id"])
        if event["kind"] in ENGINE_ONLY_KINDS:
            headers = self.app.keys.signer(ENGINE).headers(data, {"Nats-Msg-Id": event["id"]})
        await self.bus.js.publish(subject, data, headers=headers)

    def stop(self) -> None:
        """Stop the engine, its thread and the nats-server."""
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(60)
        self.loop.close()
        self.nats.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveEngine]:
    """One engine for the module's tests."""
    engine = LiveEngine(tmp_path_factory.mktemp("console")).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless Chromium through chromedriver, with a fresh profile."""
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        pytest.skip(
            "chromium and chromedriver are not installed (scripts/ci-setup.sh installs them)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a dev extra")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.add_argument("--window-size=1400,1000")
    driver = webdriver.Chrome(service=webdriver.ChromeService(driver_bin), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def shot(driver: Any, path: Path) -> Path:
    """Save a screenshot and say where (the issue asks for them)."""
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path
