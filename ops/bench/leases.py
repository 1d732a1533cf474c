"""The renewal and recovery cells of ``fleetlease bench``: leases held by bare
``HostClient`` hosts, renewed in a burst and paced; then the control plane
killed and restarted under them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fleetlease.ops.bench.fleet import (
    Fleet,
    ServeProcess,
    add_hosts,
    revoke_hosts,
    submit,
    with_repo,
)
from fleetlease.ops.bench.measure import bounded, latency_ms, xact_commit
from fleetlease.ops.bench.options import BenchError, BenchOptions, say

_TAKE_RETRIES = 5
#: How long the renewal cell measures the control plane holding its leases idle.
_IDLE_S = 5.0

T = TypeVar("T")


@dataclass
class _Lease:
    client: Any
    task_id: str
    attempt: int
    token: str
    renewed_at: float = 0.0


async def lease_cells(opts: BenchOptions, fleet: Fleet) -> dict[str, Any]:
    """The renewal cell, then the recovery cell on the same control plane."""
    from fleetlease.ops.client import OpsClient
    from fleetlease.transport import wire
    from fleetlease.transport.client import HostClient

    k = opts.renew_leases
    if k == 0:
        return {"renewals": None, "recovery": None}
    per_host = 1000
    host_ids = [f"rn-{i}" for i in range(math.ceil(k / per_host))]
    creds = await add_hosts(fleet.db_url, host_ids)
    state = fleet.work / "serve-leases"
    state.mkdir()
    serve = ServeProcess(
        database_url=fleet.db_url,
        nats_url=fleet.nats_url,
        state_dir=state,
        prefix=fleet.prefix,
        token=fleet.token,
        # Long enough to outlast leasing every task (the first leases must not
        # expire while the last are claimed); renewals cost the same whatever it is.
        lease_s=max(600.0, 3 * opts.renew_period_s),
        claim_s=600.0,
        ack_s=600.0,
        liveness_s=3600.0,
    )
    serve.spawn()
    clients: list[HostClient] = []
    try:
        await serve.ready()
        for i, h in enumerate(host_ids):
            c = HostClient(
                nats_url=fleet.nats_url,
                host_id=h,
                credential=creds[h],
                prefix=fleet.prefix,
                timeout_s=30.0,
            )
            await c.connect()
            clients.append(c)
            await c.register()
            n_dev = min(per_host, k - i * per_host)
            await c.heartbeat([wire.Device(device_id=f"{h}-d{j}") for j in range(n_dev)])
        await asyncio.sleep(1.0)
        rss_before = serve.rss()
        say(opts, f"renewals: leasing {k} tasks")
        async with OpsClient(
            nats_url=fleet.nats_url, token=fleet.token, prefix=fleet.prefix, timeout_s=60.0
        ) as ops:
            await submit(ops, k, batch=1000)
        leases: list[_Lease] = []
        # A request that times out (``unavailable``) is retried, as an agent
        # does, instead of failing the cell: an ack is idempotent; a claim
        # whose reply was lost may have committed, leaving that task claimed
        # by nobody until its claim deadline, so a host stops polling once
        # every task it was given is leased or may have been lost that way.
        lost_claims = 0

        async def retrying(call: Callable[[], Awaitable[T]]) -> T:
            for _ in range(_TAKE_RETRIES):
                try:
                    return await call()
                except Exception as exc:
                    if getattr(exc, "code", None) != "unavailable":
                        raise
            return await call()

        async def renew(lease: _Lease) -> None:
            await retrying(lambda: lease.client.renew(lease.task_id, lease.attempt, lease.token))

        async def take(c: HostClient, host: dict[str, int]) -> None:
            nonlocal lost_claims
            while host["got"] + host["suspect"] < host["want"]:
                try:
                    a = await c.claim(5.0)
                except Exception as exc:
                    if getattr(exc, "code", None) != "unavailable":
                        raise
                    host["suspect"] += 1
                    lost_claims += 1
                    continue
                if a is None:
                    continue
                await retrying(functools.partial(c.ack, a.task_id, a.attempt, a.lease_token))
                leases.append(_Lease(c, a.task_id, a.attempt, a.lease_token))
                host["got"] += 1
                if host["suspect"]:
                    # That claim had not committed after all: poll for it again.
                    host["suspect"] -= 1
                    lost_claims -= 1

        t_lease = time.monotonic()
        jobs: list[Awaitable[None]] = []
        for i, c in enumerate(clients):
            want = min(per_host, k - i * per_host)
            # A few claims in flight per host.
            host = {"want": want, "got": 0, "suspect": 0}
            jobs.extend(take(c, host) for _ in range(min(8, want)))
        await asyncio.gather(*jobs)
        t_lease = time.monotonic() - t_lease
        await asyncio.sleep(1.0)
        rss_full = serve.rss()
        # What holding the leases costs with no traffic (timers, the watchdog,
        # the garbage collector), apart from what each renewal costs.
        cpu0, t0 = serve.cpu_s(), time.monotonic()
        await asyncio.sleep(_IDLE_S)
        idle_cores = (serve.cpu_s() - cpu0) / (time.monotonic() - t0)

        # Renewals as fast as they go.
        say(opts, f"renewals: burst for {opts.renew_burst_s:.0f} s")
        done = 0
        stop_at = time.monotonic() + opts.renew_burst_s
        cursor = 0

        async def renewer() -> None:
            nonlocal done, cursor
            while time.monotonic() < stop_at:
                lease = leases[cursor % len(leases)]
                cursor += 1
                await renew(lease)
                done += 1

        commits0 = await xact_commit(fleet.db_url)
        cpu0, t0 = serve.cpu_s(), time.monotonic()
        await asyncio.gather(*(renewer() for _ in range(min(128, len(leases)))))
        burst_wall = time.monotonic() - t0
        burst_cpu = serve.cpu_s() - cpu0
        burst_rate = done / burst_wall
        # Statistics reach pg_stat_database at most once a second per backend.
        await asyncio.sleep(1.5)
        commits = await xact_commit(fleet.db_url) - commits0

        # Each lease once per period, spread evenly.
        period = opts.renew_period_s
        say(opts, f"renewals: {len(leases)} leases every {period:.0f} s")
        renew_lat: list[float] = []

        async def paced(i: int, lease: _Lease, t_start: float) -> None:
            await asyncio.sleep(max(0.0, t_start + period * i / len(leases) - time.monotonic()))
            t = time.perf_counter()
            await renew(lease)
            renew_lat.append(time.perf_counter() - t)

        commits0 = await xact_commit(fleet.db_url)
        cpu0, t0 = serve.cpu_s(), time.monotonic()
        await asyncio.gather(*(paced(i, le, t0) for i, le in enumerate(leases)))
        paced_wall = time.monotonic() - t0
        paced_cpu = serve.cpu_s() - cpu0
        await asyncio.sleep(1.5)
        paced_commits = await xact_commit(fleet.db_url) - commits0
        renewals = {
            "leases": len(leases),
            "lease_and_ack_s": round(t_lease, 2),
            "claim_timeouts_unrecovered": lost_claims,
            "rss_per_lease_kib": round((rss_full - rss_before) / len(leases) / 1024, 2),
            "burst_renewals_per_s": round(burst_rate, 1),
            "burst_cpu_s_per_renewal": round(burst_cpu / max(done, 1), 6),
            "burst_commits_per_renewal": round(commits / max(done, 1), 3),
            "period_s": period,
            "paced_renewals_per_s": round(len(leases) / paced_wall, 1),
            "paced_control_plane_cpu_cores": round(paced_cpu / paced_wall, 3),
            "idle_control_plane_cpu_cores": round(idle_cores, 3),
            "paced_commits_per_renewal": round(paced_commits / max(len(leases), 1), 3),
            "paced_round_trip": latency_ms(renew_lat),
        }

        # Recovery: keep R leases, finish the rest.
        r = opts.recovery_leases
        keep, finish = leases[:r], leases[r:]
        await bounded(
            64,
            [
                lambda le=le: le.client.result(  # type: ignore[misc]
                    le.task_id, le.attempt, le.token, outcome="done", fingerprint="bench"
                )
                for le in finish
            ],
        )
        recovery = await _recovery(opts, fleet, serve, keep) if keep else None
        return {"renewals": renewals, "recovery": recovery}
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        await serve.stop()
        await revoke_hosts(fleet.db_url, host_ids)


async def _recovery(
    opts: BenchOptions, fleet: Fleet, serve: ServeProcess, keep: list[_Lease]
) -> dict[str, Any]:
    say(opts, f"recovery: SIGKILL with {len(keep)} active leases")
    t_kill = time.monotonic()
    serve.kill()
    serve.spawn()
    restart_s = await serve.ready()

    async def renew_until_ok(lease: _Lease) -> None:
        while True:
            try:
                await lease.client.renew(lease.task_id, lease.attempt, lease.token)
            except Exception as exc:
                if getattr(exc, "code", None) not in ("unavailable", "internal"):
                    raise BenchError(f"a lease was refused after the restart: {exc}") from exc
                await asyncio.sleep(0.02)
                continue
            lease.renewed_at = time.monotonic()
            return

    await bounded(256, [lambda le=le: renew_until_ok(le) for le in keep])  # type: ignore[misc]
    recovered_s = max(le.renewed_at for le in keep) - t_kill
    await bounded(
        64,
        [
            lambda le=le: le.client.result(  # type: ignore[misc]
                le.task_id, le.attempt, le.token, outcome="done", fingerprint="bench"
            )
            for le in keep
        ],
    )
    ids = [le.task_id for le in keep]

    async def check(repo: Any) -> tuple[int, int]:
        import sqlalchemy as sa

        from fleetlease.persistence.tables import attempts, tasks

        async with repo.engine.connect() as conn:
            done = (
                await conn.execute(
                    sa.select(sa.func.count())
                    .select_from(tasks)
                    .where(tasks.c.id.in_(ids), tasks.c.status == "done")
                )
            ).scalar_one()
            twice = (
                await conn.execute(
                    sa.select(sa.func.count()).select_from(
                        sa.select(attempts.c.task_id)
                        .where(attempts.c.task_id.in_(ids))
                        .group_by(attempts.c.task_id)
                        .having(sa.func.count() > 1)
                        .subquery()
                    )
                )
            ).scalar_one()
        return int(done), int(twice)

    done, twice = await with_repo(fleet.db_url, check)
    return {
        "leases": len(keep),
        "restart_s": round(restart_s, 3),
        "all_leases_served_s": round(recovered_s, 3),
        "lost": len(keep) - done,
        "duplicated": twice,
    }
