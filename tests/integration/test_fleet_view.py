"""The fleet view (persistence/fleet_view.py) against a real PostgreSQL: a
device's state comes from its reservation, the host's lagging snapshot is shown
beside it where they disagree, and the counts are totals, not a page's rows."""

from __future__ import annotations

import pytest

from fleetlease.ops.userapi.projection import project_device
from fleetlease.persistence.fleet_view import device_view_state
from fleetlease.persistence.model import DeviceSnapshot, User
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded


async def test_a_reserved_device_reported_idle_is_busy_with_its_task_and_the_disagreement(
    world: World,
) -> None:
    session = await world.host("h1", ["d1", "d2"])
    a = await world.assigned(session)
    other = "d2" if a.device_id == "d1" else "d1"
    await world.beat(session, "d1", "d2")  # the host's snapshot: both idle

    rows = {d["device_id"]: d for d in await world.repo.fleet_devices(world.root)}

    assert rows[a.device_id]["state"] == "busy"
    assert rows[a.device_id]["task_id"] == a.task_id
    assert rows[a.device_id]["reported"] == "idle"
    assert rows[a.device_id]["disagreement"]
    assert rows[other]["state"] == "idle"
    assert rows[other]["task_id"] is None
    assert rows[other]["disagreement"] is None
    counts = await world.repo.fleet_counts(world.root)
    assert counts["devices"] == {"idle": 1, "busy": 1, "offline": 0}
    assert counts["disagreements"] == 1


async def test_an_unreserved_device_reported_busy_is_idle_and_the_disagreement_is_shown(
    world: World,
) -> None:
    session = await world.host("h1", ["d1"])
    await world.beat(
        session,
        DeviceSnapshot(device_id="d1", state="busy"),
        DeviceSnapshot(device_id="d2", state="offline"),
    )

    rows = {d["device_id"]: d for d in await world.repo.fleet_devices(world.root)}

    assert (rows["d1"]["state"], rows["d1"]["task_id"]) == ("idle", None)
    assert rows["d1"]["reported"] == "busy"
    assert rows["d1"]["disagreement"]
    assert (rows["d2"]["state"], rows["d2"]["disagreement"]) == ("offline", None)


async def test_a_reserved_device_whose_host_reports_it_busy_agrees(world: World) -> None:
    session = await world.host("h1", ["d1"])
    a = await world.assigned(session)
    await world.beat(session, DeviceSnapshot(device_id="d1", state="busy"))

    (row,) = await world.repo.fleet_devices(world.root)

    assert (row["state"], row["task_id"], row["disagreement"]) == ("busy", a.task_id, None)


async def test_a_busy_devices_task_is_named_only_to_users_who_may_read_that_task(
    world: World,
) -> None:
    await world.repo.add_user("eve")
    eve = User(name="eve", platform_admin=False)
    session = await world.host("h1", ["d1", "d2"])
    c = await world.running(session)  # alice's task in her project p1

    def shown(rows: list[dict[str, object]]) -> dict[object, tuple[object, ...]]:
        return {d["device_id"]: (d["state"], d["task_id"]) for d in map(project_device, rows)}

    busy = {c.device_id: ("busy", c.task_id)}
    for reader in (world.alice, world.carol, world.root):  # owner, project admin, admin
        rows = await world.repo.fleet_devices(reader)
        assert shown(rows).items() >= busy.items(), reader.name
        (row,) = [r for r in rows if r["device_id"] == c.device_id]
        assert row["attempt"] == c.attempt
    for stranger in (eve, world.bob):  # no role, owner of another project
        rows = await world.repo.fleet_devices(stranger)
        assert shown(rows)[c.device_id] == ("busy", None), stranger.name
        (row,) = [r for r in rows if r["device_id"] == c.device_id]
        assert row["attempt"] is None
        assert c.task_id not in repr(rows)
    # The totals still count the busy device for everyone.
    assert (await world.repo.fleet_counts(eve))["devices"]["busy"] == 1


async def test_counts_are_the_fleets_totals_when_the_list_is_limited(world: World) -> None:
    await world.host("h1", ["d1", "d2", "d3"])
    await world.host("h2", ["d1", "d2"])
    for _ in range(5):
        await world.submit(selector={"nowhere": "x"})  # stays queued
    await world.submit(project="p2", owner="bob", selector={"nowhere": "x"})

    limited = await world.repo.fleet_devices(world.root, limit=2)
    one_host = await world.repo.fleet_devices(world.root, host_id="h2")
    tasks = await world.repo.list_tasks(world.alice, limit=2)
    counts = await world.repo.fleet_counts(world.alice)

    assert len(limited) == 2
    assert [d["host_id"] for d in one_host] == ["h2", "h2"]
    assert len(tasks) == 2
    assert counts["devices"] == {"idle": 5, "busy": 0, "offline": 0}
    assert counts["devices_total"] == 5
    assert counts["tasks"] == {"queued": 5}  # bob's task is not alice's to count
    assert counts["tasks_total"] == 5
    assert (await world.repo.fleet_counts(world.root))["tasks_total"] == 6
    assert (await world.repo.fleet_counts(world.alice, host_id="h2"))["devices_total"] == 2


@pytest.mark.parametrize(
    ("reported", "task", "state", "disagrees"),
    [
        ("idle", None, "idle", False),
        ("offline", None, "offline", False),
        ("busy", None, "idle", True),
        ("busy", "t", "busy", False),
        ("idle", "t", "busy", True),
        ("offline", "t", "busy", True),
    ],
)
def test_device_view_state_table(
    reported: str, task: str | None, state: str, disagrees: bool
) -> None:
    got, disagreement = device_view_state(reported, task)
    assert (got, disagreement is not None) == (state, disagrees)
