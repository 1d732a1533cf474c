"""The one HTTP listener of ``--metrics HOST:PORT``: ``/metrics`` (Prometheus
text or OpenMetrics, prometheus_client's own WSGI app), ``/healthz`` and
``/readyz``, served by a small threading WSGI server on a daemon thread of its
own, so a scrape never runs on the event loop (what it needs from the loop it
asks for with a bound; see ``collectors.on_loop``)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

from fleetlease.ops.observe.metrics import REGISTRY

log = structlog.get_logger("fleetlease.observe")

#: ``serve`` and ``up`` listen here unless told otherwise (Prometheus' own
#: range of exporter ports; loopback only: the endpoint has no authentication).
DEFAULT_ADDRESS = "127.0.0.1:9464"

Readiness = Callable[[], dict[str, Any]]
StartResponse = Callable[..., Any]


class MetricsAddressError(ValueError):
    """A ``--metrics`` value that is not ``HOST:PORT``."""


class ListenError(Exception):
    """The listener's address cannot be bound (in use, not local, no permission)."""

    code = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every interface)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        raise MetricsAddressError(f"--metrics must be HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise MetricsAddressError(f"--metrics port must be 0-65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", port


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Forward(Collector):
    """The process-wide metrics, inside a listener's own registry."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()


class MetricsListener:
    def __init__(
        self, address: str, *, collectors: Iterable[Collector] = (), readiness: Readiness
    ) -> None:
        self.host, self.port = parse_address(address)
        self.registry = CollectorRegistry()
        self.registry.register(_Forward())
        for c in collectors:
            self.registry.register(c)
        self._metrics = make_wsgi_app(self.registry)
        self._readiness = readiness
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self) -> MetricsListener:
        """Bind and serve; ``ListenError`` when the address cannot be bound."""
        cls = _Server6 if ":" in self.host else _Server
        try:
            self._httpd = make_server(
                self.host, self.port, self._app, server_class=cls, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise ListenError(
                f"cannot listen on --metrics {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.25},
            name="fleetlease-metrics",
            daemon=True,
        )
        self._thread.start()
        log.info("metrics_listening", url=self.url)
        return self

    def stop(self) -> None:
        """Blocking (up to a poll interval): run it off the event loop."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterator[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return _plain(start_response, "405 Method Not Allowed", "GET only\n")
        if path == "/metrics":
            return iter(self._metrics(environ, start_response))
        if path == "/healthz":
            return _plain(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            try:
                report = self._readiness()
            except Exception as exc:  # the endpoint answers whatever happens
                report = {
                    "ready": False,
                    "checks": {"readiness": {"ok": False, "detail": str(exc)}},
                }
            body = json.dumps(report, sort_keys=True).encode() + b"\n"
            status = "200 OK" if report.get("ready") else "503 Service Unavailable"
            start_response(
                status,
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return iter([body])
        if path == "/":
            return _plain(start_response, "200 OK", "fleetlease: /metrics /healthz /readyz\n")
        return _plain(start_response, "404 Not Found", "not found\n")


def _plain(start_response: StartResponse, status: str, text: str) -> Iterator[bytes]:
    body = text.encode()
    start_response(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    )
    return iter([body])
