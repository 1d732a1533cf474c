"""Fault: a renewal arriving exactly at the lease's expiry, racing the reaper's
expiry pass (real concurrent transactions; the clock is injected, so "exactly"
is exact).

Invariant: exactly one of renew or expire wins, every time: at the deadline the
renewal is refused (a message exactly at the deadline loses) and the expiry ends
the attempt once; a microsecond before it the renewal wins and the expiry finds
nothing, then or at the old deadline. Never both, never neither for good."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.testing.invariants import Observer, check
from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.errors import Conflict, Gone
from fleetlease.persistence.model import (
    DeviceSnapshot,
    LeaseStatus,
    LeaseTimings,
    Outcome,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
)
from fleetlease.persistence.repository import Repository

ROUNDS = 10
TIMINGS = LeaseTimings(claim_s=3, ack_s=2, lease_s=2, liveness_s=1_000_000)


async def running_attempt(repo: Repository, session: Session) -> tuple[str, int, str, LeaseStatus]:
    [task_id] = await repo.submit_many(
        [
            TaskSpec(
                kind=TaskKind.GOAL,
                goal="edge",
                project="default",
                owner="admin",
                retry=RetryPolicy(max_attempts=1, backoff_base_s=0),
            )
        ]
    )
    # The host reports its device idle again (after an expiry it stays busy
    # until the host says otherwise).
    await repo.heartbeat(session, [DeviceSnapshot(device_id="d0")])
    [a] = await repo.assign()
    claimed = await repo.claim(session, task_id, a.attempt)
    status = await repo.ack(session, task_id, claimed.attempt, claimed.lease_token)
    return task_id, claimed.attempt, claimed.lease_token, status


async def race(
    repo: Repository, session: Session, task_id: str, attempt: int, token: str
) -> tuple[LeaseStatus | BaseException, list[str]]:
    renewed, expired = await asyncio.gather(
        repo.renew(session, task_id, attempt, token), repo.expire_due(), return_exceptions=True
    )
    assert not isinstance(expired, BaseException), expired
    return renewed, [e.task_id for e in expired]


@pytest.fixture
async def setup(engine: AsyncEngine, clock: ManualClock) -> tuple[Repository, Session]:
    repo = Repository(engine, clock, TIMINGS)
    await repo.add_user("admin", platform_admin=True)
    await repo.add_project("default", owner="admin")
    credential = await repo.add_host("h1")
    session = await repo.register_session("h1", credential)
    await repo.heartbeat(session, [DeviceSnapshot(device_id="d0")])
    return repo, session


async def test_renewal_exactly_at_expiry_loses_and_the_expiry_wins_once(
    setup: tuple[Repository, Session], clock: ManualClock, engine: AsyncEngine
) -> None:
    repo, session = setup
    observer = Observer()
    for _ in range(ROUNDS):
        task_id, attempt, token, status = await running_attempt(repo, session)
        clock.set(status.lease_expires_at)
        renewed, expired = await race(repo, session, task_id, attempt, token)

        # Refused: lease_expired if it got the row first, gone if the expiry did.
        assert isinstance(renewed, Conflict | Gone), renewed
        if isinstance(renewed, Conflict):
            assert renewed.fields["reason"] == "lease_expired"
        # The expiry may have skipped the row the refused renewal held locked;
        # the next pass (same instant) ends it, and only once.
        if task_id not in expired:
            expired = [e.task_id for e in await repo.expire_due()]
        assert expired == [task_id]
        assert await repo.expire_due() == []
        with pytest.raises((Conflict, Gone)):
            await repo.renew(session, task_id, attempt, token)
        await observer.sample(engine)
    report = await check(engine, observer=observer)
    assert report.violations == []
    assert report.by_state == {"failed": ROUNDS}


async def test_renewal_a_microsecond_before_expiry_wins_and_nothing_expires(
    setup: tuple[Repository, Session], clock: ManualClock, engine: AsyncEngine
) -> None:
    repo, session = setup
    observer = Observer()
    for _ in range(ROUNDS):
        task_id, attempt, token, status = await running_attempt(repo, session)
        clock.set(status.lease_expires_at - timedelta(microseconds=1))
        renewed, expired = await race(repo, session, task_id, attempt, token)

        assert isinstance(renewed, LeaseStatus), renewed
        assert renewed.lease_expires_at > status.lease_expires_at
        assert expired == []
        clock.set(status.lease_expires_at)
        assert await repo.expire_due() == []
        await repo.report_result(
            session, task_id, attempt, token, outcome=Outcome.DONE, fingerprint="edge"
        )
        await observer.sample(engine)
    report = await check(engine, observer=observer)
    assert report.violations == []
    assert report.by_state == {"done": ROUNDS}
