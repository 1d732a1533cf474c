"""Drain in the repository: a drained host or device takes no new assignment,
its active attempts run on, undrain makes it eligible again, the drain outlives
heartbeats, and past a host's drain deadline its attempts are handed back."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fleetlease.persistence.errors import Invalid, NotFound
from fleetlease.persistence.model import DeviceSnapshot, EndReason, Outcome, TaskState
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


def _snaps(*ids: str) -> list[DeviceSnapshot]:
    return [DeviceSnapshot(device_id=d, capabilities={"os": "android"}) for d in ids]


async def test_a_drained_host_gets_no_new_task_while_another_host_does(world: World) -> None:
    await world.host("h1", _snaps("d1"))
    await world.host("h2", _snaps("d2"))
    out = await world.repo.drain_host("h1")
    assert out["host_id"] == "h1" and out["deadline"] is None and out["active"] == 0
    ids = [await world.submit(selector={"os": "android"}) for _ in range(2)]

    got = await world.repo.assign()

    assert [(a.task_id, a.host_id) for a in got] == [(ids[0], "h2")]
    assert (await world.task_row(ids[1]))["status"] == "queued"


async def test_the_running_task_of_a_drained_host_finishes(world: World) -> None:
    session = await world.host("h1", ["d1"])
    c = await world.running(session)

    out = await world.repo.drain_host("h1")
    assert out["active"] == 1
    await world.repo.renew(session, c.task_id, c.attempt, c.lease_token)
    rec = await world.repo.report_result(
        session, c.task_id, c.attempt, c.lease_token, outcome=Outcome.DONE, fingerprint="f"
    )

    assert rec.state is TaskState.DONE
    assert await world.reservations() == []
    # Idle, and still drained: nothing new lands on it.
    await world.submit(selector={"host": "h1"})
    assert await world.repo.assign() == []


async def test_undrain_makes_a_host_eligible_again(world: World) -> None:
    await world.host("h1", ["d1"])
    await world.repo.drain_host("h1")
    task_id = await world.submit(selector={"host": "h1"})
    assert await world.repo.assign() == []

    assert (await world.repo.undrain_host("h1"))["was_drained"] is True
    (a,) = await world.repo.assign()

    assert (a.task_id, a.host_id) == (task_id, "h1")
    assert (await world.repo.undrain_host("h1"))["was_drained"] is False


async def test_a_drained_device_is_skipped_and_the_drain_outlives_heartbeats(
    world: World,
) -> None:
    session = await world.host("h1", _snaps("d1", "d2"))
    await world.repo.drain_device("h1", "d1")
    # Heartbeats replace the device rows: the device, even gone and back, stays drained.
    await world.repo.heartbeat(session, _snaps("d2"))
    await world.repo.heartbeat(session, _snaps("d1", "d2"))
    ids = [await world.submit(selector={"os": "android"}) for _ in range(2)]

    got = await world.repo.assign()

    assert [(a.task_id, a.device_id) for a in got] == [(ids[0], "d2")]
    seen = await world.repo.fleet_devices(world.root, host_id="h1")
    views = {d["device_id"]: d["drained"] for d in seen}
    assert views == {"d1": True, "d2": False}
    await world.repo.undrain_device("h1", "d1")
    (a,) = await world.repo.assign()
    assert (a.task_id, a.device_id) == (ids[1], "d1")


async def test_hosts_and_devices_show_the_drain(world: World) -> None:
    await world.host("h1", ["d1"])
    await world.host("h2", ["d2"])
    out = await world.repo.drain_host("h1", deadline_s=60)

    hosts = {h["host_id"]: h for h in await world.repo.list_hosts()}
    assert hosts["h1"]["drain"] == {
        "requested_at": out["requested_at"],
        "deadline": out["deadline"],
    }
    assert hosts["h2"]["drain"] is None
    assert out["deadline"] is not None
    devices = {d["host_id"]: d["drained"] for d in await world.repo.fleet_devices(world.root)}
    assert devices == {"h1": True, "h2": False}
    # A second drain keeps the first request's time and replaces the deadline.
    world.clock.advance(5)
    again = await world.repo.drain_host("h1")
    assert (again["requested_at"], again["deadline"]) == (out["requested_at"], None)


async def test_past_the_deadline_the_attempt_is_handed_back_and_runs_elsewhere(
    world: World,
) -> None:
    s1 = await world.host("h1", _snaps("d1"))
    c = await world.running(s1, selector={"os": "android"}, base=5)
    await world.repo.drain_host("h1", deadline_s=20)
    assert await world.repo.next_drain_deadline() == world.clock.now() + timedelta(seconds=20)
    assert await world.repo.hand_back_drained() == []

    world.clock.advance(21)
    await world.repo.renew(s1, c.task_id, c.attempt, c.lease_token)  # lease still valid
    (e,) = await world.repo.hand_back_drained()

    assert (e.task_id, e.reason, e.new_state) == (c.task_id, EndReason.DRAINED, TaskState.QUEUED)
    (attempt,) = await world.attempt_rows(c.task_id)
    assert attempt["end_reason"] == "drained"
    assert await world.reservations() == []
    assert await world.repo.next_drain_deadline() is None
    # Queued at once (no backoff), and it goes to another host.
    await world.host("h2", _snaps("d2"))
    (a,) = await world.repo.assign()
    assert (a.task_id, a.attempt, a.host_id) == (c.task_id, 2, "h2")


async def test_a_handback_at_the_attempt_limit_fails_the_task(world: World) -> None:
    s1 = await world.host("h1", ["d1"])
    c = await world.running(s1, max_attempts=1)
    await world.repo.drain_host("h1", deadline_s=0)

    (e,) = await world.repo.hand_back_drained()

    assert e.new_state is TaskState.FAILED
    assert (await world.task_row(c.task_id))["terminal_reason"] == "drained"


async def test_bad_drain_requests_are_typed_and_change_nothing(world: World) -> None:
    await world.host("h1", ["d1"])
    before = await world.rows("SELECT host_id, drain_requested_at FROM hosts")
    with pytest.raises(NotFound):
        await world.repo.drain_host("nope")
    with pytest.raises(NotFound):
        await world.repo.drain_device("h1", "nope")
    with pytest.raises(Invalid):
        await world.repo.drain_host("h1", deadline_s=-1)
    with pytest.raises(Invalid):
        await world.repo.drain_host("h1", deadline_s=float("nan"))
    with pytest.raises(Invalid):
        await world.repo.drain_host("bad host")

    assert await world.rows("SELECT host_id, drain_requested_at FROM hosts") == before
    assert await world.rows("SELECT * FROM device_drains") == []
