"""The engine's HTTP server against clients that hold connections (slowloris), over real
sockets on loopback: a request's headers, and then its body, must come within
`read_timeout_s`, and past `max_connections` a new connection is answered 503 and closed
at once, while an ordinary request is served as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from gpuops.http import HttpServer
from gpuops.settings import HttpLimits, Settings
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.integration
TIMEOUT_S = 1.0
CAP = 4


def _routes(app: web.Application) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    async def slow(request: web.Request) -> web.Response:
        body = await request.read()
        await asyncio.sleep(TIMEOUT_S * 1.5)  # the handler's own time is not bounded
        return web.Response(body=body)

    app.add_routes([web.post("/echo", echo), web.post("/slow", slow)])


@pytest.fixture
async def port() -> AsyncIterator[int]:
    limits = HttpLimits(read_timeout_s=TIMEOUT_S, max_connections=CAP)
    server = HttpServer(CollectorRegistry(), lambda: (True, {}), [_routes], limits)
    bound = await server.start("127.0.0.1:0")
    try:
        yield bound
    finally:
        await server.stop()


async def _closed_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    """Trickle a header line every 0.1 s until the server closes; seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < 5 * TIMEOUT_S:
        try:
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
            if await asyncio.wait_for(reader.read(1024), 0.1) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - started
    raise AssertionError("the server kept a trickling connection open")


async def _trickling(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()
    return reader, writer


async def _get(port: int, path: str = "/healthz") -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}{path}") as r:
        return r.status, await r.text()


async def test_a_client_trickling_its_headers_is_closed_after_the_read_timeout(
    port: int,
) -> None:
    reader, writer = await _trickling(port)
    took = await _closed_after(reader, writer)
    writer.close()
    assert TIMEOUT_S * 0.8 <= took <= TIMEOUT_S * 2.5, took


async def test_a_client_trickling_its_body_is_closed_after_the_read_timeout(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    started = time.monotonic()
    answer = b"x"
    while answer and time.monotonic() - started < 5 * TIMEOUT_S:
        try:
            writer.write(b"a")  # a byte of the body every 0.1 s
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(1024), 0.1)
        except TimeoutError:
            continue
        except ConnectionError:
            break
    took = time.monotonic() - started
    writer.close()
    assert b"HTTP/1.1 200" not in answer
    assert TIMEOUT_S * 0.8 <= took <= TIMEOUT_S * 2.5, took


async def test_past_the_cap_a_connection_is_refused_and_served_once_the_slow_ones_go(
    port: int,
) -> None:
    slow = [await _trickling(port) for _ in range(CAP)]
    await asyncio.sleep(0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = await asyncio.wait_for(reader.read(), 1.0)  # up to EOF: closed at once
    writer.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer
    for r, w in slow:  # the read timeout drops them
        await _closed_after(r, w)
        w.close()
    assert await _get(port) == (200, '{"status": "ok"}')
    status, metrics = await _get(port, "/metrics")
    assert status == 200 and "gpuops_http_connections_refused_total 1.0" in metrics


async def test_ordinary_requests_are_served_within_and_past_the_read_timeout(port: int) -> None:
    async with aiohttp.ClientSession() as http:  # one kept-alive connection for all
        url = f"http://127.0.0.1:{port}"
        for _ in range(CAP + 2):  # more requests than the cap, on one connection
            async with http.get(f"{url}/healthz") as r:
                assert r.status == 200
        async with http.post(f"{url}/echo", data=b"x" * 60_000) as r:
            assert r.status == 200 and len(await r.read()) == 60_000
        # A handler that takes longer than the timeout once its body is in is not cut.
        async with http.post(f"{url}/slow", data=b"hello") as r:
            assert r.status == 200 and await r.read() == b"hello"


def test_the_limits_are_settings_with_defaults() -> None:
    limits = Settings().http_limits
    assert (limits.read_timeout_s, limits.max_connections) == (15.0, 256)
    over = Settings.model_validate({"http_limits": {"read_timeout_s": 5, "max_connections": 8}})
    assert over.http_limits == HttpLimits(read_timeout_s=5, max_connections=8)
