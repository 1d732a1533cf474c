"""Bringing the pieces up: embedded or given PostgreSQL and NATS, the schema, the
single-instance lock of ``up``, the context file."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

from fleetlease.ops.config import ConfigError, Settings, ensure_state_dir, read_context
from fleetlease.ops.embedded import EmbeddedError, EmbeddedNats, EmbeddedPostgres
from fleetlease.persistence.db import redact

log = structlog.get_logger("fleetlease.system")


class Unreachable(Exception):
    """A configured server cannot be reached."""

    code = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AlreadyRunning(Exception):
    code = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


async def check_database(url: str, timeout: float = 5.0) -> None:
    """Connect once, as the control plane's engine does (every host of a
    multi-host URL, in order, with its ``target_session_attrs``), and close.
    ``timeout`` bounds the whole; with several hosts, each may also take its
    ``connect_timeout``, so that a first host that does not answer leaves time
    for the others."""
    import asyncpg
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    from fleetlease.persistence.db import async_url, connect_timeout, create_engine

    try:
        engine = create_engine(url, pool_size=1, max_overflow=0)
        hosts = make_url(async_url(url)).query.get("host")
        if isinstance(hosts, tuple) and len(hosts) > 1:
            timeout = max(timeout, connect_timeout(url) * len(hosts))
    except (ValueError, sa.exc.ArgumentError) as exc:
        raise Unreachable(f"unusable PostgreSQL URL {redact(url)}: {exc}") from exc
    try:
        async with asyncio.timeout(timeout), engine.connect():
            pass
    except (
        OSError,
        TimeoutError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,
        sa.exc.DBAPIError,
        ValueError,
    ) as exc:
        reason = str(getattr(exc, "orig", None) or exc) or type(exc).__name__
        raise Unreachable(f"cannot reach PostgreSQL at {redact(url)}: {reason}") from exc
    finally:
        await engine.dispose()


async def check_nats(
    url: str, timeout: float = 5.0, connect_options: dict[str, Any] | None = None
) -> None:
    """Connect once (as the control plane, with ``connect_options``, on a secured
    broker) and close."""
    import nats

    from fleetlease.transport.nats_connect import server_list

    errors: list[str] = []

    async def _err(exc: Exception) -> None:
        errors.append(str(exc) or type(exc).__name__)

    try:
        # nats-py retries a refused first connect despite allow_reconnect=False:
        # bound the whole attempt.
        nc = await asyncio.wait_for(
            nats.connect(
                server_list(url),
                connect_timeout=timeout,
                max_reconnect_attempts=0,
                allow_reconnect=False,
                error_cb=_err,
                **(connect_options or {}),
            ),
            timeout + 1,
        )
        await nc.close()
    except Exception as exc:
        reason = errors[0] if errors else (str(exc) or type(exc).__name__)
        raise Unreachable(f"cannot reach NATS at {url}: {reason}") from exc


@contextlib.contextmanager
def single_instance(state_dir: Path, name: str = "up") -> Iterator[None]:
    """Hold an exclusive lock on the state dir for the lifetime of the block."""
    path = state_dir / f"{name}.lock"
    fh: IO[str] = open(path, "a+")  # noqa: SIM115 - held for the whole block
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        pid = fh.read().strip() or "?"
        fh.close()
        raise AlreadyRunning(
            f"another fleetlease {name} is running on {state_dir} (pid {pid}); stop it first"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            fh.seek(0)
            fh.truncate()
        fh.close()


@dataclass
class Services:
    """The PostgreSQL and NATS a process uses, embedded ones started on demand.

    An embedded nats-server runs with broker security on: the
    generated auth-callout config of ``transport.broker_config`` with the keys
    in ``<state dir>/broker``; the control plane on the same state dir must start
    with ``ControlPlaneService(broker_security=True)`` (``broker_security`` below
    says so). A given ``--nats-url`` is used as its operator configured it, or,
    with ``secured``, as one running the secure config of the state dir's keys
    (``fleetlease broker config``), whose callout the control plane serves."""

    settings: Settings
    need_nats: bool = True
    secured: bool = False
    database_url: str = ""
    nats_url: str = ""
    pg: EmbeddedPostgres | None = None
    nats: EmbeddedNats | None = None
    started: list[str] = field(default_factory=list)

    def start(self) -> Services:
        s = self.settings
        ensure_state_dir(s.state_dir)
        try:
            if s.database_url:
                self.database_url = s.database_url
            else:
                self.pg = EmbeddedPostgres(s.state_dir / "postgres")
                self.database_url = self.pg.start()
                self.started.append("postgres")
            if s.nats_url or not self.need_nats:
                self.nats_url = s.nats_url or ""
            else:
                from fleetlease.transport.broker_config import secure_embedded_args
                from fleetlease.transport.subjects import Subjects

                previous = read_context(s.state_dir).get("nats_port")
                self.nats = EmbeddedNats(
                    s.state_dir / "nats",
                    port=previous if isinstance(previous, int) else None,
                    extra_args=secure_embedded_args(s.state_dir, subjects=Subjects(s.prefix)),
                )
                self.nats_url = self.nats.start()
                self.started.append("nats")
            asyncio.run(self._check())
        except (EmbeddedError, Unreachable, ConfigError, OSError):
            self.stop()
            raise
        return self

    @property
    def broker_security(self) -> bool:
        """Whether the NATS in use is secured: the embedded one, or a given one
        said to run the secure config."""
        return self.nats is not None or (self.secured and bool(self.nats_url))

    def control_plane_connect_options(self) -> dict[str, Any]:
        """How the control plane connects: its nkey on a secured server,
        nothing special on an open one."""
        if not self.broker_security:
            return {}
        from fleetlease.transport.broker_config import BrokerKeys

        keys = BrokerKeys.load_or_create(self.settings.state_dir / "broker")
        return keys.control_plane_connect_options()

    async def _check(self) -> None:
        await check_database(self.database_url)
        if self.nats_url:
            await check_nats(self.nats_url, connect_options=self.control_plane_connect_options())

    def stop(self) -> None:
        if self.nats is not None:
            self.nats.stop()
        if self.pg is not None:
            self.pg.stop()

    def __enter__(self) -> Services:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
