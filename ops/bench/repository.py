"""Repository benchmark (not a test): transitions per second for submit, assign,
claim, ack, renew (single and batched) and report on a real PostgreSQL, and the
commits a whole task lifecycle costs (pg_stat_database ``xact_commit`` deltas).

    python -m fleetlease.ops.bench.repository --database-url postgresql://postgres@127.0.0.1/bench

The database is migrated first; every run uses fresh host/user/project names, so
runs can repeat on the same database. Time is the system clock.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.db import create_engine, redact
from fleetlease.persistence.migrate import upgrade
from fleetlease.persistence.model import (
    Assignment,
    Claimed,
    DeviceSnapshot,
    LeaseTimings,
    Outcome,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
)
from fleetlease.persistence.repository import Renewal, Repository

T = TypeVar("T")


async def _commits(url: str) -> int:
    """xact_commit of the database, read after every other backend has exited
    (a backend flushes its statistics at exit at the latest)."""
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
            value = (
                await conn.execute(
                    sa.text(
                        "SELECT xact_commit FROM pg_stat_database"
                        " WHERE datname = current_database()"
                    )
                )
            ).scalar_one()
        return int(value)
    finally:
        await engine.dispose()


async def _bounded(concurrency: int, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    sem = asyncio.Semaphore(concurrency)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


class Bench:
    def __init__(self, url: str, tasks: int, hosts: int, concurrency: int, batch: int) -> None:
        self.url = url
        self.n = tasks
        self.n_hosts = hosts
        self.concurrency = concurrency
        self.batch = batch
        self.tag = uuid.uuid4().hex[:8]
        self.results: list[tuple[str, int, float]] = []
        self.sync_commit: Any = None
        self.engine: AsyncEngine = create_engine(
            url, pool_size=concurrency, max_overflow=concurrency
        )
        # Generous deadlines: the benchmark measures throughput, not expiry.
        self.repo = Repository(
            self.engine,
            timings=LeaseTimings(claim_s=3600, ack_s=3600, lease_s=3600, liveness_s=3600),
        )

    async def reopen(self) -> None:
        """Close every connection (flushing their statistics) and start a new pool."""
        await self.engine.dispose()

    async def timed(self, name: str, count: int, coro: Awaitable[T]) -> T:
        start = time.perf_counter()
        result = await coro
        elapsed = time.perf_counter() - start
        self.results.append((name, count, elapsed))
        return result

    async def setup(self) -> tuple[dict[str, Session], str, str]:
        owner = f"bench-{self.tag}"
        project = f"bench-{self.tag}"
        await self.repo.add_user(owner)
        await self.repo.add_project(project, owner=owner)
        per_host = -(-self.n // self.n_hosts)
        sessions = {}
        for i in range(self.n_hosts):
            host_id = f"bench-{self.tag}-{i}"
            credential = await self.repo.add_host(host_id)
            session = await self.repo.register_session(host_id, credential)
            await self.repo.heartbeat(
                session, [DeviceSnapshot(device_id=f"d{j}") for j in range(per_host)]
            )
            sessions[host_id] = session
        return sessions, owner, project

    async def run(self) -> None:
        await upgrade(self.url)
        async with self.engine.connect() as conn:
            self.sync_commit = (await conn.execute(sa.text("SHOW synchronous_commit"))).scalar()
        sessions, owner, project = await self.setup()
        await self.reopen()
        commits_before = await _commits(self.url)

        specs = [
            TaskSpec(
                kind=TaskKind.GOAL,
                goal="bench",
                payload={"i": i},
                project=project,
                owner=owner,
                retry=RetryPolicy(max_attempts=3),
            )
            for i in range(self.n)
        ]
        chunks = [specs[i : i + 500] for i in range(0, self.n, 500)]
        await self.timed(
            "submit (submit_many x500)",
            self.n,
            _bounded(4, [lambda c=c: self.repo.submit_many(c) for c in chunks]),  # type: ignore[misc]
        )

        async def assign_all() -> list[Assignment]:
            out: list[Assignment] = []
            while len(out) < self.n:
                got = await self.repo.assign(limit=64)
                if not got:
                    raise RuntimeError("assign stalled: not enough idle devices")
                out.extend(got)
            return out

        assignments = await self.timed("assign (64 per transaction)", self.n, assign_all())
        claimed: list[Claimed] = await self.timed(
            "claim",
            self.n,
            _bounded(
                self.concurrency,
                [
                    lambda a=a: self.repo.claim(sessions[a.host_id], a.task_id, a.attempt)  # type: ignore[misc]
                    for a in assignments
                ],
            ),
        )
        await self.timed(
            "ack",
            self.n,
            _bounded(
                self.concurrency,
                [
                    lambda c=c: self.repo.ack(
                        sessions[c.host_id], c.task_id, c.attempt, c.lease_token
                    )  # type: ignore[misc]
                    for c in claimed
                ],
            ),
        )
        renewals = [
            Renewal(
                session=sessions[c.host_id],
                task_id=c.task_id,
                attempt=c.attempt,
                lease_token=c.lease_token,
            )
            for c in claimed
        ]
        batches = [renewals[i : i + self.batch] for i in range(0, self.n, self.batch)]
        await self.timed(
            f"renew (renew_many x{self.batch})",
            self.n,
            _bounded(self.concurrency, [lambda b=b: self.repo.renew_many(b) for b in batches]),  # type: ignore[misc]
        )
        await self.timed(
            "report_result (done)",
            self.n,
            _bounded(
                self.concurrency,
                [
                    lambda c=c: self.repo.report_result(  # type: ignore[misc]
                        sessions[c.host_id],
                        c.task_id,
                        c.attempt,
                        c.lease_token,
                        outcome=Outcome.DONE,
                        fingerprint="bench",
                    )
                    for c in claimed
                ],
            ),
        )
        await self.reopen()
        lifecycle_commits = await _commits(self.url) - commits_before

        # Single renewals, measured apart from the lifecycle (a second set of tasks).
        second = await self.repo.submit_many(specs[: min(self.n, 2000)])
        got: list[Assignment] = []
        while len(got) < len(second):
            got.extend(await self.repo.assign(limit=64))
        live = await _bounded(
            self.concurrency,
            [lambda a=a: self.repo.claim(sessions[a.host_id], a.task_id, a.attempt) for a in got],  # type: ignore[misc]
        )
        await _bounded(
            self.concurrency,
            [
                lambda c=c: self.repo.ack(sessions[c.host_id], c.task_id, c.attempt, c.lease_token)  # type: ignore[misc]
                for c in live
            ],
        )
        await self.timed(
            "renew (single)",
            len(live),
            _bounded(
                self.concurrency,
                [
                    lambda c=c: self.repo.renew(
                        sessions[c.host_id], c.task_id, c.attempt, c.lease_token
                    )  # type: ignore[misc]
                    for c in live
                ],
            ),
        )
        for host_id in sessions:
            await self.repo.revoke_host(host_id)  # leaves nothing leased behind
        await self.engine.dispose()
        self.report(lifecycle_commits)

    def report(self, lifecycle_commits: int) -> None:
        print(f"database: {redact(self.url)} (synchronous_commit={self.sync_commit})")
        print(
            f"tasks: {self.n}  hosts: {self.n_hosts}  concurrency: {self.concurrency}  "
            f"renew batch: {self.batch}"
        )
        print(f"{'operation':<32}{'count':>8}{'seconds':>10}{'per second':>12}")
        for name, count, elapsed in self.results:
            rate = count / elapsed if elapsed > 0 else float("inf")
            print(f"{name:<32}{count:>8}{elapsed:>10.3f}{rate:>12.0f}")
        print(
            "commits per task over a whole lifecycle (submit_many, assign, claim, ack, "
            f"renew_many, report): {lifecycle_commits / self.n:.2f}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=200, help="renewals per renew_many")
    args: Any = parser.parse_args(argv)
    bench = Bench(args.database_url, args.tasks, args.hosts, args.concurrency, args.batch)
    asyncio.run(bench.run())


if __name__ == "__main__":
    main()
