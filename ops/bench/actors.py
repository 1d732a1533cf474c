"""Scale benchmark of the actor runtime (a measurement, not a test).

    python -m fleetlease.ops.bench.actors \
        --database-url postgresql://postgres@127.0.0.1:5432/postgres \
        --leases 5000 --seconds 15

Creates a scratch database on that server (dropped afterwards unless
``--keep``), registers hosts with enough devices, submits ``--leases`` tasks,
lets the Scheduler assign them (one Lease actor each), claims and acks them all,
then renews every lease in rounds for ``--seconds`` and prints:

* resident memory (RSS) per active Lease actor: RSS growth from an idle
  ControlPlane to one with every Lease actor running, divided by their number
  (the thread stack size in effect is printed with it);
* renewals per second sustained with all leases active (every renewal is a
  fenced, committed transaction; group commit batches them through
  ``renew_many``), and the mean batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import threading
import time
import uuid
from collections.abc import Sequence

import psutil
from sqlalchemy.engine import make_url

from fleetlease.actors.runtime import DEFAULT_STACK_SIZE, ControlPlane
from fleetlease.ops.bench.measure import admin
from fleetlease.persistence.db import async_url, create_engine
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.migrate import upgrade
from fleetlease.persistence.model import (
    Claimed,
    DeviceSnapshot,
    LeaseTimings,
    Session,
    TaskKind,
    TaskSpec,
)
from fleetlease.persistence.repository import Repository


def _rss() -> int:
    gc.collect()
    return int(psutil.Process(os.getpid()).memory_info().rss)


async def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _retry(coro_fn: object) -> object:
    for _ in range(100):
        try:
            return await coro_fn()  # type: ignore[operator]
        except Unavailable:
            await asyncio.sleep(0.01)
    raise SystemExit("still unavailable after 100 retries")


async def bench(url: str, leases: int, seconds: float, devices_per_host: int) -> None:
    timings = LeaseTimings(claim_s=3600, ack_s=3600, lease_s=3600, liveness_s=3600)
    engine = create_engine(url, pool_size=20, max_overflow=20)
    repo = Repository(engine, timings=timings)
    await repo.add_user("bench", platform_admin=True)
    await repo.add_project("bench", owner="bench")
    cp = ControlPlane(repo, scheduler_interval_s=1.0, assign_batch=256)
    await cp.start()
    try:
        n_hosts = -(-leases // devices_per_host)
        sessions: list[Session] = []
        for h in range(n_hosts):
            host_id = f"bench-h{h}"
            cred = await repo.add_host(host_id)
            sessions.append(await cp.register(host_id, cred))
        rss_idle = _rss()
        threads_idle = threading.active_count()

        t0 = time.monotonic()
        specs = [
            TaskSpec(kind=TaskKind.GOAL, goal="bench", project="bench", owner="bench")
            for _ in range(leases)
        ]
        for i in range(0, leases, 500):
            await cp.submit_many(specs[i : i + 500])
        for h, s in enumerate(sessions):
            devices = [DeviceSnapshot(device_id=f"d{d}") for d in range(devices_per_host)]
            await cp.heartbeat(s, devices)
            del h
        await _wait(lambda: cp.metrics["lease_actors"] >= leases, 600, "every Lease actor")
        t_assign = time.monotonic() - t0
        rss_full = _rss()
        threads_full = threading.active_count()

        t0 = time.monotonic()
        claimed: list[tuple[Session, Claimed]] = []

        async def claim_all(s: Session) -> None:
            while True:
                c = await _retry(lambda: cp.claim(s, wait_s=0))
                if c is None:
                    return
                assert isinstance(c, Claimed)
                await _retry(lambda c=c: cp.ack(s, c.task_id, c.attempt, c.lease_token))
                claimed.append((s, c))

        await asyncio.gather(*(claim_all(s) for s in sessions))
        t_claim = time.monotonic() - t0

        renewals = 0
        batches_before = cp.metrics.get("renew_batches", 0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            await asyncio.gather(
                *(cp.renew(s, c.task_id, c.attempt, c.lease_token) for s, c in claimed)
            )
            renewals += len(claimed)
        elapsed = time.monotonic() - t0
        batches = cp.metrics.get("renew_batches", 0) - batches_before

        per_lease = (rss_full - rss_idle) / max(cp.metrics["lease_actors"], 1)
        print(
            f"active leases            {len(claimed)} (Lease actors {cp.metrics['lease_actors']})"
        )
        print(f"thread stack size        {threading.stack_size() // 1024} KiB")
        print(f"threads                  {threads_idle} idle -> {threads_full} with leases")
        print(f"RSS                      {rss_idle / 2**20:.1f} MiB -> {rss_full / 2**20:.1f} MiB")
        print(f"RSS per Lease actor      {per_lease / 1024:.1f} KiB")
        print(f"assign {leases} tasks       {t_assign:.1f} s; claim+ack all {t_claim:.1f} s")
        print(f"renewals/s sustained     {renewals / elapsed:.0f} ({renewals} in {elapsed:.1f} s)")
        if batches:
            print(f"mean renew batch         {renewals / batches:.1f} renewals per transaction")
    finally:
        await cp.stop(grace_s=60)
        await engine.dispose()


async def main_async(args: argparse.Namespace) -> None:
    name = f"fl_bench_{uuid.uuid4().hex[:10]}"
    await admin(args.database_url, f'CREATE DATABASE "{name}"')
    url = make_url(async_url(args.database_url)).set(database=name)
    db_url = url.render_as_string(hide_password=False)
    try:
        await upgrade(db_url)
        await bench(db_url, args.leases, args.seconds, args.devices_per_host)
    finally:
        if not args.keep:
            await admin(args.database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fleetlease.ops.bench.actors", description=__doc__)
    p.add_argument("--database-url", required=True, help="a server where we may create a DB")
    p.add_argument("--leases", type=int, default=5000)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--devices-per-host", type=int, default=100)
    p.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = p.parse_args(argv)
    if args.leases < 1 or args.seconds <= 0 or args.devices_per_host < 1:
        p.error("--leases, --seconds and --devices-per-host must be positive")
    threading.stack_size(DEFAULT_STACK_SIZE)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
