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

from fleetlease.ops.client import OpsClient, task_events
from fleetlease.ops.service import ControlPlaneService
from fleetlease.ops.userapi import EventFeed
from fleetlease.persistence.errors import Invalid
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
        assert page["epoch"] == start["epoch"] and page["gap"] is False
        seen += page["events"]
        after = page["next"]
    assert {e["task_id"] for e in seen} == {mine}
    assert all(set(e) <= {"task_id", "state", "attempt", "host_id", "device_id", "at", "seq"}
               for e in seen)  # fmt: skip

    every = await api.handle("events", admin, {"after": cursor, "limit": 1000})
    assert {theirs, mine} <= {e["task_id"] for e in every["events"]}
    # Alice's cursor moved past the admin's event without showing it.
    assert after >= max(e["seq"] for e in every["events"] if e["task_id"] == theirs)


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


async def test_a_foreign_cursor_is_a_gap_from_the_present(service: ControlPlaneService) -> None:
    admin, _ = await _setup(service)
    api = service.ops
    now = await api.handle("events", admin, {})
    other_run = await api.handle("events", admin, {"after": 0, "epoch": uuid.uuid4().hex})
    assert other_run["gap"] is True and other_run["next"] == now["next"]
    ahead = await api.handle("events", admin, {"after": now["next"] + 100})
    assert ahead["gap"] is True and ahead["next"] == now["next"]
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


async def test_the_ring_is_bounded_and_says_when_it_dropped_events() -> None:
    feed = EventFeed(capacity=3)
    for i in range(5):
        feed.add({"task_id": str(uuid.UUID(int=i)), "state": "queued"})
    assert feed.last == 5
    page, gap = feed.page(0, 10)
    assert gap is True and [n for n, _ in page] == [3, 4, 5]
    page, gap = feed.page(3, 10)
    assert gap is False and [n for n, _ in page] == [4, 5]
    feed.add({"not": "an event"})  # not a task event: dropped, never numbered
    assert feed.last == 5
    waiting = asyncio.create_task(feed.wait(5, 60.0))
    feed.close()
    await asyncio.wait_for(waiting, WAIT_S)
