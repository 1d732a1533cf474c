"""Transport benchmark: figures printed, nothing asserted.

    python -m fleetlease.ops.bench.transport --database-url URL --nats-url URL

Runs a real ``ControlPlaneService`` (actors, repository, NATS handlers) in this
process against the given PostgreSQL server (in a scratch database created and
dropped here, unless ``--in-place``) and NATS, with real ``HostClient`` hosts,
and prints:

* round trip of renew and of result through NATS, the actors and PostgreSQL
  (p50/p99, sequential requests of one host);
* latency from the assignment's commit (the Scheduler's ``assigned`` event,
  emitted after the commit) to the host's long-poll reply (p50/p99);
* requests per second sustained per channel (control: heartbeats, jobs:
  renewals, logs: 100-line batches, artifacts: 64 KiB chunks), many in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetlease.ops.bench.measure import admin, pct, with_database
from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.model import LeaseTimings, TaskKind, TaskSpec
from fleetlease.transport import wire
from fleetlease.transport.client import HostClient
from fleetlease.transport.server import DEFAULT_CHANNELS
from fleetlease.transport.staging import StagingLimits
from fleetlease.transport.subjects import Channel


def line(name: str, samples_s: list[float]) -> str:
    ms = [s * 1000 for s in samples_s]
    return (
        f"  {name:<34} n={len(ms):<6} p50={pct(ms, 50):7.2f} ms  p99={pct(ms, 99):7.2f} ms"
        f"  mean={statistics.fmean(ms) if ms else float('nan'):7.2f} ms"
    )


class Bench:
    def __init__(self, svc: ControlPlaneService, nats_url: str) -> None:
        self.svc = svc
        self.nats_url = nats_url
        self.assigned_at: dict[str, float] = {}
        svc.control_plane.add_listener(self._on_event)

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("state") == "assigned":
            self.assigned_at.setdefault(str(event["task_id"]), time.perf_counter())

    async def host(self, host_id: str, devices: int) -> HostClient:
        assert self.svc.repo is not None
        cred = await self.svc.repo.add_host(host_id)
        c = HostClient(
            nats_url=self.nats_url, host_id=host_id, credential=cred, prefix=self.svc.prefix
        )
        await c.connect()
        await c.register()
        await c.heartbeat([wire.Device(device_id=f"{host_id}-d{i}") for i in range(devices)])
        return c

    async def submit(self) -> str:
        task_id: str = await self.svc.control_plane.submit(TaskSpec(kind=TaskKind.GOAL, goal="b"))
        return task_id


async def _timed(request: Awaitable[Any]) -> float:
    """Time one request; the coroutine does not start before it is awaited here."""
    t0 = time.perf_counter()
    await request
    return time.perf_counter() - t0


async def _rate(n: int, concurrency: int, fn: Callable[[int], Awaitable[Any]]) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await fn(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> None:
    db_url = args.database_url
    scratch = None
    if not args.in_place:
        scratch = f"fl_bench_{uuid.uuid4().hex[:10]}"
        await admin(db_url, f'CREATE DATABASE "{scratch}"')
        db_url = with_database(db_url, scratch)
    state = Path(tempfile.mkdtemp(prefix="fleetlease-bench-"))
    prefix = args.prefix or f"bench{uuid.uuid4().hex[:8]}"
    svc = ControlPlaneService(
        database_url=db_url,
        nats_url=args.nats_url,
        state_dir=state,
        prefix=prefix,
        timings=LeaseTimings(claim_s=60, ack_s=60, lease_s=120, liveness_s=600),
        scheduler_interval_s=1.0,
        # The bench's one host sends every chunk request at once.
        staging=StagingLimits(host_in_flight=max(args.concurrency, 1)),
        # One host sends --concurrency heartbeats at once: over a real host's
        # budget (which answers them busy), not what this bench measures.
        channels={
            Channel.CONTROL: replace(
                DEFAULT_CHANNELS[Channel.CONTROL],
                principal_requests=max(args.concurrency, 1) * 2,
                principal_bytes=64 * 1024 * 1024,
            )
        },
    )
    await svc.start()
    clients: list[HostClient] = []
    try:
        assert svc.repo is not None
        await svc.repo.add_user("admin", platform_admin=True)
        await svc.repo.add_project("default", owner="admin")
        b = Bench(svc, args.nats_url)
        h = await b.host("bench-h1", devices=args.devices)
        clients.append(h)
        print(f"fleetlease transport benchmark (prefix {prefix}, {args.samples} samples each)")

        # 1. assignment commit -> long-poll reply, with the claim parked first.
        wake: list[float] = []
        running: list[wire.Assignment] = []
        for _ in range(args.samples):
            poll = asyncio.ensure_future(h.claim(wait_s=30))
            await _until_parked(svc)
            task_id = await b.submit()
            a = await poll
            got = time.perf_counter()
            assert a is not None and a.task_id == task_id
            wake.append(got - b.assigned_at[task_id])
            await h.ack(a.task_id, a.attempt, a.lease_token)
            running.append(a)
            if len(running) >= args.devices:
                # Free the devices again for the next samples.
                for r in running:
                    await h.result(r.task_id, r.attempt, r.lease_token, outcome="done",
                                   fingerprint="x")  # fmt: skip
                running.clear()
                await h.heartbeat(
                    [wire.Device(device_id=f"bench-h1-d{i}") for i in range(args.devices)]
                )
        # 2. renew and result round trips.
        while len(running) < min(args.devices, 8):
            await b.submit()
            a = await h.claim(wait_s=30)
            assert a is not None
            await h.ack(a.task_id, a.attempt, a.lease_token)
            running.append(a)
        renew: list[float] = []
        for i in range(args.samples):
            r = running[i % len(running)]
            renew.append(await _timed(h.renew(r.task_id, r.attempt, r.lease_token)))
        result: list[float] = []
        for r in running:
            result.append(
                await _timed(
                    h.result(r.task_id, r.attempt, r.lease_token, outcome="done", fingerprint="y")
                )
            )
        running.clear()
        while len(result) < args.samples:
            await b.submit()
            a = await h.claim(wait_s=30)
            assert a is not None
            await h.ack(a.task_id, a.attempt, a.lease_token)
            result.append(
                await _timed(
                    h.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="z")
                )
            )
        print("latency (one host, sequential requests):")
        print(line("assignment commit -> long-poll", wake))
        print(line("renew round trip", renew))
        print(line("result round trip", result))

        # 3. requests per second per channel, many in flight.
        for _ in range(args.devices):
            await b.submit()
        live: list[wire.Assignment] = []
        while len(live) < args.devices:
            a = await h.claim(wait_s=30)
            assert a is not None
            await h.ack(a.task_id, a.attempt, a.lease_token)
            live.append(a)
        n, conc = args.requests, args.concurrency
        devices = [wire.Device(device_id=f"bench-h1-d{i}") for i in range(args.devices)]
        chunk = os.urandom(64 * 1024)

        def artifact_chunk(i: int) -> Awaitable[Any]:
            return h._signed(
                Channel.ARTIFACTS,
                h.subjects.artifact_chunk(h.host_id),
                wire.ArtifactChunk(
                    task_id=live[0].task_id,
                    attempt=live[0].attempt,
                    lease_token=live[0].lease_token,
                    name="bench",
                    offset=(i % 1024) * wire.ARTIFACT_CHUNK_BYTES,
                    data=chunk,
                ),
                wire.Ok,
            )

        await artifact_chunk(0)  # an upload starts at offset 0
        lines = [f"log line {i:04d} " + "x" * 60 for i in range(100)]
        rates = {
            "control (heartbeat)": await _rate(n, conc, lambda i: h.heartbeat(devices)),
            "jobs (renew)": await _rate(
                n,
                conc,
                lambda i: h.renew(
                    live[i % len(live)].task_id,
                    live[i % len(live)].attempt,
                    live[i % len(live)].lease_token,
                ),
            ),
            "logs (100-line batch)": await _rate(
                n,
                conc,
                lambda i: h.append_logs(live[0].task_id, live[0].attempt, i * 100, lines),
            ),
            "artifacts (64 KiB chunk)": await _rate(max(n // 4, 1), conc, artifact_chunk),
        }
        print(f"throughput ({n} requests per channel, {conc} in flight):")
        for name, rate in rates.items():
            print(f"  {name:<34} {rate:9.0f} req/s")
    finally:
        for c in clients:
            await c.close()
        if svc.server is not None:
            with contextlib.suppress(Exception):
                await svc.server.delete_storage()
        await svc.stop()
        if scratch is not None:
            await admin(args.database_url, f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')


async def _until_parked(svc: ControlPlaneService, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (svc.server.in_flight(Channel.JOBS) and svc.control_plane.metrics["inflight"]):
        if time.monotonic() > deadline:
            raise RuntimeError("the claim never reached the control plane")
        await asyncio.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fleetlease.ops.bench.transport",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--database-url", required=True, help="PostgreSQL server URL")
    p.add_argument("--nats-url", required=True, help="NATS URL")
    p.add_argument("--prefix", help="subject prefix (default: a fresh one)")
    p.add_argument("--samples", type=int, default=300, help="latency samples per figure")
    p.add_argument("--requests", type=int, default=4000, help="requests per channel")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--devices", type=int, default=16, help="devices of the benchmark host")
    p.add_argument(
        "--in-place", action="store_true", help="use the given database, not a scratch one"
    )
    args = p.parse_args(argv)
    from fleetlease.ops.logging import configure_logging

    configure_logging(json=True)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
