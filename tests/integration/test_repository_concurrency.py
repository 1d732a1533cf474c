"""Real concurrency on separate connections: races are decided by the database.
Every assertion reads the tables, not only the return values."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict

import pytest

from fleetlease.persistence.errors import Conflict
from fleetlease.persistence.model import (
    Claimed,
    DeviceSnapshot,
    Outcome,
    RetryPolicy,
    TaskKind,
    TaskSpec,
)
from fleetlease.persistence.repository import Renewal
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


async def test_fifty_concurrent_claims_of_one_assignment_have_exactly_one_winner(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    a = await world.assigned(session)

    results = await asyncio.gather(
        *(world.repo.claim(session, a.task_id, a.attempt) for _ in range(50)),
        return_exceptions=True,
    )

    winners = [r for r in results if isinstance(r, Claimed)]
    losers = [r for r in results if not isinstance(r, Claimed)]
    assert len(winners) == 1
    assert len(losers) == 49 and all(isinstance(r, Conflict) for r in losers)
    (attempt,) = await world.attempt_rows(a.task_id)
    assert attempt["lease_token_hash"] is not None
    assert attempt["claimed_at"] == world.clock.now()
    assert (await world.task_row(a.task_id))["status"] == "dispatched"


async def test_fifty_concurrent_claim_next_polls_hand_out_each_assignment_once(
    world: World,
) -> None:
    session = await world.host("h1", [f"d{i}" for i in range(10)])
    for _ in range(10):
        await world.submit(selector={"host": "h1"})
    assert len(await world.repo.assign()) == 10

    results = await asyncio.gather(*(world.repo.claim_next(session) for _ in range(50)))

    claimed = [r for r in results if r is not None]
    assert len(claimed) == 10
    assert len({c.task_id for c in claimed}) == 10


async def _check_reservation_invariants(w: World) -> None:
    """No device and no task holds two active reservations or two open attempts,
    and every reservation belongs to the task's current active attempt."""
    dup_devices = await w.rows(
        "SELECT host_id, device_id FROM attempts WHERE ended_at IS NULL "
        "GROUP BY host_id, device_id HAVING count(*) > 1"
    )
    dup_tasks = await w.rows(
        "SELECT task_id FROM attempts WHERE ended_at IS NULL GROUP BY task_id HAVING count(*) > 1"
    )
    assert dup_devices == [] and dup_tasks == []
    mismatched = await w.rows(
        "SELECT r.task_id FROM device_reservations r JOIN tasks t ON t.id = r.task_id "
        "LEFT JOIN attempts a ON a.task_id = r.task_id AND a.number = r.attempt "
        "WHERE t.status NOT IN ('assigned', 'dispatched', 'running') OR t.attempt <> r.attempt "
        "OR a.ended_at IS NOT NULL OR a.host_id <> r.host_id OR a.device_id <> r.device_id"
    )
    assert mismatched == []
    unreserved = await w.rows(
        "SELECT t.id FROM tasks t WHERE t.status IN ('assigned', 'dispatched', 'running') "
        "AND NOT EXISTS (SELECT 1 FROM device_reservations r WHERE r.task_id = t.id)"
    )
    assert unreserved == []


async def test_eight_concurrent_assigners_over_500_tasks_and_50_devices_never_double_reserve(
    world: World,
) -> None:
    hosts = {}
    for h in range(5):
        hosts[f"h{h}"] = await world.host(f"h{h}", [f"d{i}" for i in range(10)])
    specs = [
        TaskSpec(
            kind=TaskKind.GOAL,
            goal="g",
            project=("p1", "p2")[i % 2],
            owner=("alice", "bob")[i % 2],
            priority=i % 3,
            retry=RetryPolicy(max_attempts=100, backoff_base_s=0, backoff_cap_s=0),
        )
        for i in range(500)
    ]
    for chunk in range(0, 500, 100):
        await world.repo.submit_many(specs[chunk : chunk + 100])

    for _round in range(40):
        batches = await asyncio.gather(*(world.repo.assign(limit=16) for _ in range(8)))
        got = [a for batch in batches for a in batch]
        assert len({(a.host_id, a.device_id) for a in got}) == len(got)
        assert len({a.task_id for a in got}) == len(got)
        await _check_reservation_invariants(world)
        reservations = await world.reservations()
        assert len(reservations) == len(got) <= 50

        # Complete most of them concurrently; let every fifth first attempt expire.
        async def finish(session_host: str, task_id: str, attempt: int) -> None:
            s = hosts[session_host]
            c = await world.repo.claim(s, task_id, attempt)
            await world.repo.ack(s, task_id, attempt, c.lease_token)
            await world.repo.report_result(
                s, task_id, attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
            )

        await asyncio.gather(
            *(
                finish(a.host_id, a.task_id, a.attempt)
                for i, a in enumerate(got)
                if i % 5 or a.attempt > 1
            )
        )
        world.clock.advance(31)
        for s in hosts.values():
            await world.beat(s, *[f"d{i}" for i in range(10)])
        await world.repo.expire_due()
        await _check_reservation_invariants(world)
        done = (await world.rows("SELECT count(*) AS n FROM tasks WHERE status = 'done'"))[0]
        if done["n"] == 500:
            break
    assert done["n"] == 500

    # Per device, attempt time ranges never overlap.
    per_device: dict[tuple[str, str], list[tuple[object, object]]] = defaultdict(list)
    for a in await world.rows(
        "SELECT host_id, device_id, assigned_at, ended_at FROM attempts ORDER BY assigned_at"
    ):
        per_device[(a["host_id"], a["device_id"])].append((a["assigned_at"], a["ended_at"]))
    assert len(per_device) == 50
    for ranges in per_device.values():
        for (start, end), (next_start, _) in itertools.pairwise(ranges):
            assert end is not None and start <= end <= next_start  # type: ignore[operator]
    assert await world.reservations() == []


async def test_concurrent_renewals_and_expiry_never_expire_a_committed_renewal(
    world: World,
) -> None:
    session = await world.host("h1", [f"d{i}" for i in range(20)])
    running = [await world.running(session) for _ in range(20)]
    world.clock.advance(29.5)

    renewals = [
        Renewal(session=session, task_id=c.task_id, attempt=c.attempt, lease_token=c.lease_token)
        for c in running
    ]
    results = await asyncio.gather(
        world.repo.renew_many(renewals[:10]),
        world.repo.renew_many(renewals[10:]),
        world.repo.expire_due(),
    )

    renewed = [r for batch in results[:2] for r in batch if not isinstance(r, Exception)]
    assert len(renewed) == 20 and results[2] == []
    world.clock.advance(29.9)
    assert await world.repo.expire_due() == []


async def test_heartbeats_and_assigners_racing_never_reserve_a_removed_device_twice(
    world: World,
) -> None:
    session = await world.host("h1", [f"d{i}" for i in range(10)])
    for _ in range(40):
        await world.submit(selector={"host": "h1"})

    await asyncio.gather(
        *(world.repo.assign(limit=4) for _ in range(6)),
        *(
            world.repo.heartbeat(
                session,
                [
                    DeviceSnapshot(device_id=f"d{i}", capabilities={"host": "h1"})
                    for i in range(k, 10)
                ],
            )
            for k in range(3)
        ),
    )

    await _check_reservation_invariants(world)
    assert len(await world.reservations()) <= 10
