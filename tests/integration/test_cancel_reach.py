"""A user's cancel of a running attempt reaches the host on its next renewal
even with queued-task work stuck in front of everything else: the cancel is
written by the task's own Lease actor in a transaction of its own, never
through the Scheduler nor a group-commit batch. Real PostgreSQL, the
ControlPlane facade, in-process hosts; conditions, no timings (the time it
takes under load is measured by ``fleetlease bench``'s cancel-reach cell)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pykka
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.actors import failpoints
from fleetlease.actors.runtime import ControlPlane
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.model import LeaseTimings, Outcome, TaskState, User
from fleetlease.persistence.repository import Repository
from tests.chaos.harness import SimHost, spec, task_state, wait_until

TIMINGS = LeaseTimings(claim_s=30, ack_s=15, lease_s=30, liveness_s=1_000_000)
ADMIN = User(name="admin", platform_admin=True)
BACKLOG = 2000


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    yield
    failpoints.disarm()
    pykka.ActorRegistry.stop_all(timeout=30)


@pytest.fixture
async def cp(engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[ControlPlane]:
    repo = Repository(engine, clock, TIMINGS)
    await repo.add_user("admin", platform_admin=True)
    await repo.add_project("default", owner="admin")
    plane = ControlPlane(repo, scheduler_interval_s=0.5)
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop()


async def _running(cp: ControlPlane, engine: AsyncEngine, host: SimHost) -> Any:
    """A task submitted and running on ``host`` (its one device)."""
    task_id = await cp.submit(spec())

    async def assigned() -> bool:
        return await task_state(engine, task_id) == "assigned"

    await wait_until(assigned, what=f"task {task_id} assigned")
    c = await host.claim()
    assert c is not None and c.task_id == task_id
    assert (await host.ack(c)).state is TaskState.RUNNING
    return c


async def _waits_for_a_lock(engine: AsyncEngine) -> bool:
    async with engine.connect() as c:
        n = (
            await c.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        ).scalar_one()
    return bool(n > 0)


async def test_a_cancel_reaches_the_next_renewal_while_the_scheduler_and_a_batch_are_stuck(
    cp: ControlPlane, engine: AsyncEngine
) -> None:
    h1 = await SimHost.create(cp, cp.repo, "h1")
    h2 = await SimHost.create(cp, cp.repo, "h2")
    a = await _running(cp, engine, h1)
    b = await _running(cp, engine, h2)

    gate = threading.Event()
    async with engine.connect() as blocker:
        # A group-commit batch stuck: b's result waits for b's row, locked here.
        await blocker.execute(
            text("SELECT 1 FROM tasks WHERE id = CAST(:id AS uuid) FOR UPDATE"), {"id": b.task_id}
        )
        stuck_result = asyncio.create_task(h2.report(b))
        try:
            await wait_until(lambda: _waits_for_a_lock(engine), what="b's result to wait")
            # The Scheduler parked in its assignment pass, thousands queued behind.
            failpoints.arm(failpoints.SCHEDULER_BEFORE_ASSIGN, pause=gate)
            for _ in range(BACKLOG // 1000):
                await cp.submit_many([spec() for _ in range(1000)])
            await wait_until(
                lambda: failpoints.paused(failpoints.SCHEDULER_BEFORE_ASSIGN) >= 1,
                what="the scheduler to park",
            )

            record = await asyncio.wait_for(cp.cancel(a.task_id, ADMIN), 60)
            assert not record.completed and record.state is TaskState.RUNNING
            # The host's next renewal (and a cancel poll) reports it.
            renewed = await asyncio.wait_for(h1.renew(a), 60)
            assert renewed.cancel_requested and renewed.state is TaskState.RUNNING
            assert not stuck_result.done()
            assert failpoints.paused(failpoints.SCHEDULER_BEFORE_ASSIGN) == 1
        finally:
            gate.set()
            failpoints.disarm(failpoints.SCHEDULER_BEFORE_ASSIGN)
            await blocker.rollback()
    assert (await stuck_result).state is TaskState.DONE
    assert (await h1.report(a, Outcome.CANCELLED)).state is TaskState.CANCELLED
    assert await task_state(engine, a.task_id) == "cancelled"
