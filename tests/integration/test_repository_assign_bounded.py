"""The assignment pass reads a bounded sample of the free devices: its size
follows the tasks it assigns, not the fleet, and it still holds a device for
every candidate that has one (a rare capability set, a workflow few hosts
serve), spread over many hosts when long-polls wait for the devices."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import asyncpg as pg_asyncpg

from fleetlease.persistence.model import DeviceSnapshot, HostAdvert, Session, TaskKind, TaskSpec
from fleetlease.persistence.repository import _assign_sql, assign
from tests.integration.test_repository_support import World, world

__all__ = ["world"]

pytestmark = pytest.mark.embedded

PHONE = {"kind": "phone"}


async def fleet(
    world: World, hosts: int, devices: int, *, advert: HostAdvert | None = None
) -> list[Session]:
    """``hosts`` live hosts of ``devices`` idle phones each."""
    sessions = []
    for h in range(hosts):
        session = await world.host(f"h{h:03d}", [])
        snaps = [DeviceSnapshot(device_id=f"d{d:03d}", capabilities=PHONE) for d in range(devices)]
        await world.repo.heartbeat(session, snaps, advert)
        sessions.append(session)
    return sessions


@pytest.fixture
def rows_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The device rows each read of the free devices returned to Python."""
    counts: list[int] = []
    load = _assign_sql._FreeDevice.load

    def counting(rows: Sequence[Any]) -> list[_assign_sql._FreeDevice]:
        counts.append(len(rows))
        return load(rows)

    monkeypatch.setattr(_assign_sql._FreeDevice, "load", staticmethod(counting))
    return counts


async def test_a_pass_reads_a_number_of_devices_bounded_by_its_tasks(
    world: World, rows_read: list[int]
) -> None:
    await fleet(world, hosts=40, devices=25)  # 1,000 free devices
    ids = {await world.submit() for _ in range(3)}

    got = await world.repo.assign()

    assert {a.task_id for a in got} == ids
    # One read: 2 x 3 devices one per host, and 2 x 3 of the first host (one
    # of them the same device): 11 rows of 1,000.
    assert rows_read == [11]
    assert max(rows_read) <= 2 * assign._SAMPLE_SPARE * len(ids)


async def test_nothing_is_read_when_nothing_waits(world: World, rows_read: list[int]) -> None:
    await fleet(world, hosts=5, devices=5)

    assert await world.repo.assign() == []
    assert rows_read == []


async def test_a_task_needing_a_rare_capability_set_gets_the_one_device_that_has_it(
    world: World, rows_read: list[int]
) -> None:
    sessions = await fleet(world, hosts=30, devices=20)
    rare = DeviceSnapshot(device_id="tablet", capabilities={"kind": "tablet"})
    last = sessions[-1]
    phones = [DeviceSnapshot(device_id=f"d{d:03d}", capabilities=PHONE) for d in range(20)]
    await world.repo.heartbeat(last, [*phones, rare])
    common = [await world.submit(selector=PHONE) for _ in range(5)]
    tablet = await world.submit(selector={"kind": "tablet"})
    nothing = await world.submit(selector={"kind": "watch"})

    got = await world.repo.assign()

    by_task = {a.task_id: (a.host_id, a.device_id) for a in got}
    assert by_task[tablet] == (last.host_id, "tablet")
    assert set(by_task) == {*common, tablet}
    assert nothing not in by_task
    assert len(set(by_task.values())) == len(by_task)
    assert sum(rows_read) <= 2 * assign._SAMPLE_SPARE * len(by_task)


async def test_a_workflow_task_gets_a_device_of_the_one_host_that_serves_it(
    world: World,
) -> None:
    await fleet(world, hosts=20, devices=10, advert=HostAdvert(workflows=("other",)))
    serving = await world.host("zz-serving", [])
    await world.repo.heartbeat(
        serving,
        [DeviceSnapshot(device_id="only", capabilities=PHONE)],
        HostAdvert(workflows=("login-flow",)),
    )
    task_id = await world.repo.submit(
        TaskSpec(kind=TaskKind.WORKFLOW, workflow="login-flow", project="p1", owner="alice")
    )

    (a,) = await world.repo.assign()

    assert (a.task_id, a.host_id, a.device_id) == (task_id, "zz-serving", "only")


async def test_a_fleet_wide_pass_claims_each_assignment_for_a_waiting_request(
    world: World, rows_read: list[int]
) -> None:
    # Every host has one request waiting for all of its devices (as a
    # host's long-poll does): a pass of 8 tasks claims all 8, on 8 hosts,
    # reading a bounded sample of 1,000 free devices.
    sessions = {s.host_id: s for s in await fleet(world, hosts=40, devices=25)}
    ids = {await world.submit() for _ in range(8)}

    got, claims = await world.repo.assign_and_claim(
        claimer=lambda a: sessions[a.host_id], waiting=lambda host, device: host
    )

    assert {a.task_id for a in got} == ids
    assert {c.task_id for c in claims} == ids
    assert len({a.host_id for a in got}) == 8
    assert max(rows_read) <= 2 * assign._SAMPLE_SPARE * len(ids)


async def test_a_backlog_on_few_hosts_still_fills_their_devices(world: World) -> None:
    # Two hosts of 6 devices: one per host is not enough, the rest of the
    # sample comes from the first hosts.
    await fleet(world, hosts=2, devices=6)
    ids = [await world.submit() for _ in range(14)]

    got = await world.repo.assign()

    assert len(got) == 12
    assert {a.task_id for a in got} == set(ids[:12])
    assert len({(a.host_id, a.device_id) for a in got}) == 12


async def test_candidates_whose_samples_share_devices_are_all_placed(world: World) -> None:
    # Five selectors that every device meets: each one's sample is the same
    # few devices, and the pass reads again for the candidates left over.
    everything = {f"c{k}": "y" for k in range(5)}
    for h in range(10):
        session = await world.host(f"h{h:03d}", [])
        snaps = [DeviceSnapshot(device_id=f"d{d:03d}", capabilities=everything) for d in range(5)]
        await world.repo.heartbeat(session, snaps)
    ids = {await world.submit(selector={f"c{k}": "y"}) for k in range(5)}

    got = await world.repo.assign()

    assert {a.task_id for a in got} == ids
    assert len({(a.host_id, a.device_id) for a in got}) == 5


async def test_tasks_no_free_device_meets_do_not_hide_those_behind_them(world: World) -> None:
    # The first waiting tasks of the project need a device nobody has: the
    # ranking skips them (and reads the free devices' sets to know it).
    await fleet(world, hosts=3, devices=2)
    for _ in range(6):
        await world.submit(selector={"kind": "watch"})
    behind = [await world.submit(selector=PHONE) for _ in range(2)]

    got = await world.repo.assign(limit=2)

    assert sorted(a.task_id for a in got) == sorted(behind)


def _scans_of(plan: dict[str, Any], relation: str) -> list[dict[str, Any]]:
    found = [plan] if plan.get("Relation Name") == relation else []
    for child in plan.get("Plans", ()):
        found.extend(_scans_of(child, relation))
    return found


async def test_the_sample_walks_few_hosts_even_when_the_hosts_statistics_are_stale(
    world: World,
) -> None:
    await fleet(world, hosts=200, devices=5)
    async with world.engine.begin() as conn:
        # Statistics taken before the fleet registered and heartbeated, as
        # after any burst of registrations: they say that no host is live.
        await conn.execute(
            sa.text(
                "UPDATE hosts SET session_generation = 0, last_seen = last_seen - interval '1 hour'"
            )
        )
        await conn.execute(sa.text("ANALYZE hosts"))
        await conn.execute(
            sa.text(
                "UPDATE hosts SET session_generation = 1, last_seen = last_seen + interval '1 hour'"
            )
        )
    compiled = _assign_sql._free_sample_stmt().compile(dialect=pg_asyncpg.dialect())
    params = {
        **world.repo._free_params(world.clock.now()),
        "q_i": [0, 1],
        "q_selector": ["{}", "{}"],
        "q_workflow": [None, None],
        "q_want": [6, 6],
        "q_per_host": [1, 6],
    }
    values = [params.get(n, compiled.params.get(n)) for n in compiled.positiontup or ()]
    async with world.engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        explained = await raw.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + compiled.string, *values)
    if isinstance(explained, str):
        explained = json.loads(explained)
    plan = explained[0]["Plan"]
    # Six devices of six hosts, and six of the first: a few hosts read, not
    # all 200 of them sorted.
    (hosts_scan,) = _scans_of(plan, "hosts")
    assert hosts_scan["Actual Rows"] * hosts_scan["Actual Loops"] < 50, hosts_scan
