"""A small fault-injecting TCP proxy (toxiproxy is not installable here) for the
fault suite and ``fleetlease soak``: it sits between agents and NATS and between
the control plane and PostgreSQL.

It listens on ``127.0.0.1:<port>`` and forwards every connection to a TCP
address or to a unix socket (the embedded PostgreSQL listens on one only).
Faults, each switchable at any time, for every open and future connection:

- ``latency(delay_s, jitter_s)``: every chunk is delivered ``delay_s`` (plus or
  minus up to ``jitter_s``) after it was read; the byte order is kept.
- ``bandwidth(bytes_per_s)``: each direction of each connection is paced.
- ``blackhole()``: nothing is delivered in either direction and new connections
  are not passed on, but nothing is closed either: the peers see silence, as
  behind a cut cable. Bytes are held (TCP would retransmit them) and delivered
  on ``heal()``; a peer that gives up closes its own side. Readers stop reading
  once a direction holds ``MAX_HELD_BYTES`` (backpressure, bounded memory).
- ``half_open()``: the upstream side of every open connection is closed, the
  client side stays open without a FIN, its bytes swallowed: the client believes
  it is connected to a server that is gone. ``heal()`` resets those clients.
- ``reset()``: every open connection is reset (RST) now, once.
- ``refuse()``: new connections are reset as soon as they are accepted.

``heal()`` clears every fault. The proxy counts connections, bytes and faults in
``stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("fleetlease.faultproxy")

CHUNK = 64 * 1024
MAX_HELD_BYTES = 1024 * 1024
_SLICE = 16 * 1024

Upstream = tuple[str, int] | str | Path


@dataclass
class ProxyStats:
    connections: int = 0
    refused: int = 0
    resets: int = 0
    half_opened: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    #: Set by half_open(): the upstream is gone, the client must not learn it.
    frozen: bool = False
    #: A direction failed (reset, broken pipe): the other side is reset too.
    failed: bool = False
    ended: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def pipe_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            self.failed = True
            self.done.set()
            return
        self.ended += 1
        if self.ended == 2:
            self.done.set()

    def abort(self) -> None:
        for w in (self.client, self.upstream):
            if w is not None:
                _rst(w)
        self.done.set()


class FaultProxy:
    """See the module docstring. ``await FaultProxy(upstream).start()``; the
    listening port is ``port`` (``url_host`` is ``127.0.0.1:<port>``)."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        port: int = 0,
        seed: int | None = None,
        name: str = "proxy",
    ) -> None:
        if isinstance(upstream, tuple):
            host, up_port = upstream
            if not host or not isinstance(up_port, int) or not 0 < up_port < 65536:
                raise ValueError(f"upstream must be (host, port) or a unix socket path: {upstream}")
        elif not str(upstream):
            raise ValueError("upstream must be (host, port) or a unix socket path")
        self.upstream = upstream
        self.name = name
        self.port = port
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False
        self._delay_s = 0.0
        self._jitter_s = 0.0
        self._bytes_per_s: float | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info(
            "fault_proxy_started", proxy=self.name, port=self.port, upstream=str(self.upstream)
        )
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        # Connection handlers end by themselves once their connection is aborted
        # (cancelling a start_server handler makes asyncio log an error).
        self._closing = True
        for conn in list(self._conns):
            conn.abort()
        self._flowing.set()
        handlers = list(self._handlers)
        if handlers:
            await asyncio.wait(handlers, timeout=5)
        tasks = list(self._tasks) + [h for h in handlers if not h.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- faults ---------------------------------------------------------------------------
    def latency(self, delay_s: float, jitter_s: float = 0.0) -> None:
        if delay_s < 0 or jitter_s < 0:
            raise ValueError("delay_s and jitter_s must be >= 0")
        self._delay_s, self._jitter_s = delay_s, jitter_s
        log.info("fault_proxy_latency", proxy=self.name, delay_s=delay_s, jitter_s=jitter_s)

    def bandwidth(self, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive (or None for no limit)")
        self._bytes_per_s = bytes_per_s
        log.info("fault_proxy_bandwidth", proxy=self.name, bytes_per_s=bytes_per_s)

    def blackhole(self) -> None:
        self._flowing.clear()
        log.info("fault_proxy_blackhole", proxy=self.name, connections=len(self._conns))

    def half_open(self) -> None:
        for conn in list(self._conns):
            if conn.frozen:
                continue
            conn.frozen = True
            self.stats.half_opened += 1
            if conn.upstream is not None:
                _rst(conn.upstream)
        log.info("fault_proxy_half_open", proxy=self.name, connections=len(self._conns))

    def reset(self) -> None:
        n = 0
        for conn in list(self._conns):
            conn.abort()
            n += 1
        self.stats.resets += n
        log.info("fault_proxy_reset", proxy=self.name, connections=n)

    def refuse(self) -> None:
        self._refusing = True
        log.info("fault_proxy_refuse", proxy=self.name)

    def heal(self) -> None:
        """Clear every fault: deliver what the blackhole held, reset half-open
        clients, accept connections again, no latency or bandwidth limit."""
        self._refusing = False
        self._delay_s = self._jitter_s = 0.0
        self._bytes_per_s = None
        for conn in list(self._conns):
            if conn.frozen:
                conn.abort()
        self._flowing.set()
        log.info("fault_proxy_healed", proxy=self.name)

    @property
    def connections(self) -> int:
        return len(self._conns)

    # --- forwarding -----------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if isinstance(self.upstream, tuple):
            return await asyncio.open_connection(*self.upstream)
        return await asyncio.open_unix_connection(str(self.upstream))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        if self._refusing or self._closing:
            self.stats.refused += 1
            _rst(writer)
            return
        conn = _Conn(client=writer)
        self._conns.add(conn)
        self.stats.connections += 1
        try:
            # Behind a blackhole the connection goes nowhere until it heals.
            await self._flowing.wait()
            if conn.done.is_set() or self._closing:
                return
            try:
                up_reader, up_writer = await self._open_upstream()
            except OSError:
                _rst(writer)
                return
            conn.upstream = up_writer
            if conn.done.is_set():  # reset while connecting
                _rst(up_writer)
                return
            pipes = [
                self._spawn(self._pipe(conn, reader, up_writer, up=True)),
                self._spawn(self._pipe(conn, up_reader, writer, up=False)),
            ]
            for p in pipes:
                p.add_done_callback(conn.pipe_ended)
            await conn.done.wait()
            for p in pipes:
                p.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.upstream):
                if w is None or w.is_closing():
                    continue
                if conn.failed:
                    _rst(w)
                else:
                    w.close()

    def _due(self, now: float, last: float) -> float:
        delay = self._delay_s
        if self._jitter_s:
            delay = max(0.0, delay + self._rng.uniform(-self._jitter_s, self._jitter_s))
        return max(last, now + delay)

    async def _pipe(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        up: bool,
    ) -> None:
        """One direction: a reader filling a bounded queue (each chunk stamped with
        its delivery time) and a writer delivering it when the fault allows."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        held = 0
        room = asyncio.Event()
        room.set()

        async def reading() -> None:
            nonlocal held
            last = 0.0
            while True:
                await room.wait()
                data = await reader.read(CHUNK)
                if conn.frozen:
                    if not data:
                        # The end of a frozen direction is never passed on.
                        queue.put_nowait((0.0, b""))
                        return
                    continue  # swallowed
                last = self._due(loop.time(), last)
                held += len(data)
                if held >= MAX_HELD_BYTES:
                    room.clear()
                queue.put_nowait((last, data))
                if not data:
                    return

        async def writing() -> None:
            nonlocal held
            while True:
                due, data = await queue.get()
                await self._flowing.wait()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    await self._flowing.wait()
                if conn.frozen:
                    if not data:
                        return
                    continue
                if not data:
                    with contextlib.suppress(OSError, RuntimeError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                for i in range(0, len(data), _SLICE):
                    piece = data[i : i + _SLICE]
                    writer.write(piece)
                    await writer.drain()
                    if up:
                        self.stats.bytes_up += len(piece)
                    else:
                        self.stats.bytes_down += len(piece)
                    rate = self._bytes_per_s
                    if rate:
                        await asyncio.sleep(len(piece) / rate)
                held -= len(data)
                if held < MAX_HELD_BYTES:
                    room.set()

        read_task = asyncio.ensure_future(reading())
        write_task = asyncio.ensure_future(writing())
        try:
            done, _ = await asyncio.wait(
                {read_task, write_task}, return_when=asyncio.FIRST_EXCEPTION
            )
            for t in done:
                t.result()
        finally:
            for t in (read_task, write_task):
                t.cancel()
            await asyncio.gather(read_task, write_task, return_exceptions=True)
