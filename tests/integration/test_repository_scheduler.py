"""task-scheduler.md (and the scheduler parts of task-cancellation.md): atomic
assignment with device reservation, host claim, expiry with bounded retry, and
terminal results fenced by the active lease."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from fleetlease.persistence.errors import Conflict, Gone, Invalid, Unauthorized
from fleetlease.persistence.model import DeviceSnapshot, EndReason, Outcome, Session, TaskState
from fleetlease.persistence.repository import assign
from fleetlease.persistence.secrets import hash_secret
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


# --- Requirement: Assignment and device reservation are atomic ----------------------


async def test_scheduler_assigns_an_idle_device_in_one_transaction(world: World) -> None:
    session = await world.host("h1", ["d1"])
    task_id = await world.submit()

    (a,) = await world.repo.assign()

    assert (a.task_id, a.attempt, a.host_id, a.device_id) == (task_id, 1, "h1", "d1")
    assert a.claim_deadline == world.clock.now() + timedelta(seconds=30)
    row = await world.task_row(task_id)
    assert (row["status"], row["attempt"]) == ("assigned", 1)
    (attempt,) = await world.attempt_rows(task_id)
    assert (attempt["host_id"], attempt["device_id"], str(attempt["lease_id"])) == (
        "h1",
        "d1",
        a.lease_id,
    )
    assert attempt["claim_deadline"] == a.claim_deadline
    (res,) = await world.reservations()
    assert (res["host_id"], res["device_id"], str(res["task_id"]), res["attempt"]) == (
        "h1",
        "d1",
        task_id,
        1,
    )
    assert session.generation == 1


async def test_stale_idle_snapshot_never_beats_an_active_reservation(world: World) -> None:
    session = await world.host("h1", ["d1"])
    first = await world.assigned(session)
    # The host's next snapshot still says idle: the reservation wins.
    await world.repo.heartbeat(session, [DeviceSnapshot(device_id="d1", state="idle")])
    await world.submit()

    assert await world.repo.assign() == []
    assert [str(r["task_id"]) for r in await world.reservations()] == [first.task_id]


async def test_assign_binds_several_tasks_to_distinct_devices_in_one_call(world: World) -> None:
    await world.host("h1", ["d1", "d2", "d3"])
    ids = [await world.submit() for _ in range(5)]

    got = await world.repo.assign()

    assert len(got) == 3
    assert len({(a.host_id, a.device_id) for a in got}) == 3
    assert {a.task_id for a in got} == set(ids[:3])


async def test_assign_is_priority_then_fifo_within_a_project(world: World) -> None:
    await world.host("h1", ["d1"])
    low = await world.submit(priority=0)
    high_first = await world.submit(priority=5)
    await world.submit(priority=5)

    (a,) = await world.repo.assign()

    assert a.task_id == high_first
    assert a.task_id != low


async def test_assign_is_round_robin_across_projects(world: World) -> None:
    await world.host("h1", ["d1", "d2"])
    p1 = [await world.submit(project="p1", priority=9) for _ in range(3)]
    p2 = await world.submit(project="p2", owner="bob", priority=0)

    got = {a.task_id for a in await world.repo.assign()}

    assert got == {p1[0], p2}


async def test_assign_matches_the_selector_against_device_capabilities(world: World) -> None:
    await world.host(
        "h1",
        [
            DeviceSnapshot(device_id="pixel", capabilities={"os": "android", "model": "pixel"}),
            DeviceSnapshot(device_id="iphone", capabilities={"os": "ios"}),
        ],
    )
    ios = await world.submit(selector={"os": "ios"})
    nothing = await world.submit(selector={"os": "windows"})

    got = await world.repo.assign()

    assert [(a.task_id, a.device_id) for a in got] == [(ios, "iphone")]
    assert (await world.task_row(nothing))["status"] == "queued"


async def test_a_task_that_matches_nothing_does_not_starve_the_ones_behind_it(
    world: World,
) -> None:
    await world.host("h1", [DeviceSnapshot(device_id="d1", capabilities={"os": "android"})])
    for _ in range(3):
        await world.submit(priority=10, selector={"os": "ios"})
    android = await world.submit(priority=0, selector={"os": "android"})

    (a,) = await world.repo.assign(limit=1)

    assert a.task_id == android


async def test_only_idle_devices_of_live_unrevoked_hosts_are_candidates(world: World) -> None:
    await world.host("busy", [DeviceSnapshot(device_id="d1", state="busy")])
    await world.host("offline", [DeviceSnapshot(device_id="d1", state="offline")])
    await world.host("silent", ["d1"])
    await world.host("revoked", ["d1"])
    await world.repo.revoke_host("revoked")
    world.clock.advance(31)  # "silent" is now past the liveness window ...
    await world.host("live", ["d1"])  # ... while "live" just heartbeat
    await world.submit()
    await world.submit()

    got = await world.repo.assign()

    assert [a.host_id for a in got] == ["live"]


async def test_a_retrying_task_is_not_assigned_before_its_eligible_time(world: World) -> None:
    session = await world.host("h1", ["d1"])
    a = await world.assigned(session, base=10)
    world.clock.advance(31)
    (expired,) = await world.repo.expire_due()
    assert expired.new_state is TaskState.RETRYING
    assert expired.retry_at == world.clock.now() + timedelta(seconds=10)
    await world.beat(session)

    world.clock.advance(9.999)
    assert await world.repo.assign() == []
    world.clock.advance(0.001)
    (again,) = await world.repo.assign()
    assert (again.task_id, again.attempt) == (a.task_id, 2)


# --- Requirement: Host claim transitions assigned work to dispatched ----------------


async def test_owning_host_claims_once_and_the_task_becomes_dispatched(world: World) -> None:
    session = await world.host("h1", ["d1"])
    a = await world.assigned(session)

    claimed = await world.repo.claim(session, a.task_id, a.attempt)

    assert (claimed.task_id, claimed.attempt, claimed.device_id) == (a.task_id, 1, "d1")
    assert (await world.task_row(a.task_id))["status"] == "dispatched"
    with pytest.raises(Conflict) as err:
        await world.repo.claim(session, a.task_id, a.attempt)
    assert err.value.fields["reason"] == "already_claimed"


async def test_a_claim_made_in_the_assigning_transaction_is_the_owning_hosts_one_claim(
    world: World,
) -> None:
    s1 = await world.host("h1", ["d1", "d2"])
    await world.host("h2", ["e1"])
    ids = {await world.submit() for _ in range(3)}
    asked: list[str] = []

    def claimer(a: Any) -> Session | None:
        # A claimer for one of h1's two devices.
        asked.append(a.task_id)
        return s1 if (a.host_id, a.device_id) == ("h1", "d2") else None

    got, claims = await world.repo.assign_and_claim(claimer=claimer)

    assert {a.task_id for a in got} == ids and sorted(asked) == sorted(ids)
    (claimed,) = claims
    assert (claimed.host_id, claimed.device_id) == ("h1", "d2")
    (a,) = [a for a in got if a.task_id == claimed.task_id]
    assert (claimed.attempt, claimed.lease_id) == (a.attempt, a.lease_id)
    states = {t: (await world.task_row(t))["status"] for t in ids}
    assert sorted(states.values()) == ["assigned", "assigned", "dispatched"]
    assert states[claimed.task_id] == "dispatched"
    (attempt,) = await world.attempt_rows(claimed.task_id)
    assert attempt["lease_token_hash"] == hash_secret(claimed.lease_token)
    assert attempt["session_generation"] == s1.generation
    # It is the one claim: another is refused, the lease token works.
    with pytest.raises(Conflict) as err:
        await world.repo.claim(s1, claimed.task_id, claimed.attempt)
    assert err.value.fields["reason"] == "already_claimed"
    status = await world.repo.ack(s1, claimed.task_id, claimed.attempt, claimed.lease_token)
    assert status.state is TaskState.RUNNING


async def test_a_superseded_claimer_is_refused_and_its_assignment_stays_assigned(
    world: World,
) -> None:
    old = await world.host("h1", ["d1"])
    new = await world.host("h1", ["d1"])  # registered again: ``old`` is superseded
    task_id = await world.submit()

    got, claims = await world.repo.assign_and_claim(claimer=lambda a: old)

    assert [a.task_id for a in got] == [task_id] and claims == []
    assert (await world.task_row(task_id))["status"] == "assigned"
    claimed = await world.repo.claim(new, task_id, 1)
    assert claimed.task_id == task_id


async def test_tasks_assigned_together_go_to_devices_of_different_waiting_requests(
    world: World,
) -> None:
    s1 = await world.host("h1", ["d1", "d2", "d3", "d4"])
    ids = {await world.submit() for _ in range(2)}
    # Two requests wait, each for two devices; each claims one assignment.
    request = {"d1": "P", "d2": "P", "d3": "Q", "d4": "Q"}

    got, claims = await world.repo.assign_and_claim(
        claimer=lambda a: s1, waiting=lambda host, device: request[device]
    )

    assert {a.task_id for a in got} == ids
    assert sorted(a.device_id for a in got) == ["d1", "d3"]
    assert len(claims) == 2
    # Without it, the first free devices in order.
    ids = {await world.submit() for _ in range(2)}
    await world.host("h2", ["e1", "e2"])
    got = await world.repo.assign()
    assert sorted(a.device_id for a in got) == ["d2", "d4"]


async def test_the_device_preference_asks_a_bounded_number_of_times_per_transaction(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(assign, "_PREFER_BUDGET", 2)
    s1 = await world.host("h1", ["d1", "d2", "d3", "d4", "d5", "d6"])
    ids = {await world.submit() for _ in range(3)}
    asked: list[str] = []

    def waiting(host: str, device: str) -> str:
        asked.append(device)
        return {"d1": "P", "d2": "P", "d3": "Q", "d4": "Q"}.get(device, "R")

    got, _ = await world.repo.assign_and_claim(claimer=lambda a: s1, waiting=waiting)

    # Asked twice (d1, then d2, whose request had one already); then devices
    # in order, as without waiting requests: every task still assigned.
    assert asked == ["d1", "d2"]
    assert {a.task_id for a in got} == ids
    assert sorted(a.device_id for a in got) == ["d1", "d2", "d3"]


@pytest.mark.parametrize("claimer", [None, "h1", lambda a: "h1", lambda a: a.host_id])
async def test_a_bad_claimer_is_invalid_and_assigns_nothing(world: World, claimer: Any) -> None:
    session = await world.host("h1", ["d1"])
    task_id = await world.submit()

    with pytest.raises(Invalid):
        await world.repo.assign_and_claim(claimer=claimer)
    with pytest.raises(Invalid):
        await world.repo.assign_and_claim(claimer=lambda a: session, waiting="d1")  # type: ignore[arg-type]

    assert (await world.task_row(task_id))["status"] == "queued"
    got, claims = await world.repo.assign_and_claim(claimer=lambda a: session)
    assert [a.task_id for a in got] == [task_id] and len(claims) == 1


async def test_claim_next_returns_the_oldest_assignment_of_this_host_or_none(
    world: World,
) -> None:
    session = await world.host("h1", ["d1", "d2"])
    other = await world.host("h2", [])
    first = await world.assigned(session)
    world.clock.advance(1)
    await world.assigned(session)

    assert await world.repo.claim_next(other) is None
    claimed = await world.repo.claim_next(session)
    assert claimed is not None and claimed.task_id == first.task_id
    assert (await world.repo.claim_next(session, device_ids=["nope"])) is None


async def test_claim_after_the_claim_deadline_is_gone(world: World) -> None:
    session = await world.host("h1", ["d1"])
    a = await world.assigned(session)
    world.clock.advance(30)  # exactly at the deadline: too late

    with pytest.raises(Gone):
        await world.repo.claim(session, a.task_id, a.attempt)
    assert (await world.task_row(a.task_id))["status"] == "assigned"


async def test_pending_assignments_lists_only_unclaimed_unexpired_ones(world: World) -> None:
    session = await world.host("h1", ["d1", "d2"])
    a = await world.assigned(session)
    c = await world.dispatched(session)

    pending = await world.repo.pending_assignments("h1")

    assert [p.task_id for p in pending] == [a.task_id]
    assert c.task_id not in {p.task_id for p in pending}
    world.clock.advance(30)
    assert await world.repo.pending_assignments("h1") == []


async def test_session_pending_checks_the_session_in_the_same_read(world: World) -> None:
    session = await world.host("h1", ["d1", "d2"])
    idle = await world.host("h2", ["d3"])
    a = await world.assigned(session)

    assert [p.task_id for p in await world.repo.session_pending(session)] == [a.task_id]
    assert await world.repo.session_pending(session, device_ids=["d9"]) == []
    assert await world.repo.session_pending(idle) == []  # current, nothing pending
    newer = await world.repo.register_session("h1", world.credentials["h1"])
    with pytest.raises(Unauthorized):
        await world.repo.session_pending(session)  # superseded
    assert [p.task_id for p in await world.repo.session_pending(newer)] == [a.task_id]
    await world.repo.revoke_host("h1")
    with pytest.raises(Unauthorized):
        await world.repo.session_pending(newer)
    with pytest.raises(Unauthorized):
        await world.repo.session_pending(Session(host_id="nobody", generation=1))


# --- Requirement: Expired attempts follow bounded retry policy -------------------------


async def test_lease_expires_with_attempts_remaining_returns_task_to_queued(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=0)
    world.clock.advance(30)

    (e,) = await world.repo.expire_due()

    assert (e.task_id, e.reason, e.new_state, e.retry_at) == (
        c.task_id,
        EndReason.LEASE_EXPIRED,
        TaskState.QUEUED,
        None,
    )
    assert (await world.task_row(c.task_id))["status"] == "queued"
    assert await world.reservations() == []
    (attempt,) = await world.attempt_rows(c.task_id)
    assert attempt["end_reason"] == "lease_expired"
    assert attempt["ended_at"] == world.clock.now()
    assert (attempt["host_id"], attempt["device_id"]) == ("h1", "d1")


async def test_an_expired_lease_keeps_its_device_out_of_use_until_the_host_reports_again(
    world: World,
) -> None:
    """Hosts do not report their own leases' busy/idle flips (the reservation
    covers them); after an expiry the host may still be running on the device,
    so it stays out of use until the host's next report."""
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=0)
    world.clock.advance(20)
    # Still live; its last report of d1 said idle (as before it started on it).
    await world.beat(session, "d1", DeviceSnapshot(device_id="d2", state="busy"))
    world.clock.advance(10)

    (e,) = await world.repo.expire_due()

    assert (e.task_id, e.new_state) == (c.task_id, TaskState.QUEUED)
    rows = await world.rows("SELECT state FROM devices WHERE device_id = 'd1'")
    assert [r["state"] for r in rows] == ["busy"]
    assert await world.repo.assign() == []
    await world.beat(session, "d1", DeviceSnapshot(device_id="d2", state="busy"))
    (again,) = await world.repo.assign()
    assert (again.task_id, again.attempt, again.device_id) == (c.task_id, 2, "d1")


async def test_lease_expires_at_attempt_limit_and_task_fails_with_lease_expiry_reason(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, max_attempts=1)
    world.clock.advance(30)

    (e,) = await world.repo.expire_due()

    assert e.new_state is TaskState.FAILED
    row = await world.task_row(c.task_id)
    assert (row["status"], row["terminal_reason"]) == ("failed", "lease_expired")
    assert row["finished_at"] == world.clock.now()
    assert await world.reservations() == []


async def test_lease_expires_with_a_cancellation_pending_and_task_is_cancelled(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, max_attempts=5)
    await world.repo.request_cancel(c.task_id, world.alice)
    world.clock.advance(30)

    (e,) = await world.repo.expire_due()

    assert e.new_state is TaskState.CANCELLED
    assert (await world.task_row(c.task_id))["status"] == "cancelled"
    assert await world.reservations() == []


async def test_claim_and_ack_deadlines_expire_with_their_own_end_reasons(world: World) -> None:
    session = await world.host("h1", ["d1", "d2"])
    unclaimed = await world.assigned(session)
    unacked = await world.dispatched(session)
    world.clock.advance(30)

    got = {e.task_id: e.reason for e in await world.repo.expire_due()}

    assert got == {
        unclaimed.task_id: EndReason.CLAIM_EXPIRED,
        unacked.task_id: EndReason.ACK_EXPIRED,
    }


async def test_nothing_expires_before_its_deadline(world: World) -> None:
    session = await world.host("h1", ["d1"])
    await world.running(session)
    world.clock.advance(29.999)

    assert await world.repo.expire_due() == []


async def test_backoff_is_exponential_and_capped(world: World) -> None:
    session = await world.host("h1", ["d1"])
    task_id = await world.submit(max_attempts=4, base=2, cap=5)
    delays = []
    for _ in range(3):
        world.clock.advance(100)
        await world.beat(session)
        (a,) = await world.repo.assign()
        assert a.task_id == task_id
        world.clock.advance(30)
        (e,) = await world.repo.expire_due()
        assert e.retry_at is not None
        delays.append((e.retry_at - world.clock.now()).total_seconds())

    assert delays == [2, 4, 5]


async def test_next_deadline_is_the_earliest_active_deadline_or_retry_time(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    assert await world.repo.next_deadline() is None
    a = await world.assigned(session, base=7)
    assert await world.repo.next_deadline() == a.claim_deadline
    world.clock.advance(30)
    await world.repo.expire_due()
    assert await world.repo.next_deadline() == world.clock.now() + timedelta(seconds=7)


async def test_active_attempts_lists_every_in_flight_attempt(world: World) -> None:
    s1 = await world.host("h1", ["d1"])
    s2 = await world.host("h2", ["d1"])
    a = await world.assigned(s1)
    b = await world.running(s2)

    assert {x.task_id for x in await world.repo.active_attempts()} == {a.task_id, b.task_id}
    assert [x.task_id for x in await world.repo.active_attempts("h2")] == [b.task_id]


# --- Requirement: Terminal transitions validate the active lease --------------------


@pytest.mark.parametrize(
    ("outcome", "state"),
    [(Outcome.DONE, "done"), (Outcome.FAILED, "failed"), (Outcome.CANCELLED, "cancelled")],
)
async def test_active_lease_reports_completion_and_the_task_transitions_once(
    world: World, outcome: Outcome, state: str
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    rec = await world.repo.report_result(
        session, c.task_id, c.attempt, c.lease_token, outcome=outcome, fingerprint="f1"
    )

    assert (rec.state.value, rec.replayed) == (state, False)
    row = await world.task_row(c.task_id)
    assert (row["status"], row["result_attempt"], row["result_fingerprint"]) == (state, 1, "f1")
    assert await world.reservations() == []
    (attempt,) = await world.attempt_rows(c.task_id)
    assert attempt["ended_at"] == world.clock.now()


async def test_superseded_lease_reports_completion_and_is_rejected(world: World) -> None:
    session = await world.host("h1", ["d1"])
    old = await world.running(session, base=0)
    world.clock.advance(30)
    await world.repo.expire_due()
    await world.beat(session)
    (new,) = await world.repo.assign()
    before = await world.snapshot()

    with pytest.raises(Conflict) as err:
        await world.repo.report_result(
            session,
            old.task_id,
            old.attempt,
            old.lease_token,
            outcome=Outcome.DONE,
            fingerprint="late",
        )

    assert err.value.fields["reason"] == "stale_attempt"
    assert await world.snapshot() == before
    assert new.attempt == 2


async def test_result_from_an_expired_lease_awaiting_retry_is_rejected(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session, base=5)
    world.clock.advance(30)
    await world.repo.expire_due()
    before = await world.snapshot()

    with pytest.raises(Conflict):
        await world.repo.report_result(
            session, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="x"
        )

    assert await world.snapshot() == before


async def test_a_pinned_task_that_loses_its_device_does_not_keep_another_task_waiting(
    world: World,
) -> None:
    # Found by the state machine: two free devices, three waiting tasks; the first
    # two are pinned to h1, which has one free device: the third must still get h0's.
    await world.host("h0", ["d0"])
    await world.host("h1", ["d0"])
    first = await world.submit(selector={"host": "h1"}, priority=1)
    await world.submit(selector={"host": "h1"})
    anywhere = await world.submit()

    got = {a.task_id: a.host_id for a in await world.repo.assign()}

    assert got == {first: "h1", anywhere: "h0"}
