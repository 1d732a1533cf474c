"""The ``events`` feed is the deployment's, not a process's: two control-plane
processes on one database serve the same committed events in the same order
under the same cursors, whichever process made the change, and a process whose
listen connection drops forgets what it held instead of serving a hole. Real
PostgreSQL and NATS, two real control planes in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.service import ControlPlaneService
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.model import TaskKind, TaskSpec

WAIT_S = 20.0


@pytest.fixture
async def replicas(
    db_url: str, nats_url: str, subject_prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[ControlPlaneService, ControlPlaneService]]:
    started: list[ControlPlaneService] = []
    try:
        for name in ("a", "b"):
            svc = ControlPlaneService(
                database_url=db_url,
                nats_url=nats_url,
                state_dir=tmp_path / name,
                prefix=subject_prefix,
            )
            started.append(await svc.start())
        yield started[0], started[1]
    finally:
        for svc in started:
            await svc.stop()


async def _present(svc: ControlPlaneService, token: str) -> int:
    """The cursor of the present, once the process's feed is live."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        try:
            return int((await svc.ops.handle("events", token, {}))["next"])
        except Unavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise


async def _read_until(
    svc: ControlPlaneService, token: str, cursor: int, done: Any
) -> tuple[list[dict[str, Any]], int]:
    """Events from ``cursor`` until ``done(events)``; and the cursor after them."""
    seen: list[dict[str, Any]] = []
    async with asyncio.timeout(WAIT_S):
        while not done(seen):
            page = await svc.ops.handle("events", token, {"after": cursor, "wait_s": 5.0})
            assert page["gap"] is False
            seen += page["events"]
            cursor = int(page["next"])
    return seen, cursor


def _spec(owner: str) -> TaskSpec:
    return TaskSpec(kind=TaskKind.GOAL, goal="replicated", owner=owner, project="default")


async def test_every_process_serves_every_change_under_the_same_cursor(
    replicas: tuple[ControlPlaneService, ControlPlaneService],
) -> None:
    a, b = replicas
    assert a.repo is not None
    admin = await a.repo.add_user("admin", platform_admin=True)
    await a.repo.add_project("default", owner="admin")
    start_a, start_b = await _present(a, admin), await _present(b, admin)
    heard: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
    for name, svc in (("a", a), ("b", b)):
        svc.ops.feed.add_listener(
            lambda e, name=name: heard[name].append((e["task_id"], e["state"]))
        )

    made_by_a = await a.control_plane.submit(_spec("admin"))
    made_by_b = await b.control_plane.submit(_spec("admin"))
    await b.ops.handle("cancel", admin, {"id": made_by_a})
    # A bulk cancel is one transaction of the user API, outside the actors.
    bulk = await a.ops.handle("cancel_many", admin, {"project": "default"})
    assert bulk["ids"] == [made_by_b]

    def both_ended(events: list[dict[str, Any]]) -> bool:
        return {(made_by_a, "cancelled"), (made_by_b, "cancelled")} <= {
            (e["task_id"], e["state"]) for e in events
        }

    # Each process's cursors continue on the other, with the same events.
    seen_a, _ = await _read_until(a, admin, start_b, both_ended)
    seen_b, _ = await _read_until(b, admin, start_a, both_ended)
    changes = [(e["task_id"], e["state"]) for e in seen_a]
    assert changes == [
        (made_by_a, "queued"),
        (made_by_b, "queued"),
        (made_by_a, "cancelled"),
        (made_by_b, "cancelled"),
    ]
    assert [(e["seq"], e["task_id"], e["state"]) for e in seen_a] == [
        (e["seq"], e["task_id"], e["state"]) for e in seen_b
    ]
    assert all(e["at"] is not None and e["attempt"] == 0 for e in seen_a)
    # The feed's listeners (the console's fleet history) hear them all too.
    assert heard["a"] == heard["b"] == changes
    # Halfway through, a cursor of one process still continues on the other.
    middle = seen_a[1]["seq"]
    rest, _ = await _read_until(b, admin, middle, lambda seen: len(seen) >= 2)
    assert [(e["task_id"], e["state"]) for e in rest] == changes[2:]


async def test_a_dropped_listen_connection_forgets_what_it_held(
    replicas: tuple[ControlPlaneService, ControlPlaneService], engine: AsyncEngine
) -> None:
    a, b = replicas
    assert a.repo is not None
    admin = await a.repo.add_user("admin", platform_admin=True)
    await a.repo.add_project("default", owner="admin")
    cursor = await _present(a, admin)
    await b.ops.handle("events", admin, {"after": cursor})  # b holds it too

    pid = a.ops.stream.backend_pid
    assert pid is not None
    resets = a.ops.feed.resets
    async with engine.connect() as conn:
        await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    async with asyncio.timeout(WAIT_S):
        while a.ops.feed.resets == resets:
            await a.ops.feed.changed(1.0)

    task_id = await a.control_plane.submit(_spec("admin"))
    # a listens again, from a new present; what it held before is gone...
    fresh = await _present(a, admin)
    with pytest.raises(Unavailable):
        await a.ops.handle("events", admin, {"after": cursor})
    # ...b still continues from the old cursor, and nothing is missed there.
    seen, _ = await _read_until(b, admin, cursor, lambda s: any(e["task_id"] == task_id for e in s))
    assert [(e["task_id"], e["state"]) for e in seen] == [(task_id, "queued")]
    assert a.ops.stream.backend_pid not in (None, pid)
    later = await a.control_plane.submit(_spec("admin"))
    seen, _ = await _read_until(a, admin, fresh, lambda s: any(e["task_id"] == later for e in s))
    assert (later, "queued") in [(e["task_id"], e["state"]) for e in seen]
