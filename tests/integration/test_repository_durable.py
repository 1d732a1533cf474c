"""durable-scheduling.md: durable state, lease and attempt fencing, retry and
terminal policy, idempotent durable cancellation, reconciliation and the
credential-free projection, on a real PostgreSQL."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.db import create_engine
from fleetlease.persistence.errors import Conflict, Forbidden, Gone, NotFound, Unauthorized
from fleetlease.persistence.model import (
    DeviceSnapshot,
    EndReason,
    JournalEntry,
    Outcome,
    Session,
    TaskState,
)
from fleetlease.persistence.repository import Repository
from tests.integration.test_repository_support import TIMINGS, World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


async def fresh_repository(w: World, db_url: str) -> tuple[Repository, AsyncEngine]:
    """A new repository on a new engine: nothing shared with the old instance but
    the database (a platform restart)."""
    engine = create_engine(db_url, pool_size=2)
    return Repository(engine, w.clock, TIMINGS), engine


# --- Requirement: Durable scheduling state -------------------------------------------


async def test_platform_reload_preserves_active_attempt(world: World, db_url: str) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    await world.repo.request_cancel(c.task_id, world.alice)
    (stored,) = await world.attempt_rows(c.task_id)
    assert stored["lease_token_hash"] == hashlib.sha256(c.lease_token.encode()).digest()
    dump = json.dumps(await world.rows("SELECT * FROM attempts"), default=str)
    assert c.lease_token not in dump

    repo2, engine2 = await fresh_repository(world, db_url)
    try:
        world.clock.advance(10)
        status = await repo2.renew(session, c.task_id, c.attempt, c.lease_token)
    finally:
        await engine2.dispose()

    assert (status.attempt, status.state, status.cancel_requested) == (1, TaskState.RUNNING, True)
    assert status.lease_expires_at == world.clock.now() + timedelta(seconds=30)
    row = await world.task_row(c.task_id)
    assert (row["max_attempts"], row["backoff_base_s"], row["backoff_cap_s"]) == (3, 1.0, 60.0)


async def test_reopened_store_makes_retry_wait_work_claimable_only_at_its_eligible_time(
    world: World, db_url: str
) -> None:
    session = await world.host("h1", ["d1"])
    a = await world.assigned(session, base=20)
    world.clock.advance(30)
    (e,) = await world.repo.expire_due()
    assert e.retry_at is not None
    queued = await world.submit(project="p2", owner="bob", selector={"never": "x"})

    repo2, engine2 = await fresh_repository(world, db_url)
    try:
        await repo2.heartbeat(
            session, [DeviceSnapshot(device_id="d1", capabilities={"host": "h1"})]
        )
        world.clock.set(e.retry_at - timedelta(microseconds=1))
        assert await repo2.assign() == []
        world.clock.set(e.retry_at)
        (again,) = await repo2.assign()
    finally:
        await engine2.dispose()

    assert (again.task_id, again.attempt) == (a.task_id, 2)
    assert (await world.task_row(queued))["status"] == "queued"


# --- Requirement: Lease and attempt fencing ------------------------------------------


async def test_ack_deadline_expires_and_the_late_ack_is_rejected_then_retried(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.dispatched(session, base=0)
    world.clock.advance(15)

    with pytest.raises(Gone):
        await world.repo.ack(session, c.task_id, c.attempt, c.lease_token)
    assert (await world.task_row(c.task_id))["status"] == "dispatched"
    (e,) = await world.repo.expire_due()

    assert (e.reason, e.new_state) == (EndReason.ACK_EXPIRED, TaskState.QUEUED)
    with pytest.raises(Conflict):
        await world.repo.ack(session, c.task_id, c.attempt, c.lease_token)


async def test_ack_deadline_expires_on_the_last_attempt_and_the_task_fails(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.dispatched(session, max_attempts=1)
    world.clock.advance(15)

    (e,) = await world.repo.expire_due()

    assert e.new_state is TaskState.FAILED
    assert (await world.task_row(c.task_id))["terminal_reason"] == "lease_expired"


async def test_execution_lease_expires_without_renewal_and_retry_policy_applies(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=3)
    world.clock.advance(20)
    await world.repo.progress(session, c.task_id, c.attempt, c.lease_token, 1)
    world.clock.advance(29)
    assert await world.repo.expire_due() == []
    world.clock.advance(1)

    (e,) = await world.repo.expire_due()

    assert (e.reason, e.new_state) == (EndReason.LEASE_EXPIRED, TaskState.RETRYING)
    assert e.retry_at == world.clock.now() + timedelta(seconds=3)
    row = await world.task_row(c.task_id)
    assert (row["status"], row["eligible_at"]) == ("retrying", e.retry_at)
    assert await world.reservations() == []


@pytest.mark.parametrize("message", ["ack", "renew", "progress", "result", "reconcile"])
async def test_old_attempt_arrives_late_and_changes_nothing(world: World, message: str) -> None:
    session = await world.host("h1", ["d1"])
    old = await world.running(session, base=0)
    world.clock.advance(30)
    await world.repo.expire_due()
    await world.beat(session)
    (a2,) = await world.repo.assign()
    new = await world.repo.claim(session, a2.task_id, a2.attempt)
    await world.repo.ack(session, new.task_id, new.attempt, new.lease_token)
    assert (new.task_id, new.attempt) == (old.task_id, 2)
    before = await world.snapshot()
    r = world.repo
    args = (session, old.task_id, old.attempt, old.lease_token)

    if message == "reconcile":
        report = await r.reconcile(
            session,
            [
                JournalEntry(task_id=old.task_id, attempt=old.attempt, lease_token=old.lease_token),
                JournalEntry(task_id=new.task_id, attempt=new.attempt, lease_token=new.lease_token),
            ],
        )
        assert report.verdicts[0].verdict == "discard"
        # Reconciliation writes its outcome on the confirmed task only.
        after = await world.snapshot()
        assert after[1] == before[1] and after[2] == before[2]
        return
    with pytest.raises(Conflict):
        if message == "ack":
            await r.ack(*args)
        elif message == "renew":
            await r.renew(*args)
        elif message == "progress":
            await r.progress(*args, 99)
        else:
            await r.report_result(*args, outcome=Outcome.DONE, fingerprint="late")
    assert await world.snapshot() == before


async def test_old_lease_token_of_the_current_attempt_number_is_rejected(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    before = await world.snapshot()

    with pytest.raises(Conflict) as err:
        await world.repo.renew(session, c.task_id, c.attempt, "0" * 64)

    assert err.value.fields["reason"] == "wrong_lease"
    assert await world.snapshot() == before


async def test_valid_lease_evidence_from_another_host_is_forbidden_and_changes_nothing(
    world: World,
) -> None:
    owner = await world.host("h1", ["d1"])
    other = await world.host("h2", [])
    c = await world.running(owner)
    before = await world.snapshot()

    for call in (
        world.repo.renew(other, c.task_id, c.attempt, c.lease_token),
        world.repo.ack(other, c.task_id, c.attempt, c.lease_token),
        world.repo.report_result(
            other, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
        ),
    ):
        with pytest.raises(Forbidden):
            await call
    assert await world.snapshot() == before


async def test_rotated_or_revoked_session_is_unauthorized_and_changes_nothing(
    world: World,
) -> None:
    old = await world.host("h1", ["d1"])
    c = await world.running(old)
    new = await world.repo.register_session("h1", world.credentials["h1"])
    assert new.generation == old.generation + 1
    before = await world.snapshot()

    with pytest.raises(Unauthorized):
        await world.repo.renew(old, c.task_id, c.attempt, c.lease_token)
    with pytest.raises(Unauthorized):
        await world.repo.heartbeat(old, [])
    with pytest.raises(Unauthorized):
        await world.repo.renew(
            Session(host_id="h1", generation=99), c.task_id, c.attempt, c.lease_token
        )
    assert await world.snapshot() == before

    await world.repo.revoke_host("h1")
    with pytest.raises(Unauthorized):
        await world.repo.heartbeat(new, [])
    with pytest.raises(Unauthorized):
        await world.repo.register_session("h1", world.credentials["h1"])


async def test_a_new_session_must_reconcile_before_it_can_renew_an_older_sessions_attempt(
    world: World,
) -> None:
    old = await world.host("h1", ["d1"])
    c = await world.running(old)
    new = await world.repo.register_session("h1", world.credentials["h1"])

    with pytest.raises(Conflict) as err:
        await world.repo.renew(new, c.task_id, c.attempt, c.lease_token)

    assert err.value.fields["reason"] == "session_not_bound"


async def test_unknown_task_is_not_found(world: World) -> None:
    session = await world.host("h1", ["d1"])

    with pytest.raises(NotFound):
        await world.repo.claim(session, "00000000-0000-0000-0000-000000000000", 1)
    with pytest.raises(NotFound):
        await world.repo.renew(session, "not-a-uuid", 1, "x")
    with pytest.raises(NotFound):
        await world.repo.task_view("00000000-0000-0000-0000-000000000000", world.root)


# --- Requirement: Retry and terminal policy ------------------------------------------


async def test_retry_waits_for_backoff_after_a_retryable_failure(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=4)

    rec = await world.repo.report_result(
        session,
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome=Outcome.FAILED,
        retryable=True,
        reason="adb dropped",
        fingerprint="f1",
    )

    assert rec.state is TaskState.RETRYING
    assert rec.retry_at == world.clock.now() + timedelta(seconds=4)
    assert (await world.task_row(c.task_id))["eligible_at"] == rec.retry_at
    world.clock.advance(3.9)
    assert await world.repo.assign() == []
    world.clock.advance(0.1)
    (a,) = await world.repo.assign()
    assert a.task_id == c.task_id


async def test_retry_claim_increments_attempt_and_issues_a_different_lease_token(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    first = await world.running(session, base=0)
    await world.repo.report_result(
        session,
        first.task_id,
        1,
        first.lease_token,
        outcome=Outcome.FAILED,
        retryable=True,
        fingerprint="f1",
    )

    await world.repo.assign()
    second = await world.repo.claim_next(session)

    assert second is not None
    assert (second.task_id, second.attempt) == (first.task_id, 2)
    assert second.lease_token != first.lease_token
    assert second.lease_id != first.lease_id


async def test_retry_budget_is_exhausted_and_the_task_is_never_claimed_again(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, max_attempts=1)

    rec = await world.repo.report_result(
        session,
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome=Outcome.FAILED,
        retryable=True,
        fingerprint="f1",
    )

    assert rec.state is TaskState.FAILED
    world.clock.advance(3600)
    await world.beat(session)
    assert await world.repo.assign() == []
    assert await world.repo.claim_next(session) is None
    assert (await world.task_row(c.task_id))["status"] == "failed"


async def test_terminal_replay_returns_the_recorded_result_for_the_same_fingerprint(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    first = await world.repo.report_result(
        session,
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome=Outcome.DONE,
        fingerprint="f1",
        result={"ok": True},
    )
    before = await world.snapshot()

    again = await world.repo.report_result(
        session,
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome=Outcome.DONE,
        fingerprint="f1",
        result={"ok": True},
    )

    assert again.replayed and not first.replayed
    assert (again.state, again.outcome, again.attempt) == (TaskState.DONE, Outcome.DONE, 1)
    assert await world.snapshot() == before


async def test_terminal_replay_with_a_different_fingerprint_is_a_conflict(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    await world.repo.report_result(
        session, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f1"
    )
    before = await world.snapshot()

    with pytest.raises(Conflict) as err:
        await world.repo.report_result(
            session,
            c.task_id,
            c.attempt,
            c.lease_token,
            outcome=Outcome.FAILED,
            fingerprint="f2",
        )

    assert err.value.fields["reason"] == "fingerprint_mismatch"
    assert await world.snapshot() == before


async def test_terminal_replay_for_a_different_attempt_is_a_conflict(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=0)
    await world.repo.report_result(
        session,
        c.task_id,
        1,
        c.lease_token,
        outcome=Outcome.FAILED,
        retryable=True,
        fingerprint="f1",
    )
    await world.repo.assign()
    second = await world.repo.claim_next(session)
    assert second is not None
    await world.repo.ack(session, second.task_id, 2, second.lease_token)
    await world.repo.report_result(
        session, second.task_id, 2, second.lease_token, outcome=Outcome.DONE, fingerprint="f2"
    )
    before = await world.snapshot()

    with pytest.raises(Conflict):
        await world.repo.report_result(
            session,
            c.task_id,
            1,
            c.lease_token,
            outcome=Outcome.FAILED,
            retryable=True,
            fingerprint="f1",
        )
    assert await world.snapshot() == before


async def test_replay_of_a_retryable_failure_returns_the_recorded_retry(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=5)
    first = await world.repo.report_result(
        session,
        c.task_id,
        1,
        c.lease_token,
        outcome=Outcome.FAILED,
        retryable=True,
        fingerprint="f1",
    )
    world.clock.advance(1)

    again = await world.repo.report_result(
        session,
        c.task_id,
        1,
        c.lease_token,
        outcome=Outcome.FAILED,
        retryable=True,
        fingerprint="f1",
    )

    assert again.replayed
    assert (again.state, again.outcome, again.retry_at) == (
        TaskState.RETRYING,
        Outcome.FAILED,
        first.retry_at,
    )


# --- Requirement: Idempotent durable cancellation -------------------------------------


async def test_cancel_before_claim_records_intent_and_cancelled_result(world: World) -> None:
    session = await world.host("h1", ["d1"])
    queued = await world.submit(selector={"none": "x"})
    retrying_task = await world.assigned(session, base=60)
    world.clock.advance(30)
    await world.repo.expire_due()

    for task_id in (queued, retrying_task.task_id):
        rec = await world.repo.request_cancel(task_id, world.alice)
        assert (rec.state, rec.completed, rec.requested_by) == (
            TaskState.CANCELLED,
            True,
            "alice",
        )
        row = await world.task_row(task_id)
        assert row["status"] == "cancelled"
        assert row["cancel_requested_at"] == world.clock.now()
        assert row["terminal_reason"] == "cancelled"
    await world.beat(session)
    world.clock.advance(3600)
    await world.beat(session)
    assert await world.repo.assign() == []


async def test_cancel_after_claim_is_seen_by_the_renewal_and_completes_with_the_result(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    rec = await world.repo.request_cancel(c.task_id, world.carol)
    status = await world.repo.renew(session, c.task_id, c.attempt, c.lease_token)
    done = await world.repo.report_result(
        session,
        c.task_id,
        c.attempt,
        c.lease_token,
        outcome=Outcome.CANCELLED,
        fingerprint="stop",
    )

    assert (rec.state, rec.completed) == (TaskState.RUNNING, False)
    assert status.cancel_requested
    assert done.state is TaskState.CANCELLED
    (attempt,) = await world.attempt_rows(c.task_id)
    assert attempt["cancel_requested_at"] == rec.requested_at
    assert attempt["end_reason"] == "cancelled"


async def test_cancel_is_repeated_and_returns_the_first_intent(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    first = await world.repo.request_cancel(c.task_id, world.alice)
    world.clock.advance(5)
    before = await world.snapshot()

    again = await world.repo.request_cancel(c.task_id, world.root)
    polls = [await world.repo.renew(session, c.task_id, 1, c.lease_token) for _ in range(2)]

    assert (again.requested_at, again.requested_by) == (first.requested_at, "alice")
    assert all(p.cancel_requested for p in polls)
    after = await world.snapshot()
    assert after[0] == before[0]  # the task row: no second intent, no new attempt
    await world.repo.report_result(
        session, c.task_id, 1, c.lease_token, outcome=Outcome.CANCELLED, fingerprint="s"
    )
    final = await world.repo.request_cancel(c.task_id, world.alice)
    assert (final.state, final.completed, final.requested_at) == (
        TaskState.CANCELLED,
        True,
        first.requested_at,
    )


async def test_cross_owner_cancellation_is_denied_and_persists_no_intent(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    queued = await world.submit(selector={"none": "x"})
    before = await world.snapshot()

    for task_id in (c.task_id, queued):
        with pytest.raises(Forbidden):
            await world.repo.request_cancel(task_id, world.bob)

    assert await world.snapshot() == before


# --- Requirement: Run restart and platform reconciliation -----------------------------


async def test_run_restart_resumes_confirmed_attempt_rebound_to_the_rotated_session(
    world: World,
) -> None:
    old = await world.host("h1", ["d1"])
    c = await world.running(old)
    new = await world.repo.register_session("h1", world.credentials["h1"])
    world.clock.advance(10)

    report = await world.repo.reconcile(
        new, [JournalEntry(task_id=c.task_id, attempt=c.attempt, lease_token=c.lease_token)]
    )

    (v,) = report.verdicts
    assert (v.verdict, v.state, report.lost) == ("confirmed", TaskState.RUNNING, [])
    assert v.lease_expires_at == world.clock.now() + timedelta(seconds=30)
    (attempt,) = await world.attempt_rows(c.task_id)
    assert attempt["session_generation"] == new.generation
    row = await world.task_row(c.task_id)
    assert (row["reconcile_outcome"], row["reconciled_at"]) == ("confirmed", world.clock.now())
    status = await world.repo.renew(new, c.task_id, c.attempt, c.lease_token)
    assert status.state is TaskState.RUNNING


async def test_run_reports_stale_journal_entries_and_is_told_to_discard_them(
    world: World,
) -> None:
    s1 = await world.host("h1", ["d1", "d2"])
    s2 = await world.host("h2", ["d1"])
    live = await world.running(s1)
    finished = await world.running(s1)
    await world.repo.report_result(
        s1, finished.task_id, 1, finished.lease_token, outcome=Outcome.DONE, fingerprint="f"
    )
    foreign = await world.running(s2)
    new = await world.repo.register_session("h1", world.credentials["h1"])
    before = await world.snapshot()

    report = await world.repo.reconcile(
        new,
        [
            JournalEntry(task_id=finished.task_id, attempt=1, lease_token=finished.lease_token),
            JournalEntry(
                task_id="00000000-0000-0000-0000-000000000000", attempt=1, lease_token="x"
            ),
            JournalEntry(task_id=foreign.task_id, attempt=1, lease_token=foreign.lease_token),
            JournalEntry(task_id=live.task_id, attempt=7, lease_token=live.lease_token),
            JournalEntry(task_id=live.task_id, attempt=1, lease_token="0" * 64),
            JournalEntry(task_id="garbage", attempt=1, lease_token="x"),
        ],
    )

    assert [(v.verdict, v.reason) for v in report.verdicts] == [
        ("discard", "terminal"),
        ("discard", "unknown"),
        ("discard", "foreign"),
        ("discard", "unknown"),
        ("discard", "wrong_lease"),
        ("discard", "unknown"),
    ]
    # The live attempt was not confirmed by any entry: it is lost; nothing else moved.
    assert [e.task_id for e in report.lost] == [live.task_id]
    after = await world.snapshot()
    untouched = lambda rows: [r for r in rows if str(r.get("task_id", r.get("id"))) != live.task_id]  # noqa: E731
    assert [untouched(t) for t in after] == [untouched(t) for t in before]


async def test_platform_restart_accepts_reconciliation_from_persisted_metadata(
    world: World, db_url: str
) -> None:
    old = await world.host("h1", ["d1"])
    c = await world.running(old)

    repo2, engine2 = await fresh_repository(world, db_url)
    try:
        new = await repo2.register_session("h1", world.credentials["h1"])
        report = await repo2.reconcile(
            new, [JournalEntry(task_id=c.task_id, attempt=1, lease_token=c.lease_token)]
        )
    finally:
        await engine2.dispose()

    assert [v.verdict for v in report.verdicts] == ["confirmed"]


async def test_platform_active_work_missing_from_run_is_lost_and_follows_retry_policy(
    world: World,
) -> None:
    old = await world.host("h1", ["d1", "d2", "d3"])
    running = await world.running(old, base=2)
    dispatched = await world.dispatched(old, base=0)
    unclaimed = await world.assigned(old)
    new = await world.repo.register_session("h1", world.credentials["h1"])

    report = await world.repo.reconcile(new, [])

    lost = {e.task_id: e for e in report.lost}
    assert set(lost) == {running.task_id, dispatched.task_id}
    assert lost[running.task_id].new_state is TaskState.RETRYING
    assert lost[dispatched.task_id].new_state is TaskState.QUEUED
    assert {e.reason for e in report.lost} == {EndReason.RECONCILE_LOST}
    for task_id in lost:
        row = await world.task_row(task_id)
        assert row["reconcile_outcome"] == "lost"
        (attempt,) = await world.attempt_rows(task_id)
        assert attempt["end_reason"] == "reconcile_lost"
    assert [str(r["task_id"]) for r in await world.reservations()] == [unclaimed.task_id]


async def test_platform_active_work_missing_from_run_with_a_cancel_pending_is_cancelled(
    world: World,
) -> None:
    old = await world.host("h1", ["d1"])
    c = await world.running(old)
    await world.repo.request_cancel(c.task_id, world.alice)
    new = await world.repo.register_session("h1", world.credentials["h1"])

    (lost,) = (await world.repo.reconcile(new, [])).lost

    assert lost.new_state is TaskState.CANCELLED


# --- Requirement: Credential-free user projection --------------------------------------


async def test_authorized_users_read_job_scheduling_status_without_credential_material(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    await world.repo.request_cancel(c.task_id, world.alice)
    secrets = [c.lease_token, world.credentials["h1"]]
    hashes = [r["lease_token_hash"].hex() for r in await world.attempt_rows(c.task_id)]

    for user in (world.alice, world.carol, world.root):
        view = await world.repo.task_view(c.task_id, user)
        dumped = json.dumps(view)
        assert not any(s in dumped for s in secrets + hashes)
        assert "hash" not in dumped and "token" not in dumped and "credential" not in dumped
        assert view["state"] == "running" and view["attempt"] == 1
        assert view["cancel"]["requested"] is True and view["cancel"]["by"] == "alice"
        assert view["retry_at"] is None and view["reconcile"] == {"outcome": None, "at": None}
        (a,) = view["attempts"]
        assert (a["host_id"], a["device_id"], a["lease_id"]) == ("h1", "d1", c.lease_id)
        assert a["started_at"] == a["acked_at"] is not None
    listed = await world.repo.list_tasks(world.carol, states=["running"], host_id="h1")
    assert [t["id"] for t in listed] == [c.task_id]
    assert "attempts" not in listed[0]


async def test_unauthorized_user_reading_another_owners_job_is_forbidden(world: World) -> None:
    task_id = await world.submit()

    with pytest.raises(Forbidden):
        await world.repo.task_view(task_id, world.bob)
    with pytest.raises(Forbidden):
        await world.repo.read_logs(task_id, world.bob)
    assert await world.repo.list_tasks(world.bob) == []
    assert [t["id"] for t in await world.repo.list_tasks(world.root)] == [task_id]


# --- Requirement: Independent channel priority (the database side) --------------------


async def test_blocked_log_and_artifact_tables_never_block_job_lifecycle_transactions(
    world: World, engine: AsyncEngine
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    async with engine.connect() as blocker:
        await blocker.execute(text("BEGIN"))
        await blocker.execute(text("LOCK TABLE log_lines, artifacts IN ACCESS EXCLUSIVE MODE"))
        await blocker.execute(text("SET LOCAL lock_timeout = '50ms'"))
        await world.beat(session)
        await world.repo.renew(session, c.task_id, 1, c.lease_token)
        await world.repo.request_cancel(c.task_id, world.alice)
        await world.repo.report_result(
            session, c.task_id, 1, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
        )
        await world.repo.reconcile(session, [])
        await blocker.execute(text("ROLLBACK"))

    assert (await world.task_row(c.task_id))["status"] == "done"
