"""Measuring helpers of the benchmarks: percentiles, waits with deadlines, CPU and
commit counters, scratch databases on a PostgreSQL server."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import psutil

from fleetlease.ops.bench.options import BenchError

T = TypeVar("T")


def pct(samples: list[float], p: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


async def admin(url: str, sql: str) -> None:
    import asyncpg
    from sqlalchemy.engine import make_url

    from fleetlease.persistence.db import async_url

    u = make_url(async_url(url))
    conn = await asyncpg.connect(
        user=u.username,
        password=u.password,
        database=u.database,
        host=u.query.get("host") or u.host,
        port=u.port,
    )
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def with_database(url: str, name: str) -> str:
    from sqlalchemy.engine import make_url

    from fleetlease.persistence.db import async_url

    return make_url(async_url(url)).set(database=name).render_as_string(hide_password=False)


def latency_ms(samples_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p99/max in milliseconds (None without samples)."""
    if not samples_s:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    ms = [s * 1000.0 for s in samples_s]
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 3),
        "p99_ms": round(pct(ms, 99), 3),
        "max_ms": round(max(ms), 3),
    }


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.01)


async def until_all(count: Callable[[], int], total: int, what: str, stall_s: float = 60.0) -> None:
    """Wait until ``count() == total``; give up only when it stops moving."""
    last, moved = -1, time.monotonic()
    while (n := count()) < total:
        if n != last:
            last, moved = n, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise BenchError(f"{what}: stuck at {n} of {total} for {stall_s:.0f} s")
        await asyncio.sleep(0.01)


async def bounded(concurrency: int, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    sem = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (every process; idle,
    I/O wait and steal excluded)."""
    t = psutil.cpu_times()
    return float(
        sum(getattr(t, f) for f in ("user", "nice", "system", "irq", "softirq") if hasattr(t, f))
    )


async def xact_commit(url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(libpq_url(url))
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        value = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return int(value)
    finally:
        await conn.close()


def libpq_url(url: str) -> str:
    """The URL as libpq and asyncpg spell it (no SQLAlchemy driver suffix)."""
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url).replace(
        "postgres+asyncpg://", "postgresql://"
    )
