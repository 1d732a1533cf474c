"""The PostgreSQL and NATS servers a benchmark run uses (given, or embedded and
started for the run) and its scratch databases."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fleetlease.ops.bench.measure import admin, libpq_url, with_database
from fleetlease.ops.bench.options import BenchOptions


@dataclass
class Servers:
    """The PostgreSQL server (an admin URL on it) and NATS the run uses."""

    database_url: str
    nats_url: str
    pgbench: str | None
    embedded: list[str]


@contextlib.asynccontextmanager
async def servers(opts: BenchOptions, work: Path) -> AsyncIterator[Servers]:
    from fleetlease.ops.embedded import EmbeddedNats, EmbeddedPostgres

    pg: EmbeddedPostgres | None = None
    nats_server: EmbeddedNats | None = None
    embedded: list[str] = []
    try:
        db_url = opts.database_url
        pgbench: str | None = None
        if db_url is None:
            pg = EmbeddedPostgres(work / "postgres", database="postgres")
            db_url = await asyncio.to_thread(pg.start)
            embedded.append("postgres")
            candidate = pg.bin("pgbench")
            pgbench = candidate if Path(candidate).exists() else None  # noqa: ASYNC240
        nats_url = opts.nats_url
        if nats_url is None:
            nats_server = EmbeddedNats(work / "nats")
            nats_url = await asyncio.to_thread(nats_server.start)
            embedded.append("nats")
        yield Servers(
            database_url=db_url,
            nats_url=nats_url,
            pgbench=pgbench or find_pgbench(),
            embedded=embedded,
        )
    finally:
        if nats_server is not None:
            await asyncio.to_thread(nats_server.stop)
        if pg is not None:
            await asyncio.to_thread(pg.stop)


def find_pgbench() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / "pgbench").exists():
            return str(d / "pgbench")
    return None


@contextlib.asynccontextmanager
async def scratch_database(admin_url: str, tag: str) -> AsyncIterator[str]:
    name = f"fl_bench_{tag}_{uuid.uuid4().hex[:8]}"
    await admin(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield libpq_url(with_database(admin_url, name))
    finally:
        with contextlib.suppress(Exception):
            await admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
