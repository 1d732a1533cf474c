"""The ``events`` ops verb: the live feed of task events a
user may read, served by the control plane from a bounded ring and filtered by
the user's roles on the server, so no client needs the shared event subject.
Real PostgreSQL, NATS and control plane."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.client import OpsClient, task_events
from fleetlease.ops.service import ControlPlaneService
from fleetlease.ops.userapi import EventFeed
from fleetlease.ops.userapi.events import NotHeld
from fleetlease.persistence.errors import Invalid, Unavailable
from fleetlease.persistence.model import TaskKind, TaskSpec

WAIT_S = 20.0


@pytest.fixture
async def service(
    db_url: str, nats_url: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[ControlPlaneService]:
    svc = ControlPlaneService(
        database_url=db_url, nats_url=nats_url, state_dir=tmp_path, prefix=subject_prefix
    )
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


def _spec(owner: str, project: str = "default") -> TaskSpec:
    return TaskSpec(kind=TaskKind.GOAL, goal="watched", owner=owner, project=project)


async def _setup(svc: ControlPlaneService) -> tuple[str, str]:
    repo = svc.repo
    assert repo is not None
    admin = await repo.add_user("admin", platform_admin=True)
    alice = await repo.add_user("alice")
    await repo.add_project("default", owner="admin")
    await repo.add_project("pa", owner="alice")
    return admin, alice


async def test_each_user_gets_only_the_events_of_tasks_it_may_read(
    service: ControlPlaneService,
) -> None:
    admin, alice = await _setup(service)
    api, cp = service.ops, service.control_plane
    start = await api.handle("events", alice, {})
    assert start["events"] == [] and start["gap"] is False
    cursor = start["next"]
    theirs = await cp.submit(_spec("admin"))
    mine = await cp.submit(_spec("alice", "pa"))

    seen: list[dict[str, Any]] = []
    after = cursor
    while not any(e["task_id"] == mine for e in seen):
        page = await api.handle("events", alice, {"after": after, "wait_s": WAIT_S})
        assert page["gap"] is False
        seen += page["events"]
        after = page["next"]
    assert {e["task_id"] for e in seen} == {mine}
    assert all(set(e) <= {"task_id", "state", "attempt", "host_id", "device_id", "at", "seq"}
               for e in seen)  # fmt: skip

    every = await api.handle("events", admin, {"after": cursor, "limit": 1000})
    assert {theirs, mine} <= {e["task_id"] for e in every["events"]}
    # Alice's cursor moved past the admin's event without showing it.
    later = await api.handle("events", admin, {"after": after, "limit": 1000})
    assert theirs not in {e["task_id"] for e in later["events"]}


async def test_a_long_poll_is_woken_by_the_next_event(service: ControlPlaneService) -> None:
    admin, _ = await _setup(service)
    api, cp = service.ops, service.control_plane
    cursor = (await api.handle("events", admin, {}))["next"]
    poll = asyncio.create_task(api.handle("events", admin, {"after": cursor, "wait_s": 30.0}))
    task_id = await cp.submit(_spec("admin"))
    page = await asyncio.wait_for(poll, WAIT_S)
    assert [e["task_id"] for e in page["events"]][:1] == [task_id]


async def test_a_repeated_submit_makes_no_second_queued_event(
    service: ControlPlaneService,
) -> None:
    admin, _ = await _setup(service)
    api, cp = service.ops, service.control_plane
    cursor = (await api.handle("events", admin, {}))["next"]
    keyed = replace(_spec("admin"), request_id="once")
    first = await cp.submit(keyed)
    assert await cp.submit(keyed) == first
    marker = await cp.submit(_spec("admin"))  # the events after it are in the page

    seen: list[dict[str, Any]] = []
    while not any(e["task_id"] == marker for e in seen):
        page = await api.handle("events", admin, {"after": cursor, "wait_s": WAIT_S})
        seen += page["events"]
        cursor = page["next"]
    queued = [e["task_id"] for e in seen if e["state"] == "queued"]
    assert queued.count(first) == 1


async def test_a_cursor_not_held_is_unavailable(service: ControlPlaneService) -> None:
    admin, _ = await _setup(service)
    api = service.ops
    now = await api.handle("events", admin, {})
    with pytest.raises(Unavailable):
        await api.handle("events", admin, {"after": now["next"] + 10**9})
    # The epoch of older clients is accepted and ignored.
    same = await api.handle("events", admin, {"after": now["next"], "epoch": uuid.uuid4().hex})
    assert same["events"] == [] and same["gap"] is False
    for bad in ({"after": -1}, {"wait_s": 31}, {"limit": 0}, {"since": 1}):
        with pytest.raises(Invalid):
            await api.handle("events", admin, bad)


async def test_task_events_over_nats_follow_the_verb(
    service: ControlPlaneService, nats_url: str, subject_prefix: str
) -> None:
    _, alice = await _setup(service)
    cp = service.control_plane
    async with OpsClient(nats_url=nats_url, token=alice, prefix=subject_prefix) as client:
        subscribed = asyncio.Event()
        events = task_events(client, subscribed=subscribed, wait_s=5.0)
        first = asyncio.ensure_future(anext(events))
        await asyncio.wait_for(subscribed.wait(), WAIT_S)
        await cp.submit(_spec("admin"))
        mine = await cp.submit(_spec("alice", "pa"))
        event = await asyncio.wait_for(first, WAIT_S)
        assert event["task_id"] == mine and event["state"] == "queued"
        assert set(event) == {"task_id", "state", "attempt", "host_id", "device_id", "at"}
        await events.aclose()


async def test_task_events_goes_on_from_the_present_after_a_gap(
    service: ControlPlaneService,
    nats_url: str,
    subject_prefix: str,
    engine: AsyncEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no process holding the cursor any more (the only one lost its listen
    connection), the client calls ``on_gap`` and carries on from the present."""
    import fleetlease.ops.client as client_module

    monkeypatch.setattr(client_module, "EVENTS_RETRIES", 1)
    admin, _ = await _setup(service)
    gap = asyncio.Event()
    async with OpsClient(nats_url=nats_url, token=admin, prefix=subject_prefix) as client:
        subscribed = asyncio.Event()
        events = task_events(client, subscribed=subscribed, wait_s=2.0, on_gap=gap.set)
        first = asyncio.ensure_future(anext(events))
        await asyncio.wait_for(subscribed.wait(), WAIT_S)
        pid = service.ops.stream.backend_pid
        async with engine.connect() as conn:
            await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        # The pending anext() drives the client: it meets the gap while parked.
        await asyncio.wait_for(gap.wait(), WAIT_S)
        after_gap = await service.control_plane.submit(_spec("admin"))
        event = await asyncio.wait_for(first, WAIT_S)
        assert (event["task_id"], event["state"]) == (after_gap, "queued")
        await events.aclose()


async def test_the_ring_is_bounded_and_forgets_on_reset() -> None:
    feed = EventFeed(capacity=3)
    assert feed.present is None
    ids = [50, 7, 31, 12, 90]  # ids name events; the order is the feed's
    for i in ids:
        feed.append(i, {"task_id": str(uuid.UUID(int=i)), "state": "queued"})
    feed.append(31, {"task_id": "again", "state": "queued"})  # never twice
    assert feed.present == 90
    assert not feed.holds(50) and not feed.holds(7)
    with pytest.raises(NotHeld):
        feed.page(7, 10)
    assert [n for n, _ in feed.page(31, 10)] == [12, 90]
    assert [n for n, _ in feed.page(31, 1)] == [12]
    assert feed.page(90, 10) == []
    feed.append(5, None)  # a mark: a position, no event
    assert feed.present == 5 and feed.page(90, 10) == [(5, None)]
    feed.reset()
    assert feed.present is None and not feed.holds(5)
    feed.append(6, None)
    assert feed.present == 6 and feed.page(6, 10) == []
    waiting = asyncio.create_task(feed.changed(60.0))
    feed.close()
    await asyncio.wait_for(waiting, WAIT_S)
