"""What the repository does when its server stops taking writes, on real
PostgreSQL: a pooled connection whose server turned read-only (a standby, or
a primary demoted by a failover) answers ``unavailable`` (retryable), never a
raw driver error, and the pool is invalidated, so the next transaction
reconnects (to the read-write server a multi-host URL finds) and succeeds. A
URL with ``target_session_attrs=read-write`` and no read-write server is
``unavailable`` too, and connects again once there is one."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.system import Unreachable, check_database
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.repository import Repository

pytestmark = pytest.mark.embedded


def read_write(url: str) -> str:
    u = make_url(url)
    return u.update_query_dict({"target_session_attrs": "read-write"}).render_as_string(
        hide_password=False
    )


@pytest.fixture
async def one_connection(db_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine whose pool holds one connection, so every transaction uses it."""
    engine = create_engine(read_write(db_url), pool_size=1, max_overflow=0)
    try:
        yield engine
    finally:
        await engine.dispose()


async def turn_read_only(engine: AsyncEngine) -> int:
    """Make the pooled connection's session read-only (what a server that went
    read-only under it looks like) and return its backend pid."""
    async with engine.connect() as conn:
        await conn.execute(sa.text("SET SESSION default_transaction_read_only = on"))
        await conn.commit()
        return int((await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one())


async def backend_pid(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one())


Write = Callable[[Repository], Awaitable[Any]]


async def _sa_path(repo: Repository) -> Any:
    async def fn(conn: Any, now: datetime) -> None:
        await conn.execute(sa.text("CREATE TEMP TABLE IF NOT EXISTS probe (x int)"))

    return await repo._tx("probe", fn)


async def _driver_path(repo: Repository) -> Any:
    async def fn(conn: Any, now: datetime) -> None:
        await conn.execute(sa.text("CREATE TEMP TABLE IF NOT EXISTS probe (x int)"))

    return await repo._tx("probe", fn, driver=True)


async def _raw_path(repo: Repository) -> Any:
    async def fn(conn: Any, now: datetime) -> None:
        await conn.execute("CREATE TEMP TABLE IF NOT EXISTS probe (x int)")

    return await repo._raw("probe", fn)


@pytest.mark.parametrize("write", [_sa_path, _driver_path, _raw_path], ids=["sa", "driver", "raw"])
async def test_a_read_only_server_is_unavailable_and_the_pool_reconnects(
    one_connection: AsyncEngine, write: Write
) -> None:
    repo = Repository(one_connection)
    await write(repo)
    old = await turn_read_only(one_connection)
    with pytest.raises(Unavailable) as refused:
        await write(repo)
    assert refused.value.fields.get("sqlstate") == "25006"
    # The read-only connection is gone from the pool: the next write works,
    # on a new connection.
    await write(repo)
    assert await backend_pid(one_connection) != old


async def test_read_write_with_no_read_write_server_is_unavailable_until_there_is_one(
    db_url: str,
) -> None:
    database = make_url(db_url).database
    admin = create_engine(db_url, pool_size=1, max_overflow=0)
    engine = create_engine(read_write(db_url), pool_size=1, max_overflow=0)
    repo = Repository(engine)
    try:
        async with admin.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(
                sa.text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
            )
        with pytest.raises(Unavailable):
            await _driver_path(repo)
        async with admin.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(
                sa.text(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
            )
        await _driver_path(repo)
    finally:
        await engine.dispose()
        await admin.dispose()


def multi_host(db_url: str, first: tuple[str, int], **query: str) -> str:
    """``db_url`` with ``first`` tried before its own server."""
    u = make_url(db_url)
    own = u.query.get("host") or u.host
    assert isinstance(own, str)
    hosts = [f"{first[0]}:{first[1]}", f"{own}:{u.port or 5432}"]
    return (
        u.set(host=None, port=None)
        .update_query_dict({"host": hosts, **query})
        .render_as_string(hide_password=False)
    )


async def test_a_first_host_that_never_answers_costs_its_connect_timeout_only(
    db_url: str,
) -> None:
    # A listening socket nobody accepts on: the handshake completes, the
    # server's reply never comes (a failed primary whose address still takes
    # connections, or drops them unanswered).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = multi_host(
            db_url,
            silent.getsockname(),
            connect_timeout="1",
            target_session_attrs="read-write",
        )
        engine = create_engine(url, pool_size=1, max_overflow=0)
        try:
            await _driver_path(Repository(engine))
            assert await backend_pid(engine) > 0
        finally:
            await engine.dispose()
        # `serve`'s check at start gives the first host its connect_timeout too.
        await check_database(url, timeout=0.5)


async def test_the_start_check_refuses_a_bad_multi_host_url_with_what_is_wrong() -> None:
    with pytest.raises(Unreachable, match="target_session_attrs"):
        await check_database("postgresql://fl@db1,db2/fleet?target_session_attrs=writable")
