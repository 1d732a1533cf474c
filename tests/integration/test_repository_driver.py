"""``persistence.driver``: Core statements run on the driver's connection give
what SQLAlchemy's execution gives (rows, mappings, scalars, row counts, typed
errors), on real PostgreSQL."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence import driver
from fleetlease.persistence.driver import DriverConnection
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.model import TaskKind, TaskSpec
from fleetlease.persistence.repository import _is_prebuilt, _prebuilt, _sqlstate
from fleetlease.persistence.tables import tasks, users
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


@asynccontextmanager
async def _both(world: World) -> AsyncIterator[tuple[AsyncConnection, DriverConnection]]:
    """A SQLAlchemy connection and a driver one (each in autocommit)."""
    async with world.engine.connect() as sa_conn, world.engine.connect() as other:
        await sa_conn.execution_options(isolation_level="AUTOCOMMIT")
        yield sa_conn, await DriverConnection.of(other, _is_prebuilt)


async def _tasks(world: World, n: int) -> list[str]:
    return await world.repo.submit_many(
        [
            TaskSpec(
                kind=TaskKind.GOAL,
                goal="g",
                project="p1",
                owner="alice",
                payload={"n": i, "nested": {"list": [1, "two", None]}},
                selector={"os": "android"},
                priority=i,
            )
            for i in range(n)
        ]
    )


async def test_rows_mappings_and_scalars_are_those_sqlalchemy_gives(world: World) -> None:
    ids = await _tasks(world, 3)
    statements: list[tuple[Any, dict[str, Any] | None]] = [
        (sa.select(tasks).order_by(tasks.c.priority), None),  # not prebuilt
        (
            _prebuilt(
                ("test_driver", "by_id"),
                lambda: sa.select(tasks.c.id, tasks.c.payload, tasks.c.created_at).where(
                    tasks.c.id == sa.bindparam("tid")
                ),
            ),
            {"tid": ids[1]},
        ),
        # A list bound to IN: SQL completed per run.
        (
            sa.select(tasks.c.id, tasks.c.priority)
            .where(tasks.c.id.in_(ids[:2]))
            .order_by(tasks.c.priority),
            None,
        ),
        # A literal compared with a column is bound by the statement itself.
        (sa.select(tasks.c.id).where(tasks.c.status == "queued").order_by(tasks.c.id), None),
    ]
    async with _both(world) as (sa_conn, d_conn):
        for stmt, params in statements:
            want = (await sa_conn.execute(stmt, params)).all()
            got = (await d_conn.execute(stmt, params)).all()
            assert [tuple(r) for r in got] == [tuple(r) for r in want]
            assert [r._mapping for r in got] == [dict(r._mapping) for r in want]
            want_m = (await sa_conn.execute(stmt, params)).mappings().all()
            assert (await d_conn.execute(stmt, params)).mappings().all() == [
                dict(m) for m in want_m
            ]
            want_s = (await sa_conn.execute(stmt, params)).scalars().all()
            assert (await d_conn.execute(stmt, params)).scalars().all() == want_s
            assert await d_conn.scalar(stmt, params) == await sa_conn.scalar(stmt, params)
        row = (await d_conn.execute(*statements[1])).one()
        assert row.id == ids[1] and isinstance(row.id, str)  # UUID as the table says
        assert row.payload == {"n": 1, "nested": {"list": [1, "two", None]}}
        assert row.created_at.tzinfo is not None
        with pytest.raises(AttributeError):
            row.no_such_column  # noqa: B018
        first = (await d_conn.execute(statements[0][0])).first()
        assert first is not None and first.priority == 0


async def test_updates_count_their_rows_and_inserts_take_server_defaults(world: World) -> None:
    ids = await _tasks(world, 3)
    bump = _prebuilt(
        ("test_driver", "bump"),
        lambda: (
            sa.update(tasks)
            .where(tasks.c.project == sa.bindparam("p"))
            .values(priority=tasks.c.priority + 10)
        ),
    )
    async with _both(world) as (sa_conn, d_conn):
        assert (await d_conn.execute(bump, {"p": "p1"})).rowcount == 3
        assert (await d_conn.execute(bump, {"p": "nope"})).rowcount == 0
        priorities = (
            await sa_conn.execute(sa.select(tasks.c.priority).order_by(tasks.c.priority))
        ).scalars()
        assert list(priorities) == [10, 11, 12]
        # An INSERT without values of its own sets the columns named.
        insert = _prebuilt(("test_driver", "user_insert"), users.insert)
        await d_conn.execute(
            insert, {"name": "dave", "token_hash": b"x" * 32, "created_at": world.clock.now()}
        )
        dave = (await sa_conn.execute(sa.select(users).where(users.c.name == "dave"))).one()
        assert dave.platform_admin is False  # the server's default
    assert len(ids) == 3


async def test_only_prebuilt_statements_are_kept_compiled(world: World) -> None:
    ad_hoc = sa.select(tasks.c.id).where(tasks.c.priority > sa.bindparam("p"))
    kept = _prebuilt(("test_driver", "kept"), lambda: sa.select(sa.func.count()).select_from(tasks))
    before = len(driver._COMPILED)
    async with _both(world) as (_, d_conn):
        await d_conn.execute(ad_hoc, {"p": 0})
        assert len(driver._COMPILED) == before
        assert await d_conn.scalar(kept) == 0
        assert len(driver._COMPILED) == before + 1
        assert await d_conn.scalar(kept) == 0  # from the cache, same answer
        assert len(driver._COMPILED) == before + 1


async def test_bad_calls_are_refused_before_anything_runs(world: World) -> None:
    stmt = _prebuilt(
        ("test_driver", "need_p"),
        lambda: sa.update(tasks).where(tasks.c.project == sa.bindparam("p")).values(priority=1),
    )
    async with _both(world) as (_, d_conn):
        with pytest.raises(sa.exc.ArgumentError, match="'p'"):
            await d_conn.execute(stmt, {})
        with pytest.raises(TypeError, match="one mapping"):
            await d_conn.execute(stmt, [{"p": "p1"}, {"p": "p2"}])  # type: ignore[arg-type]


async def test_server_errors_are_sqlalchemys_types_and_leave_the_connection_usable(
    world: World,
) -> None:
    insert = _prebuilt(("test_driver", "task_insert_min"), tasks.insert)
    row = {
        "id": "00000000-0000-4000-8000-000000000001",
        "project": "no-such-project",
        "owner": "alice",
        "status": "queued",
        "kind": "goal",
        "max_attempts": 1,
        "backoff_base_s": 1.0,
        "backoff_cap_s": 1.0,
        "eligible_at": world.clock.now(),
        "created_at": world.clock.now(),
        "updated_at": world.clock.now(),
    }
    async with _both(world) as (_, d_conn):
        with pytest.raises(sa.exc.IntegrityError) as err:
            await d_conn.execute(insert, row)
        assert _sqlstate(err.value) == "23503"  # foreign key violation
        assert await d_conn.scalar(sa.select(sa.func.count()).select_from(tasks)) == 0


async def test_a_driver_transaction_that_fails_writes_nothing(world: World) -> None:
    """A failure inside a driver transaction rolls all of it back."""
    bump = _prebuilt(
        ("test_driver", "bump_all"),
        lambda: sa.update(tasks).values(priority=tasks.c.priority + 1),
    )
    await _tasks(world, 2)

    async def run(conn: DriverConnection, now: Any) -> None:
        await conn.execute(bump)
        await conn.execute(sa.text("SELECT 1/0"))

    with pytest.raises(sa.exc.DBAPIError):
        await world.repo._tx("test", run, driver=True)
    async with world.engine.connect() as conn:
        got = (await conn.execute(sa.select(tasks.c.priority).order_by(tasks.c.priority))).all()
    assert [r[0] for r in got] == [0, 1]


async def test_a_connection_lost_in_a_driver_transaction_is_unavailable_and_not_reused(
    world: World,
) -> None:
    pids: list[int] = []

    async def run(conn: DriverConnection, now: Any) -> None:
        pids.append(conn.raw.get_server_pid())
        async with world.engine.connect() as admin:
            await admin.execute(
                sa.text("SELECT pg_terminate_backend(:p)"), {"p": conn.raw.get_server_pid()}
            )
        await conn.execute(sa.select(sa.func.count()).select_from(tasks))

    with pytest.raises(Unavailable):
        await world.repo._tx("test", run, driver=True)

    async def pid(conn: DriverConnection, now: Any) -> int:
        return int(conn.raw.get_server_pid())

    for _ in range(5):  # whichever pooled connection each takes: never the dead one
        assert await world.repo._tx("test", pid, driver=True) != pids[0]


async def test_a_statement_prepared_before_a_schema_change_runs_again(world: World) -> None:
    """Another process's migration changed a column's type under a prepared
    statement: outside a transaction the statement is prepared again and runs."""
    scratch = sa.Table("driver_scratch", sa.MetaData(), sa.Column("a", sa.Integer))
    read = _prebuilt(("test_driver", "scratch"), lambda: sa.select(scratch.c.a))
    async with world.engine.begin() as conn:
        await conn.execute(sa.text("CREATE TABLE driver_scratch (a integer)"))
        await conn.execute(sa.text("INSERT INTO driver_scratch VALUES (7)"))
    async with _both(world) as (sa_conn, d_conn):
        assert await d_conn.scalar(read) == 7
        await sa_conn.execute(sa.text("ALTER TABLE driver_scratch ALTER COLUMN a TYPE bigint"))
        assert await d_conn.scalar(read) == 7


async def test_a_discarded_connection_is_freed_with_its_prepared_statements(world: World) -> None:
    """The prepared statements are kept with their connection's pool record
    (SQLAlchemy's ``info``), not beside the pool: once the pool lets the
    connection go, nothing keeps it alive (a prepared statement refers to its
    connection, so a cache outside would keep every discarded one)."""
    held: list[weakref.ref[Any]] = []

    async def run(conn: DriverConnection, now: Any) -> None:
        await conn.execute(
            _prebuilt(
                ("test_driver", "count"), lambda: sa.select(sa.func.count()).select_from(tasks)
            )
        )
        held.append(weakref.ref(conn.raw))
        raise ConnectionResetError("lost")  # the connection is discarded

    with pytest.raises(Unavailable):
        await world.repo._tx("test", run, driver=True)
    await world.engine.dispose()  # the records go (a record clears it at its next use)
    gc.collect()
    assert held[0]() is None
