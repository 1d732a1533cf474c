"""Serving the console with uvicorn, in the caller's event loop.

``start_console`` binds the socket itself (so ``port=0`` works and a port in
use fails at once with ``OSError``), checks that NATS answers (``OpsError`` if
not), then serves until ``RunningConsole.stop()``. Signals stay with the
caller unless ``handle_signals``: ``fleetlease up`` has its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from fleetlease.ops.web.app import create_app
from fleetlease.ops.web.console import Console, WebSettings

#: Seconds open connections get to finish when the console stops.
GRACE_S = 5.0


def parse_listen(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (on ``default_host``)."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    host = host.strip("[]") or default_host
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"not a port number: {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    return host, port


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


class ConsoleServer(uvicorn.Server):
    """uvicorn, except that its shutdown first ends the event streams (which
    would otherwise keep their connections, and the shutdown, waiting), and
    that it leaves signal handling to the caller unless asked."""

    def __init__(self, config: uvicorn.Config, console: Console, handle_signals: bool) -> None:
        super().__init__(config)
        self.console = console
        self.handle_signals = handle_signals
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self.handle_signals:
            with super().capture_signals():
                yield
        else:
            yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.console.closing.set()
        await super().shutdown(sockets)


@dataclass
class RunningConsole:
    url: str
    server: ConsoleServer
    task: asyncio.Task[None]
    console: Console

    async def stop(self) -> None:
        self.server.should_exit = True
        self.console.closing.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def wait(self) -> None:
        await asyncio.shield(self.task)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def start_console(
    settings: WebSettings, *, host: str, port: int, handle_signals: bool = False
) -> RunningConsole:
    sock = bind(host, port)
    bound_port = int(sock.getsockname()[1])
    console = Console(settings)
    try:
        await console.start()
        app = create_app(settings, console=console)
        config = uvicorn.Config(
            app,
            http="h11",
            ws="none",
            lifespan="on",
            # The caller's logging stays as it is; uvicorn says only what is wrong.
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(GRACE_S),
            server_header=False,
        )
        server = ConsoleServer(config, console, handle_signals)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if not server.ready.is_set():
            ready.cancel()
            await task
            raise RuntimeError("the web console did not start")
        ready.cancel()
    except BaseException:
        await console.stop()
        sock.close()
        raise
    return RunningConsole(url_of(host, bound_port), server, task, console)
