"""Group commit of host transitions (``Repository.run_many``): many claims, acks,
progress reports and results share one transaction, each keeps its own outcome,
and a refused one changes nothing, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from structlog.testing import capture_logs

from fleetlease.actors.groupcommit import RenewBatcher, TransitionBatcher
from fleetlease.persistence.errors import Conflict, Gone, NotFound, Unauthorized, Unavailable
from fleetlease.persistence.model import LeaseStatus, Outcome, Session, TaskState
from fleetlease.persistence.repository import Renewal, Repository, Transition
from tests.chaos.harness import wait_until
from tests.integration.test_repository_support import World, world

__all__ = ["world"]


async def test_a_mixed_batch_commits_each_transition_with_its_own_outcome(world: World) -> None:
    h1 = await world.host("h1", ["d1", "d2", "d3", "d4"])
    to_claim = await world.assigned(h1)
    to_ack = await world.dispatched(h1)
    to_finish = await world.running(h1)
    to_fail = await world.running(h1)
    repo = world.repo

    out = await repo.run_many(
        [
            repo.claim_op(h1, to_claim.task_id, to_claim.attempt),
            repo.ack_op(h1, to_ack.task_id, to_ack.attempt, to_ack.lease_token),
            repo.report_result_op(
                h1,
                to_finish.task_id,
                to_finish.attempt,
                to_finish.lease_token,
                outcome=Outcome.DONE,
                fingerprint="f1",
            ),
            repo.report_result_op(
                h1,
                to_fail.task_id,
                to_fail.attempt,
                to_fail.lease_token,
                outcome=Outcome.FAILED,
                retryable=True,
                fingerprint="f2",
            ),
        ]
    )

    claimed, acked, done, failed = out
    assert claimed.task_id == to_claim.task_id and claimed.lease_token
    assert acked.state is TaskState.RUNNING
    assert (done.state, done.replayed) == (TaskState.DONE, False)
    assert failed.state is TaskState.RETRYING
    states = {t: (await world.task_row(t))["status"] for t in (to_claim.task_id, to_ack.task_id)}
    assert states == {to_claim.task_id: "dispatched", to_ack.task_id: "running"}
    assert (await world.task_row(to_finish.task_id))["status"] == "done"
    # Both results released their devices; the other two still hold theirs.
    held = {r["task_id"] for r in await world.reservations()}
    assert {str(t) for t in held} == {to_claim.task_id, to_ack.task_id}


async def test_refused_transitions_in_a_batch_change_nothing_and_do_not_undo_the_others(
    world: World,
) -> None:
    h1 = await world.host("h1", ["d1", "d2", "d3"])
    good = await world.running(h1)
    stale = await world.running(h1)
    foreign_session = Session(host_id="h1", generation=h1.generation + 7)
    other = await world.dispatched(h1)
    untouched = (stale.task_id, other.task_id)
    before = [await world.task_row(t) for t in untouched]
    before_attempts = [await world.attempt_rows(t) for t in untouched]
    before_reservations = await world.reservations()
    repo = world.repo

    out = await repo.run_many(
        [
            repo.ack_op(h1, stale.task_id, stale.attempt, "not-the-token"),
            repo.report_result_op(
                foreign_session,
                other.task_id,
                other.attempt,
                other.lease_token,
                outcome=Outcome.DONE,
                fingerprint="x",
            ),
            repo.claim_op(h1, "00000000-0000-0000-0000-000000000000", 1),
            repo.progress_op(h1, good.task_id, good.attempt, good.lease_token, 5),
        ]
    )

    wrong_lease, unauthorized, missing, progressed = out
    assert isinstance(wrong_lease, Conflict) and wrong_lease.fields["reason"] == "wrong_lease"
    assert isinstance(unauthorized, Unauthorized)
    assert isinstance(missing, NotFound)
    assert progressed.state is TaskState.RUNNING
    assert [await world.task_row(t) for t in untouched] == before
    assert [await world.attempt_rows(t) for t in untouched] == before_attempts
    assert await world.reservations() == before_reservations
    assert (await world.task_row(good.task_id))["progress_seq"] == 5


async def test_many_transitions_of_one_kind_are_written_by_one_statement_each_kind(
    world: World,
) -> None:
    """Several claims, acks and results in one batch: their compare-and-sets are
    written together, one multi-row statement per shape, with the same rows as
    one at a time would write (the result's JSON included)."""
    h1 = await world.host("h1", [f"d{i}" for i in range(9)])
    to_claim = [await world.assigned(h1) for _ in range(3)]
    to_ack = [await world.dispatched(h1) for _ in range(3)]
    to_finish = [await world.running(h1) for _ in range(3)]
    repo = world.repo

    with capture_logs() as logs:
        out = await repo.run_many(
            [repo.claim_op(h1, a.task_id, a.attempt) for a in to_claim]
            + [repo.ack_op(h1, c.task_id, c.attempt, c.lease_token) for c in to_ack]
            + [
                repo.report_result_op(
                    h1,
                    c.task_id,
                    c.attempt,
                    c.lease_token,
                    outcome=Outcome.DONE,
                    result={"n": i, "text": "ok \u00e9"},
                    fingerprint=f"f{i}",
                )
                for i, c in enumerate(to_finish)
            ]
        )

    # Written together, not rolled back and run one by one.
    assert not [e for e in logs if e["event"] == "repository.batch_isolated"]
    assert not [o for o in out if isinstance(o, Exception)]
    for a, claimed in zip(to_claim, out[:3], strict=True):
        assert (await world.task_row(a.task_id))["status"] == "dispatched"
        (attempt,) = await world.attempt_rows(a.task_id)
        assert attempt["claimed_at"] is not None
        assert attempt["ack_deadline"] == claimed.ack_deadline
        assert attempt["session_generation"] == h1.generation
        assert attempt["lease_token_hash"] is not None
        # The token the claim returned is the one now stored: it acks.
        acked = await repo.ack(h1, a.task_id, a.attempt, claimed.lease_token)
        assert acked.state is TaskState.RUNNING
    for c, status in zip(to_ack, out[3:6], strict=True):
        assert (await world.task_row(c.task_id))["status"] == "running"
        (attempt,) = await world.attempt_rows(c.task_id)
        assert attempt["acked_at"] is not None
        assert attempt["lease_expires_at"] == status.lease_expires_at
    for i, c in enumerate(to_finish):
        row = await world.task_row(c.task_id)
        assert (row["status"], row["result"], row["result_fingerprint"]) == (
            "done",
            {"n": i, "text": "ok \u00e9"},
            f"f{i}",
        )
        (attempt,) = await world.attempt_rows(c.task_id)
        assert (attempt["end_reason"], attempt["ended_at"] is not None) == ("done", True)
    held = {str(r["task_id"]) for r in await world.reservations()}
    assert held == {a.task_id for a in to_claim} | {c.task_id for c in to_ack}


async def test_a_batched_write_that_misses_undoes_the_batch_and_each_runs_alone(
    world: World,
) -> None:
    """The batch's compare-and-sets are written last; should one find its row
    changed (here a transition of the batch changes another's task, which no
    real transition does), everything is rolled back and each transition runs in
    a transaction of its own."""
    h1 = await world.host("h1", ["d1", "d2"])
    a, b = await world.dispatched(h1), await world.dispatched(h1)
    repo = world.repo
    ran_shared = []

    async def sabotage(conn: Any, now: Any, batch: Any) -> str:
        if batch is not None:  # in the shared transaction only
            ran_shared.append(True)
            await conn.execute(
                sa.text("UPDATE tasks SET attempt = attempt + 100 WHERE id = :id"),
                {"id": b.task_id},
            )
        return "ran"

    out = await repo.run_many(
        [
            repo.ack_op(h1, a.task_id, a.attempt, a.lease_token),
            repo.ack_op(h1, b.task_id, b.attempt, b.lease_token),
            Transition("sabotage", "ffffffff-ffff-ffff-ffff-ffffffffffff", 1, "h1", sabotage),
        ]
    )

    assert ran_shared == [True]
    acked_a, acked_b, sabotage_out = out
    assert (acked_a.state, acked_b.state, sabotage_out) == (
        TaskState.RUNNING,
        TaskState.RUNNING,
        "ran",
    )
    for c in (a, b):
        row = await world.task_row(c.task_id)
        assert (row["status"], row["attempt"]) == ("running", c.attempt)


class _Meddling(Repository):
    """The real repository; ``meddle`` runs in another transaction between a
    batch's unlocked read and its write (a concurrent expiry, reconcile, ...)."""

    meddle: Callable[[], Any] | None = None

    async def _write_deferred(self, conn: Any, batch: Any, now: Any, *, strict: bool = True) -> Any:
        if self.meddle is not None:
            meddle, self.meddle = self.meddle, None
            await meddle()
        return await super()._write_deferred(conn, batch, now, strict=strict)


async def _sql(world: World, statement: str, **params: Any) -> None:
    async with world.engine.begin() as conn:
        await conn.execute(sa.text(statement), params)


async def test_a_row_changed_between_the_read_and_the_write_is_not_written_and_runs_alone(
    world: World,
) -> None:
    """Claims, acks and results read their rows unlocked and write them in one
    later statement, each only if its row is as read. Here the lease of one
    task expires in between (as the Reaper would): its result is not written
    over the expiry, it runs again in a locked transaction of its own and gets
    the expiry's answer; the others are written, and only the written result
    releases its device."""
    repo = _Meddling(world.engine, world.clock, world.repo.timings)
    h1 = await world.host("h1", ["d1", "d2", "d3"])
    ok, expired = await world.running(h1), await world.running(h1)
    to_ack = await world.dispatched(h1)

    async def expire() -> None:
        await _sql(
            world,
            "UPDATE tasks SET status = 'retrying' WHERE id = :id",
            id=expired.task_id,
        )
        await _sql(
            world,
            "UPDATE attempts SET ended_at = now(), end_reason = 'lease_expired'"
            " WHERE task_id = :id",
            id=expired.task_id,
        )

    repo.meddle = expire
    out = await repo.run_many(
        [
            repo.report_result_op(
                h1, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
            )
            for c in (ok, expired)
        ]
        + [repo.ack_op(h1, to_ack.task_id, to_ack.attempt, to_ack.lease_token)]
    )

    done, late, acked = out
    assert done.state is TaskState.DONE
    assert isinstance(late, Conflict) and late.fields["reason"] == "wrong_state"
    assert acked.state is TaskState.RUNNING
    assert (await world.task_row(expired.task_id))["status"] == "retrying"
    (attempt,) = await world.attempt_rows(expired.task_id)
    assert attempt["end_reason"] == "lease_expired"
    held = {str(r["task_id"]) for r in await world.reservations()}
    assert held == {expired.task_id, to_ack.task_id}


async def test_an_attempt_rebound_between_the_read_and_the_write_is_not_written(
    world: World,
) -> None:
    """The write checks the attempt's session generation as read: an ack racing
    a reconcile that bound the attempt to a newer session is not written; run
    again alone, it is refused as an older session's."""
    repo = _Meddling(world.engine, world.clock, world.repo.timings)
    h1 = await world.host("h1", ["d1", "d2"])
    a, b = await world.dispatched(h1), await world.dispatched(h1)

    async def rebind() -> None:
        await _sql(
            world,
            "UPDATE attempts SET session_generation = session_generation + 1 WHERE task_id = :id",
            id=b.task_id,
        )

    repo.meddle = rebind
    acked_a, acked_b = await repo.run_many(
        [repo.ack_op(h1, c.task_id, c.attempt, c.lease_token) for c in (a, b)]
    )
    assert acked_a.state is TaskState.RUNNING
    assert isinstance(acked_b, Conflict) and acked_b.fields["reason"] == "session_not_bound"
    assert (await world.task_row(b.task_id))["status"] == "dispatched"


async def test_the_same_task_twice_in_a_batch_runs_in_order(world: World) -> None:
    h1 = await world.host("h1", ["d1"])
    c = await world.dispatched(h1)
    repo = world.repo
    ack, result, late_ack = await repo.run_many(
        [
            repo.ack_op(h1, c.task_id, c.attempt, c.lease_token),
            repo.report_result_op(
                h1, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
            ),
            repo.ack_op(h1, c.task_id, c.attempt, c.lease_token),
        ]
    )
    # Task id order is stable, so the three run as listed: ack, result, then an
    # ack of a terminal task.
    assert ack.state is TaskState.RUNNING
    assert result.state is TaskState.DONE
    assert isinstance(late_ack, Gone)
    assert (await world.task_row(c.task_id))["status"] == "done"


async def test_two_batches_naming_the_same_tasks_twice_lock_them_in_one_order(
    world: World,
) -> None:
    """Two concurrent batches over the same two tasks, each naming a different
    one of them twice. A batch locks every task it names in its first read, in
    task id order, so neither holds a row the other wants while waiting for
    one. (Were a task named twice locked only when its turn came, these two
    batches would deadlock, and PostgreSQL would abort one.)"""
    h1 = await world.host("h1", ["d1", "d2"])
    lo, hi = sorted([await world.running(h1) for _ in range(2)], key=lambda c: c.task_id)
    repo = world.repo
    arrived = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def other_arrived_or_waits_for_a_row(other: str) -> bool:
        if arrived[other].is_set():
            return True
        async with world.engine.connect() as conn:
            n = await conn.scalar(sa.text("SELECT count(*) FROM pg_locks WHERE NOT granted"))
        return bool(n)

    def gated(t: Transition, me: str, other: str) -> Transition:
        """``t``, which runs first in its batch: the first time, it waits until
        the other batch has run its first read too, or is blocked by this one."""

        async def run(conn: Any, now: Any, batch: Any) -> Any:
            if not arrived[me].is_set():
                arrived[me].set()
                await wait_until(
                    lambda: other_arrived_or_waits_for_a_row(other),
                    timeout=30,
                    what=f"batch {other} at its first transition or blocked",
                )
            return await t.run(conn, now, batch)

        return Transition(t.op, t.task_id, t.attempt, t.host_id, run)

    def report(c: Any, seq: int) -> Transition:
        return repo.progress_op(h1, c.task_id, c.attempt, c.lease_token, seq)

    with capture_logs() as logs:
        a, b = await asyncio.wait_for(
            asyncio.gather(
                # Each list runs in task id order: ``lo`` first.
                repo.run_many([gated(report(lo, 1), "a", "b"), report(hi, 2), report(hi, 3)]),
                repo.run_many([report(hi, 4), gated(report(lo, 5), "b", "a"), report(lo, 6)]),
            ),
            60,
        )

    assert not [e for e in logs if e.get("sqlstate") == "40P01"]
    assert not [o for o in a + b if isinstance(o, Unavailable)]
    assert {(await world.task_row(c.task_id))["status"] for c in (lo, hi)} == {"running"}


async def test_concurrent_transitions_through_the_batcher_share_commits(world: World) -> None:
    devices = [f"d{i}" for i in range(24)]
    h1 = await world.host("h1", devices)
    running = [await world.running(h1) for _ in range(24)]
    batcher = TransitionBatcher(world.repo, max_inflight=1)
    repo = world.repo

    results = await asyncio.gather(
        *(
            batcher.run(
                repo.report_result_op(
                    h1,
                    c.task_id,
                    c.attempt,
                    c.lease_token,
                    outcome=Outcome.DONE,
                    fingerprint=f"f{i}",
                )
            )
            for i, c in enumerate(running)
        )
    )
    await batcher.close()

    assert [r.state for r in results] == [TaskState.DONE] * 24
    assert batcher.items == 24
    assert batcher.batches < 24  # one flusher: everything queued behind the first batch
    assert await world.reservations() == []
    rows = await world.rows("SELECT state FROM devices WHERE host_id = 'h1'")
    assert {r["state"] for r in rows} == {"idle"}


async def test_renewals_arriving_while_the_batcher_lingers_share_one_commit(world: World) -> None:
    h1 = await world.host("h1", ["d0", "d1", "d2", "d3"])
    running = [await world.running(h1) for _ in range(4)]
    batcher = RenewBatcher(world.repo, linger_s=30.0)

    def renew(c: Any) -> asyncio.Future[LeaseStatus]:
        return asyncio.ensure_future(
            batcher.renew(
                Renewal(session=h1, task_id=c.task_id, attempt=c.attempt, lease_token=c.lease_token)
            )
        )

    first = renew(running[0])
    await _until(lambda: batcher._lingering)
    # The others arrive one by one while the first waits for company; a full batch
    # (max_batch) would not wait, so shrink it to exactly these four.
    batcher.max_batch = 4
    later = []
    for c in running[1:]:
        later.append(renew(c))
        await asyncio.sleep(0)
    statuses = await asyncio.wait_for(asyncio.gather(first, *later), 30)
    await batcher.close()

    assert [s.state for s in statuses] == [TaskState.RUNNING] * 4
    assert (batcher.batches, batcher.items) == (1, 4)


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


# --- renewals: an unlocked read, then one conditional write -------------------------


class _MeddlingRenewals(Repository):
    """The real repository; ``meddle(conn)`` runs between a renewal batch's
    unlocked read and its write (``conn``: the driver connection the batch
    runs on), and the paths the batch took are counted."""

    meddle: Callable[[Any], Any] | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.unlocked_writes = 0
        self.locked_runs = 0

    async def _extend_unlocked(self, conn: Any, *args: Any) -> Any:
        self.unlocked_writes += 1
        if self.meddle is not None:
            meddle, self.meddle = self.meddle, None
            await meddle(conn)
        return await super()._extend_unlocked(conn, *args)

    async def _renew_locked(self, *args: Any) -> Any:
        self.locked_runs += 1
        return await super()._renew_locked(*args)


def _renewals(session: Session, *leases: Any) -> list[Renewal]:
    return [
        Renewal(session=session, task_id=c.task_id, attempt=c.attempt, lease_token=c.lease_token)
        for c in leases
    ]


async def _expiry(world: World, task_id: str) -> Any:
    (attempt,) = await world.attempt_rows(task_id)
    return attempt["lease_expires_at"]


async def test_a_batch_of_renewals_is_one_read_and_one_write_without_a_locked_transaction(
    world: World,
) -> None:
    repo = _MeddlingRenewals(world.engine, world.clock, world.repo.timings)
    h1 = await world.host("h1", ["d1", "d2", "d3"])
    a, b = await world.running(h1), await world.running(h1)
    waiting = await world.dispatched(h1)
    world.clock.advance(5)

    out = await repo.renew_many(_renewals(h1, a, b, waiting, a))

    assert (repo.unlocked_writes, repo.locked_runs) == (1, 0)
    expiry = world.clock.now() + timedelta(seconds=30)
    assert [(s.state, s.lease_expires_at) for s in out] == [
        (TaskState.RUNNING, expiry),
        (TaskState.RUNNING, expiry),
        (TaskState.DISPATCHED, waiting.ack_deadline),
        (TaskState.RUNNING, expiry),
    ]
    assert [await _expiry(world, c.task_id) for c in (a, b)] == [expiry, expiry]


async def test_a_lease_that_expired_between_the_read_and_the_write_is_not_extended(
    world: World,
) -> None:
    """The Reaper expires one lease after the batch read it: the write leaves
    that attempt alone, the renewal runs again locked and gets the expiry's
    answer, and the other renewal of the batch is written."""
    repo = _MeddlingRenewals(world.engine, world.clock, world.repo.timings)
    h1 = await world.host("h1", ["d1", "d2"])
    ok, late = await world.running(h1), await world.running(h1)
    before = await _expiry(world, late.task_id)

    async def expire(conn: Any) -> None:
        await _sql(world, "UPDATE tasks SET status = 'retrying' WHERE id = :id", id=late.task_id)
        await _sql(
            world,
            "UPDATE attempts SET ended_at = now(), end_reason = 'lease_expired'"
            " WHERE task_id = :id",
            id=late.task_id,
        )

    repo.meddle = expire
    renewed, refused = await repo.renew_many(_renewals(h1, ok, late))

    assert renewed.state is TaskState.RUNNING
    assert isinstance(refused, Conflict) and refused.fields["reason"] == "wrong_state"
    assert repo.locked_runs == 1
    assert await _expiry(world, late.task_id) == before


async def test_a_deadline_passed_or_a_session_replaced_before_the_write_extends_nothing(
    world: World,
) -> None:
    """Between the read and the write, one lease's deadline passes and the
    other's host gets a new session: neither lease is extended by the write;
    run again locked, the first is expired and the second is no longer the
    current session's."""
    repo = _MeddlingRenewals(world.engine, world.clock, world.repo.timings)
    h1, h2 = await world.host("h1", ["d1"]), await world.host("h2", ["d2"])
    a, b = await world.running(h1), await world.running(h2)
    before = await _expiry(world, b.task_id)
    world.clock.advance(5)

    async def meddle(conn: Any) -> None:
        await _sql(
            world,
            "UPDATE attempts SET lease_expires_at = :t WHERE task_id = :id",
            t=world.clock.now(),
            id=a.task_id,
        )
        await world.repo.register_session("h2", world.credentials["h2"])

    repo.meddle = meddle
    expired, stale = await repo.renew_many(_renewals(h1, a) + _renewals(h2, b))

    assert isinstance(expired, Conflict) and expired.fields["reason"] == "lease_expired"
    assert isinstance(stale, Unauthorized)
    assert (repo.unlocked_writes, repo.locked_runs) == (1, 1)
    assert await _expiry(world, a.task_id) == world.clock.now()
    assert await _expiry(world, b.task_id) == before


async def test_a_connection_lost_before_the_write_answers_unavailable_and_keeps_refusals(
    world: World,
) -> None:
    """The batch's connection is killed between the read and the write: the
    lease to extend gets ``Unavailable`` (its fate unknown), a renewal the read
    refused keeps its refusal, the broken connection is not reused and the
    next batch is served."""
    repo = _MeddlingRenewals(world.engine, world.clock, world.repo.timings)
    h1 = await world.host("h1", ["d1", "d2"])
    a, b = await world.running(h1), await world.running(h1)

    async def kill(conn: Any) -> None:
        await _sql(world, "SELECT pg_terminate_backend(:pid)", pid=conn.get_server_pid())

    repo.meddle = kill
    bad_token = Renewal(session=h1, task_id=b.task_id, attempt=1, lease_token="not the token")
    lost, refused = await repo.renew_many([*_renewals(h1, a), bad_token])

    assert isinstance(lost, Unavailable)
    assert isinstance(refused, Conflict) and refused.fields["reason"] == "wrong_lease"
    world.clock.advance(1)
    for _ in range(3):  # whichever pooled connection each batch takes
        (again,) = await repo.renew_many(_renewals(h1, a))
        assert again.lease_expires_at == world.clock.now() + timedelta(seconds=30)
