"""The one way the repository runs a transaction: ``Transactions._tx`` (READ
COMMITTED, the clock's time, typed errors, whole-transaction retries), on
SQLAlchemy or on the driver's own connection."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import asyncpg
import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.db import SERVER_LOST_SQLSTATES, invalidate_pool
from fleetlease.persistence.driver import DriverConnection
from fleetlease.persistence.errors import RepositoryError, Unavailable
from fleetlease.persistence.model import LeaseTimings
from fleetlease.persistence.repository._sql import _is_prebuilt

log = structlog.get_logger("fleetlease.repository")


T = TypeVar("T")


#: SQLSTATEs after which the whole transaction is simply run again: serialization
#: failure, deadlock, and a refused connection (the transaction never started).
RETRY_SQLSTATES = frozenset({"40001", "40P01", "53300", "57P03"})

#: SQLSTATEs that are ``Unavailable`` (retryable by the caller): connection
#: exceptions, insufficient resources, an operator intervention (the server
#: shutting down), and a read-only transaction (connected to a standby, or to a
#: primary demoted by a failover).
UNAVAILABLE_CLASSES = ("08", "53", "57")


def _unavailable_state(state: str | None) -> bool:
    return state is not None and (
        state.startswith(UNAVAILABLE_CLASSES)
        or state in RETRY_SQLSTATES
        or state in SERVER_LOST_SQLSTATES
    )


TX_ATTEMPTS = 5


FOREIGN_KEY_VIOLATION = "23503"


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    for obj in (orig, getattr(orig, "__cause__", None)):
        code = getattr(obj, "sqlstate", None) or getattr(obj, "pgcode", None)
        if isinstance(code, str):
            return code
    return None


def _no_server(exc: BaseException) -> bool:
    """Whether SQLAlchemy's error wraps the driver finding no usable server: no
    host reachable, or none matching ``target_session_attrs`` (during a
    failover, before the standby is promoted)."""
    cause: BaseException | None = exc
    for _ in range(4):
        cause = cause.__cause__ if cause is not None else None
        if isinstance(cause, asyncpg.InternalClientError | OSError):
            return True
    return False


async def _may_retry(op: str, state: str | None, attempt: int) -> bool:
    """After a failed ``attempt``: wait a little and say True when the whole
    transaction should simply run again (``RETRY_SQLSTATES``, attempts left)."""
    if state not in RETRY_SQLSTATES or attempt >= TX_ATTEMPTS:
        return False
    log.info("repository.tx_retry", op=op, sqlstate=state, attempt=attempt)
    await asyncio.sleep(random.uniform(0, 0.01 * 2**attempt))
    return True


class Transactions:
    """The engine, the clock and the lease timings, and the transaction boundary
    every role of the repository runs its statements through."""

    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock | None = None,
        timings: LeaseTimings | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock or SystemClock()
        self.timings = timings or LeaseTimings()

    async def _tx(
        self,
        op: str,
        fn: Callable[[Any, datetime], Awaitable[T]],
        *,
        autocommit: bool = False,
        driver: bool = False,
    ) -> T:
        """Run ``fn`` in one READ COMMITTED transaction with the clock's time. Typed
        errors roll back and propagate; serialization failures and deadlocks run
        the transaction again; driver and connection errors become ``Unavailable``.

        ``autocommit``: ``fn``'s statements each commit on their own (autocommit
        mode), saving the BEGIN and COMMIT round trips. For one read (the hot
        long-poll path reads the session and the pending assignments), one write
        that is atomic by itself (a one-task submit), or statements written to be
        correct each alone (``_run_optimistic``).

        ``driver``: ``fn`` is given a :class:`DriverConnection` instead, which
        runs the same Core statements on the driver's (asyncpg) connection
        without SQLAlchemy's execution layer, in a transaction of the driver's:
        less CPU per statement, for the hot paths (figures in
        docs/performance.md)."""
        for attempt in range(1, TX_ATTEMPTS + 1):
            try:
                if driver:
                    return await self._on_driver(fn, autocommit)
                if autocommit:
                    async with self.engine.connect() as conn:
                        await conn.execution_options(isolation_level="AUTOCOMMIT")
                        return await fn(conn, self.clock.now())
                async with self.engine.begin() as conn:
                    return await fn(conn, self.clock.now())
            except RepositoryError:
                raise
            except sa.exc.DBAPIError as exc:
                state = _sqlstate(exc)
                if await _may_retry(op, state, attempt):
                    continue
                if (
                    isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError)
                    or exc.connection_invalidated
                    or _unavailable_state(state)
                    or _no_server(exc)
                ):
                    raise Unavailable(
                        f"database unavailable during {op}", op=op, sqlstate=state
                    ) from exc
                raise
            except asyncpg.PostgresError as exc:  # hand-written SQL on the driver's path
                state = exc.sqlstate
                if await _may_retry(op, state, attempt):
                    continue
                if isinstance(exc, asyncpg.PostgresConnectionError) or _unavailable_state(state):
                    raise Unavailable(
                        f"database unavailable during {op}", op=op, sqlstate=state
                    ) from exc
                raise
            except (
                asyncpg.InterfaceError,  # the driver's own, on the driver's path
                asyncpg.InternalClientError,  # e.g. a connection the server closed
                OSError,
                TimeoutError,
                sa.exc.TimeoutError,
            ) as exc:
                raise Unavailable(f"database unavailable during {op}", op=op) from exc
        raise Unavailable(f"database kept aborting {op}", op=op)  # pragma: no cover

    async def _on_driver(self, fn: Callable[[Any, datetime], Awaitable[T]], autocommit: bool) -> T:
        """``fn`` with a :class:`DriverConnection` (``_tx``'s ``driver``). A
        failure that may have broken the connection discards it rather than
        return it to the pool; one that shows its server gone (the connection
        closed, a read-only or shutting-down server) invalidates the pool too,
        as SQLAlchemy does on a disconnect it sees itself."""
        async with self.engine.connect() as conn:
            dconn = await DriverConnection.of(conn, _is_prebuilt)
            try:
                if autocommit:
                    return await fn(dconn, self.clock.now())
                async with dconn.raw.transaction():
                    return await fn(dconn, self.clock.now())
            except RepositoryError:
                raise
            except BaseException as exc:
                # A server's refusal (raised by the driver, or translated by
                # ``DriverConnection``) leaves the connection usable; anything
                # else (lost, or a statement cut short) leaves it unknown.
                cause = exc.__cause__ if isinstance(exc, sa.exc.DBAPIError) else exc
                state = getattr(cause, "sqlstate", None)
                if dconn.raw.is_closed() or state in SERVER_LOST_SQLSTATES:
                    invalidate_pool(self.engine, await conn.get_raw_connection())
                if (
                    not isinstance(cause, asyncpg.PostgresError)
                    or isinstance(cause, asyncpg.PostgresConnectionError)
                    or state in SERVER_LOST_SQLSTATES
                ):
                    await conn.invalidate()
                raise

    async def _raw(self, op: str, fn: Callable[[Any, datetime], Awaitable[T]]) -> T:
        """``_tx`` for hand-written SQL: ``fn`` is given the driver's (asyncpg)
        connection itself, in autocommit: each statement is its own
        transaction, with no BEGIN or COMMIT round trip (the renewal's hot
        path, the user request's reads)."""
        return await self._tx(op, lambda conn, now: fn(conn.raw, now), autocommit=True, driver=True)
