"""Apply the schema with Alembic, programmatically (no alembic.ini needed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.db import async_url, create_engine

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", async_url(url).replace("%", "%%"))
    return cfg


def _upgrade_sync(connection: Connection, revision: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


async def upgrade_engine(engine: AsyncEngine, revision: str = "head") -> None:
    """Migrate through an existing engine. A transaction-level advisory lock keeps
    several `serve` processes starting at once from migrating concurrently."""
    async with engine.begin() as conn:
        await conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7244501)")
        await conn.run_sync(_upgrade_sync, revision)


async def upgrade(url: str, revision: str = "head") -> None:
    engine = create_engine(url, pool_size=1)
    try:
        await upgrade_engine(engine, revision)
    finally:
        await engine.dispose()


def upgrade_blocking(url: str, revision: str = "head") -> None:
    asyncio.run(upgrade(url, revision))
