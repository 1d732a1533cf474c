"""The ground everything stands on: real servers reachable, schema as declared."""

from __future__ import annotations

import nats
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.tables import metadata

pytestmark = pytest.mark.embedded


async def test_each_test_gets_a_migrated_database_of_its_own(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        names = set(
            (
                await conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
                )
            ).scalars()
        )
    assert set(metadata.tables) <= names
    assert "alembic_version" in names


async def test_migrations_produce_exactly_the_declared_schema(engine: AsyncEngine) -> None:
    def diff(sync_conn: object) -> list[object]:
        ctx = MigrationContext.configure(
            sync_conn, opts={"compare_type": True, "compare_server_default": True}
        )  # type: ignore[arg-type]
        return list(compare_metadata(ctx, metadata))

    async with engine.connect() as conn:
        differences = await conn.run_sync(diff)
    assert differences == []


async def test_nats_request_reply_round_trips_under_the_test_prefix(
    nats_url: str, subject_prefix: str
) -> None:
    nc = await nats.connect(nats_url)
    try:

        async def echo(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"pong:" + msg.data)

        await nc.subscribe(f"{subject_prefix}.echo", cb=echo)
        reply = await nc.request(f"{subject_prefix}.echo", b"ping", timeout=5)
        assert reply.data == b"pong:ping"
    finally:
        await nc.close()


async def test_database_is_empty_and_isolated_per_test(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        count = (await conn.execute(text("SELECT count(*) FROM tasks"))).scalar_one()
        await conn.execute(
            text("INSERT INTO users (name, token_hash, created_at) VALUES ('x', '\\x00', now())")
        )
    assert count == 0
