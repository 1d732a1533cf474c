"""host-agent.md (the repository side), task-cancellation.md's own requirements,
hosts and sessions, logs and artifacts."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fleetlease.persistence.errors import Conflict, Forbidden, Gone, NotFound, Unauthorized
from fleetlease.persistence.model import (
    DeviceSnapshot,
    Outcome,
    Session,
    TaskKind,
    TaskSpec,
    TaskState,
)
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


# --- Requirement: Host identity is authenticated and bound to one host id -----------


async def test_host_authenticates_as_itself_and_may_heartbeat_claim_renew_and_report(
    world: World,
) -> None:
    credential = await world.repo.add_host("h1")
    session = await world.repo.register_session("h1", credential)
    await world.beat(session)
    a = await world.assigned(session)

    c = await world.repo.claim(session, a.task_id, a.attempt)
    await world.repo.ack(session, c.task_id, c.attempt, c.lease_token)
    await world.repo.renew(session, c.task_id, c.attempt, c.lease_token)
    rec = await world.repo.report_result(
        session, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
    )

    assert rec.state is TaskState.DONE
    assert await world.repo.current_generation("h1") == session.generation == 1


async def test_host_attempting_to_impersonate_another_host_is_rejected_without_changes(
    world: World,
) -> None:
    a_session = await world.host("hA", ["d1"])
    b_session = await world.host("hB", ["d1"])
    b_work = await world.dispatched(b_session)
    await world.repo.register_session("hB", world.credentials["hB"])  # B is now at gen 2
    before = await world.snapshot()
    devices_before = await world.repo.list_devices()

    with pytest.raises(Forbidden):
        await world.repo.claim(a_session, b_work.task_id, b_work.attempt)
    with pytest.raises(Unauthorized):
        # A's generation presented for host B: not B's current session.
        await world.repo.heartbeat(Session(host_id="hB", generation=a_session.generation), [])

    assert await world.snapshot() == before
    assert await world.repo.list_devices() == devices_before


async def test_register_session_rejects_unknown_host_wrong_credential_and_revoked_host_alike(
    world: World,
) -> None:
    credential = await world.repo.add_host("h1")
    messages = []
    for host, cred in (("nope", credential), ("h1", "wrong"), ("h1", None)):
        if cred is None:
            await world.repo.revoke_host("h1")
            cred = credential
        with pytest.raises(Unauthorized) as err:
            await world.repo.register_session(host, cred)
        messages.append(err.value.message)

    assert len(set(messages)) == 1
    assert await world.repo.current_generation("h1") is None


async def test_each_registration_starts_a_new_generation_and_kills_the_older_ones(
    world: World,
) -> None:
    credential = await world.repo.add_host("h1")
    s1 = await world.repo.register_session("h1", credential)
    s2 = await world.repo.register_session("h1", credential)

    assert (s1.generation, s2.generation) == (1, 2)
    with pytest.raises(Unauthorized):
        await world.repo.heartbeat(s1, [])
    await world.repo.heartbeat(s2, [])


async def test_adding_an_existing_host_conflicts_but_a_revoked_one_is_reissued(
    world: World,
) -> None:
    old_credential = await world.repo.add_host("h1")
    old = await world.repo.register_session("h1", old_credential)
    with pytest.raises(Conflict):
        await world.repo.add_host("h1")

    await world.repo.revoke_host("h1")
    new_credential = await world.repo.add_host("h1")

    assert new_credential != old_credential
    with pytest.raises(Unauthorized):
        await world.repo.heartbeat(old, [])
    with pytest.raises(Unauthorized):
        await world.repo.register_session("h1", old_credential)
    new = await world.repo.register_session("h1", new_credential)
    assert new.generation > old.generation


async def test_revoking_a_host_ends_its_active_attempts_and_releases_their_devices(
    world: World,
) -> None:
    session = await world.host("h1", ["d1", "d2"])
    a = await world.assigned(session, base=0)
    c = await world.running(session, max_attempts=1)

    ended = {e.task_id: e for e in await world.repo.revoke_host("h1")}

    assert ended[a.task_id].new_state is TaskState.QUEUED
    assert ended[c.task_id].new_state is TaskState.FAILED
    assert (await world.task_row(c.task_id))["terminal_reason"] == "host_revoked"
    assert await world.reservations() == []
    assert await world.repo.revoke_host("h1") == []
    with pytest.raises(NotFound):
        await world.repo.revoke_host("ghost")


# --- Requirement: Host Agent synchronizes heartbeat and complete device snapshots ---


async def test_host_reports_devices_and_they_appear_in_the_pool_with_last_seen_refreshed(
    world: World,
) -> None:
    session = await world.host("h1", [])
    world.clock.advance(7)

    await world.repo.heartbeat(
        session,
        [
            DeviceSnapshot(device_id="d1", capabilities={"os": "android"}),
            DeviceSnapshot(device_id="d2", state="busy"),
        ],
    )

    (host,) = await world.repo.list_hosts()
    assert host == {
        "host_id": "h1",
        "live": True,
        "last_seen": world.clock.now().isoformat(),
        "session_generation": 1,
        "revoked": False,
        "devices": 2,
        "workflows": None,
        "goal_runner": None,
        "drain": None,
    }
    assert await world.repo.list_devices() == [
        {
            "host_id": "h1",
            "device_id": "d1",
            "state": "idle",
            "capabilities": {"os": "android"},
            "task_id": None,
        },
        {"host_id": "h1", "device_id": "d2", "state": "busy", "capabilities": {}, "task_id": None},
    ]


async def test_host_reports_no_devices_and_only_its_own_records_are_removed(
    world: World,
) -> None:
    s1 = await world.host("h1", ["d1", "d2"])
    await world.host("h2", ["d1"])

    await world.repo.heartbeat(s1, [])

    assert [(d["host_id"], d["device_id"]) for d in await world.repo.list_devices()] == [
        ("h2", "d1")
    ]


async def test_a_heartbeat_replaces_the_snapshot_and_keeps_reservations_visible(
    world: World,
) -> None:
    session = await world.host("h1", ["d1", "d2"])
    a = await world.assigned(session)

    await world.beat(session, a.device_id, "d3")

    devices = {d["device_id"]: d for d in await world.repo.list_devices()}
    assert set(devices) == {a.device_id, "d3"}
    assert devices[a.device_id]["task_id"] == a.task_id


async def test_a_host_past_the_liveness_window_is_listed_as_not_live(world: World) -> None:
    await world.host("h1", ["d1"])
    world.clock.advance(30)

    (host,) = await world.repo.list_hosts()

    assert host["live"] is False


# --- Requirement: Host Agent receives work through outbound long-polling -------------


async def test_assigned_work_is_claimed_by_the_poll_with_task_device_attempt_lease_payload(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    task_id = await world.repo.submit(
        TaskSpec(
            kind=TaskKind.WORKFLOW,
            workflow="login-flow",
            payload={"user": "x"},
            project="p1",
            owner="alice",
        )
    )
    await world.repo.assign()

    claimed = await world.repo.claim_next(session)

    assert claimed is not None
    assert (claimed.task_id, claimed.device_id, claimed.attempt) == (task_id, "d1", 1)
    assert (claimed.kind, claimed.workflow, claimed.goal, claimed.payload) == (
        TaskKind.WORKFLOW,
        "login-flow",
        None,
        {"user": "x"},
    )
    assert len(claimed.lease_token) == 64 and claimed.lease_id
    assert claimed.ack_deadline == world.clock.now() + timedelta(seconds=15)
    assert "lease_token" not in repr(claimed)
    assert (await world.task_row(task_id))["status"] == "dispatched"


async def test_no_work_available_gives_an_empty_poll_response(world: World) -> None:
    session = await world.host("h1", ["d1"])

    assert await world.repo.claim_next(session) is None


# --- Requirement: Active execution renews its lease -------------------------------


async def test_lease_renewal_extends_expiry_without_changing_attempt_or_device(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    world.clock.advance(20)

    status = await world.repo.renew(session, c.task_id, c.attempt, c.lease_token)

    assert status.lease_expires_at == world.clock.now() + timedelta(seconds=30)
    (attempt,) = await world.attempt_rows(c.task_id)
    assert (attempt["number"], attempt["device_id"], attempt["lease_expires_at"]) == (
        1,
        "d1",
        status.lease_expires_at,
    )


@pytest.mark.parametrize("kind", ["expired", "replaced", "foreign"])
async def test_lease_that_is_stale_or_foreign_gets_a_conflict_and_nothing_changes(
    world: World, kind: str
) -> None:
    session = await world.host("h1", ["d1"])
    other = await world.host("h2", ["d1"])
    c = await world.running(session, base=0)
    token = c.lease_token
    if kind == "expired":
        world.clock.advance(30)
    elif kind == "replaced":
        world.clock.advance(30)
        await world.repo.expire_due()
        await world.beat(session)
        (a,) = await world.repo.assign()
        await world.repo.claim(session, a.task_id, a.attempt)
    else:
        mine = await world.running(other)
        c, token = mine, "0" * 64  # h2's attempt, with a lease h1 does not hold
    before = await world.snapshot()

    with pytest.raises(Conflict):
        await world.repo.renew(session, c.task_id, c.attempt, token)

    assert await world.snapshot() == before


async def test_renewal_while_dispatched_reports_cancel_but_never_passes_the_ack_deadline(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.dispatched(session)
    world.clock.advance(10)

    status = await world.repo.renew(session, c.task_id, c.attempt, c.lease_token)

    assert (status.state, status.lease_expires_at) == (TaskState.DISPATCHED, c.ack_deadline)


async def test_progress_counts_as_renewal_and_its_sequence_only_grows(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    world.clock.advance(10)
    await world.repo.progress(session, c.task_id, 1, c.lease_token, 5)
    world.clock.advance(10)

    status = await world.repo.progress(session, c.task_id, 1, c.lease_token, 3)

    assert status.lease_expires_at == world.clock.now() + timedelta(seconds=30)
    assert (await world.task_row(c.task_id))["progress_seq"] == 5


async def test_renew_many_gives_each_renewal_its_own_outcome(
    world: World,
) -> None:
    from fleetlease.persistence.repository import Renewal

    session = await world.host("h1", ["d1", "d2"])
    good = await world.running(session)
    other = await world.running(session)
    world.clock.advance(5)

    out = await world.repo.renew_many(
        [
            Renewal(session=session, task_id=good.task_id, attempt=1, lease_token=good.lease_token),
            Renewal(session=session, task_id=other.task_id, attempt=1, lease_token="bad"),
            Renewal(
                session=session,
                task_id="00000000-0000-0000-0000-000000000000",
                attempt=1,
                lease_token="x",
            ),
            Renewal(session=session, task_id=other.task_id, attempt=0, lease_token="x"),
        ]
    )

    ok, bad, missing, invalid = out
    assert not isinstance(ok, Exception)
    assert ok.lease_expires_at == world.clock.now() + timedelta(seconds=30)
    assert isinstance(bad, Conflict) and isinstance(missing, NotFound)
    assert type(invalid).__name__ == "Invalid"
    rows = {str(r["task_id"]): r for r in await world.rows("SELECT * FROM attempts")}
    assert rows[good.task_id]["lease_expires_at"] == ok.lease_expires_at
    assert rows[other.task_id]["lease_expires_at"] < ok.lease_expires_at


async def test_a_repeated_ack_of_a_running_attempt_returns_the_current_status(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    world.clock.advance(1)

    status = await world.repo.ack(session, c.task_id, 1, c.lease_token)

    assert status.state is TaskState.RUNNING
    assert status.lease_expires_at == world.clock.now() + timedelta(seconds=29)


# --- Requirement: Terminal result reporting is idempotent ----------------------------


async def test_report_a_successful_result_marks_done_releases_device_records_metadata(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    await world.repo.report_result(
        session,
        c.task_id,
        1,
        c.lease_token,
        outcome=Outcome.DONE,
        fingerprint="sha:1",
        result={"screens": 3},
    )

    view = await world.repo.task_view(c.task_id, world.alice)
    assert (view["state"], view["result"], view["terminal_reason"]) == (
        "done",
        {"screens": 3},
        "done",
    )
    assert view["finished_at"] == world.clock.now().isoformat()
    assert view["attempts"][0]["end_reason"] == "done"
    assert await world.reservations() == []


async def test_retry_a_result_after_response_loss_returns_it_without_a_new_attempt(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    await world.repo.report_result(
        session, c.task_id, 1, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
    )
    # The host restarted meanwhile and reports again from its new session.
    new = await world.repo.register_session("h1", world.credentials["h1"])

    rec = await world.repo.report_result(
        new, c.task_id, 1, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
    )

    assert rec.replayed and rec.state is TaskState.DONE
    assert len(await world.attempt_rows(c.task_id)) == 1


async def test_stale_attempt_reports_after_requeue_and_the_newer_attempt_is_preserved(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    old = await world.running(session, base=0)
    world.clock.advance(30)
    await world.repo.expire_due()
    await world.beat(session)
    (a,) = await world.repo.assign()
    before = await world.snapshot()

    with pytest.raises(Conflict):
        await world.repo.report_result(
            session, old.task_id, 1, old.lease_token, outcome=Outcome.FAILED, fingerprint="x"
        )

    assert await world.snapshot() == before
    assert (await world.task_row(a.task_id))["status"] == "assigned"


# --- task-cancellation.md ------------------------------------------------------------


@pytest.mark.parametrize("where", ["queued", "assigned", "dispatched"])
async def test_cancelled_is_a_terminal_state_no_assignment_claim_or_renewal_accepts(
    world: World, where: str
) -> None:
    session = await world.host("h1", ["d1"])
    token = "x"
    if where == "queued":
        task_id = await world.submit(selector={"host": "h1"})
        await world.repo.request_cancel(task_id, world.alice)
        attempt = 1
    elif where == "assigned":
        a = await world.assigned(session)
        task_id, attempt = a.task_id, a.attempt
        await world.repo.request_cancel(task_id, world.alice)
        world.clock.advance(30)  # never claimed: the claim deadline resolves the cancel
        await world.repo.expire_due()
    else:
        c = await world.dispatched(session)
        task_id, attempt, token = c.task_id, c.attempt, c.lease_token
        await world.repo.request_cancel(task_id, world.alice)
        await world.repo.report_result(
            session, task_id, attempt, token, outcome=Outcome.CANCELLED, fingerprint="c"
        )
    assert (await world.task_row(task_id))["status"] == "cancelled"
    await world.beat(session)

    assert await world.repo.assign() == []
    with pytest.raises((Conflict, Gone)):
        await world.repo.claim(session, task_id, attempt)
    with pytest.raises((Conflict, Gone)):
        await world.repo.renew(session, task_id, attempt, token)
    assert (await world.task_row(task_id))["status"] == "cancelled"


async def test_cancellation_request_survives_a_restart_and_reaches_the_next_renewal(
    world: World, db_url: str
) -> None:
    from fleetlease.persistence.db import create_engine
    from fleetlease.persistence.repository import Repository
    from tests.integration.test_repository_support import TIMINGS

    session = await world.host("h1", ["d1"])
    c = await world.dispatched(session)
    await world.repo.request_cancel(c.task_id, world.alice)

    engine = create_engine(db_url, pool_size=1)
    try:
        status = await Repository(engine, world.clock, TIMINGS).renew(
            session, c.task_id, c.attempt, c.lease_token
        )
    finally:
        await engine.dispose()

    assert status.cancel_requested


async def test_renewal_on_a_task_with_a_pending_cancellation_extends_and_reports_it(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    await world.repo.request_cancel(c.task_id, world.root)
    world.clock.advance(10)

    status = await world.repo.renew(session, c.task_id, 1, c.lease_token)

    assert status.cancel_requested
    assert status.lease_expires_at == world.clock.now() + timedelta(seconds=30)


async def test_renewal_on_a_task_without_a_pending_cancellation_extends_and_reports_none(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    world.clock.advance(10)

    status = await world.repo.renew(session, c.task_id, 1, c.lease_token)

    assert not status.cancel_requested
    assert status.lease_expires_at == world.clock.now() + timedelta(seconds=30)


# --- logs and artifacts --------------------------------------------------------------


async def test_log_lines_are_stored_once_in_order_and_read_back_by_authorized_users(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    assert await world.repo.append_logs(session, c.task_id, 1, 0, ["a", "b"]) == 2
    assert await world.repo.append_logs(session, c.task_id, 1, 1, ["b", "c"]) == 1

    lines = await world.repo.read_logs(c.task_id, world.carol)
    assert [(x["seq"], x["line"]) for x in lines] == [(0, "a"), (1, "b"), (2, "c")]
    assert await world.repo.read_logs(c.task_id, world.alice, after_id=lines[1]["id"]) == [lines[2]]


async def test_logs_and_artifacts_of_another_hosts_attempt_are_forbidden(world: World) -> None:
    owner = await world.host("h1", ["d1"])
    other = await world.host("h2", [])
    c = await world.running(owner)

    with pytest.raises(Forbidden):
        await world.repo.append_logs(other, c.task_id, 1, 0, ["x"])
    with pytest.raises(Forbidden):
        await world.repo.record_artifact(
            other, c.task_id, 1, name="a", size=1, sha256="0" * 64, object_name="o"
        )


async def test_artifacts_are_recorded_idempotently_and_listed(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)
    args = {"name": "shot.png", "size": 10, "sha256": "a" * 64, "object_name": "obj/1"}

    await world.repo.record_artifact(session, c.task_id, 1, **args)  # type: ignore[arg-type]
    await world.repo.record_artifact(session, c.task_id, 1, **args)  # type: ignore[arg-type]
    with pytest.raises(Conflict):
        await world.repo.record_artifact(
            session, c.task_id, 1, name="shot.png", size=11, sha256="b" * 64, object_name="o"
        )

    (art,) = await world.repo.list_artifacts(c.task_id, world.alice)
    assert (art["name"], art["size"], art["attempt"]) == ("shot.png", 10, 1)


async def test_users_authenticate_with_their_token_only(world: World) -> None:
    token = await world.repo.add_user("dave")

    assert (await world.repo.authenticate_user(token)).name == "dave"
    with pytest.raises(Unauthorized):
        await world.repo.authenticate_user("nope")
    with pytest.raises(Conflict):
        await world.repo.add_user("dave")
