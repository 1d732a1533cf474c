"""The fault proxy itself, against a local echo server (TCP and unix socket):
each fault does what the fault tests rely on. No timing is asserted: a delay is
checked by order and content, silence by a bounded wait that must not see data."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetlease.ops.testing.faultproxy import FaultProxy

SILENCE_S = 0.5  # how long "nothing arrives" is watched for


class Echo:
    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.closed_by_peer = asyncio.Event()
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            self.closed_by_peer.set()
            writer.close()


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    e = Echo()
    e.server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
    e.port = e.server.sockets[0].getsockname()[1]
    try:
        yield e
    finally:
        e.server.close()


@pytest.fixture
async def proxy(echo: Echo) -> AsyncIterator[FaultProxy]:
    p = await FaultProxy(("127.0.0.1", echo.port), seed=1).start()
    try:
        yield p
    finally:
        await p.stop()


async def _open(p: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def _roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 30)


async def test_bytes_pass_through_unchanged_both_ways(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    payload = bytes(range(256)) * 1000
    assert await _roundtrip(reader, writer, payload) == payload
    writer.close()
    assert proxy.stats.bytes_up >= len(payload) and proxy.stats.bytes_down >= len(payload)


async def test_a_unix_socket_upstream_is_reached_over_tcp(tmp_path: Path) -> None:
    e = Echo()
    path = tmp_path / "echo.sock"
    server = await asyncio.start_unix_server(e.handle, str(path))
    try:
        async with FaultProxy(path) as p:
            reader, writer = await _open(p)
            assert await _roundtrip(reader, writer, b"hello") == b"hello"
            writer.close()
    finally:
        server.close()


async def test_latency_with_jitter_keeps_byte_order(proxy: FaultProxy) -> None:
    proxy.latency(0.02, 0.02)
    reader, writer = await _open(proxy)
    for i in range(50):
        writer.write(f"{i:04d}".encode())
        await asyncio.sleep(0)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(200), 30)
    assert got == b"".join(f"{i:04d}".encode() for i in range(50))
    writer.close()


async def test_bandwidth_limit_delivers_everything(proxy: FaultProxy) -> None:
    proxy.bandwidth(400_000)
    reader, writer = await _open(proxy)
    payload = b"x" * 200_000
    assert await _roundtrip(reader, writer, payload) == payload
    writer.close()


async def test_blackhole_holds_bytes_until_healed_and_closes_nothing(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"before") == b"before"
    proxy.blackhole()
    writer.write(b"during")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), SILENCE_S)
    # A new connection is accepted but goes nowhere.
    r2, w2 = await _open(proxy)
    w2.write(b"new")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(r2.read(1), SILENCE_S)
    proxy.heal()
    assert await asyncio.wait_for(reader.readexactly(6), 30) == b"during"
    assert await asyncio.wait_for(r2.readexactly(3), 30) == b"new"
    writer.close()
    w2.close()


async def test_reset_breaks_every_open_connection(proxy: FaultProxy, echo: Echo) -> None:
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"x") == b"x"
    proxy.reset()
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(1), 30) == b""
    await asyncio.wait_for(echo.closed_by_peer.wait(), 30)
    assert proxy.stats.resets == 1
    # New connections still work.
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"y") == b"y"
    writer.close()


async def test_refuse_resets_new_connections_until_healed(proxy: FaultProxy) -> None:
    proxy.refuse()
    reader, writer = await _open(proxy)
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(1), 30) == b""
    assert proxy.stats.refused == 1
    proxy.heal()
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"ok") == b"ok"
    writer.close()


async def test_half_open_closes_the_upstream_while_the_client_hears_nothing(
    proxy: FaultProxy, echo: Echo
) -> None:
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"x") == b"x"
    proxy.half_open()
    await asyncio.wait_for(echo.closed_by_peer.wait(), 30)
    writer.write(b"into the void")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), SILENCE_S)
    assert not reader.at_eof()
    proxy.heal()
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(1), 30) == b""
