"""The peers cell of ``fleetlease bench --peers``: the same zero-duration jobs
through procrastinate and pgqueuer (extra ``bench``)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fleetlease.ops.bench.options import SUBMIT_BATCH, BenchOptions, say
from fleetlease.ops.bench.servers import scratch_database


async def procrastinate_jobs_per_s(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    async def noop() -> None:
        return None

    task = app.task(name="noop", queue="bench")(noop)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        t0 = time.perf_counter()
        for i in range(0, n, SUBMIT_BATCH):
            await task.batch_defer_async(*[{} for _ in range(min(SUBMIT_BATCH, n - i))])
        await app.run_worker_async(
            queues=["bench"],
            concurrency=concurrency,
            wait=False,
            install_signal_handlers=False,
            listen_notify=False,
        )
        elapsed = time.perf_counter() - t0
    version = getattr(procrastinate, "__version__", None)
    return {"version": version, "jobs": n, "jobs_per_s": round(n / elapsed, 1)}


async def pgqueuer_jobs_per_s(url: str, n: int, concurrency: int) -> dict[str, Any]:
    import asyncpg
    import pgqueuer
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    batch_size = 10  # pgqueuer's default
    conn = await asyncpg.connect(url)
    try:
        driver = AsyncpgDriver(conn)
        queries = Queries(driver)
        await queries.install()
        qm = QueueManager(queries)
        finished = 0

        async def noop(job: Any) -> None:
            nonlocal finished
            finished += 1

        qm.entrypoint("noop")(noop)
        t0 = time.perf_counter()
        for i in range(0, n, SUBMIT_BATCH):
            m = min(SUBMIT_BATCH, n - i)
            await queries.enqueue(["noop"] * m, [None] * m, [0] * m)
        await qm.run(
            batch_size=batch_size,
            mode=QueueExecutionMode.drain,
            max_concurrent_tasks=max(concurrency, 2 * batch_size),
        )
        elapsed = time.perf_counter() - t0
    finally:
        with contextlib.suppress(Exception):
            await conn.close()
    return {
        "version": getattr(pgqueuer, "__version__", None),
        "jobs": n,
        "finished": finished,
        "batch_size": batch_size,
        "jobs_per_s": round(n / elapsed, 1),
    }


async def peers_cell(opts: BenchOptions, admin_url: str) -> dict[str, Any]:
    concurrency = opts.hosts * opts.devices_per_host
    out: dict[str, Any] = {"concurrency": concurrency}
    for name, fn in (
        ("procrastinate", procrastinate_jobs_per_s),
        ("pgqueuer", pgqueuer_jobs_per_s),
    ):
        say(opts, f"peers: {name}")
        try:
            async with scratch_database(admin_url, name) as url:
                out[name] = await fn(url, opts.tasks, concurrency)
        except ModuleNotFoundError as exc:
            out[name] = {"error": f"not installed ({exc.name}): pip install 'fleetlease[bench]'"}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
