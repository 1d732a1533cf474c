"""Shared fixtures and helpers for the repository tests (no tests here).

A ``world`` is a repository on this test's own database with a ManualClock, three
users (``alice`` owns project ``p1`` which ``carol`` administers, ``bob`` owns
``p2``, ``root`` is a platform admin) and helpers to bring hosts up and walk a task
through its states.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.model import (
    Assignment,
    Claimed,
    DeviceSnapshot,
    LeaseTimings,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
    User,
)
from fleetlease.persistence.repository import Repository

TIMINGS = LeaseTimings(claim_s=30, ack_s=15, lease_s=30, liveness_s=30)


@dataclass
class World:
    repo: Repository
    clock: ManualClock
    engine: AsyncEngine
    alice: User = field(default_factory=lambda: User(name="alice", platform_admin=False))
    bob: User = field(default_factory=lambda: User(name="bob", platform_admin=False))
    carol: User = field(default_factory=lambda: User(name="carol", platform_admin=False))
    root: User = field(default_factory=lambda: User(name="root", platform_admin=True))
    credentials: dict[str, str] = field(default_factory=dict)

    async def host(
        self,
        host_id: str = "h1",
        devices: Sequence[str | DeviceSnapshot] = ("d1",),
    ) -> Session:
        """A registered, live host with the given idle devices."""
        if host_id not in self.credentials:
            self.credentials[host_id] = await self.repo.add_host(host_id)
        session = await self.repo.register_session(host_id, self.credentials[host_id])
        await self.beat(session, *devices)
        return session

    async def beat(self, session: Session, *devices: str | DeviceSnapshot) -> None:
        """A heartbeat; plain device ids get the capability ``host=<host id>`` so that
        ``assigned`` can pin a task to one host (default: one idle device "d1")."""
        snaps = [
            d
            if isinstance(d, DeviceSnapshot)
            else DeviceSnapshot(device_id=d, capabilities={"host": session.host_id})
            for d in (devices or ("d1",))
        ]
        await self.repo.heartbeat(session, snaps)

    async def submit(
        self,
        *,
        project: str = "p1",
        owner: str = "alice",
        priority: int = 0,
        selector: dict[str, str] | None = None,
        max_attempts: int = 3,
        base: float = 1.0,
        cap: float = 60.0,
        payload: dict[str, Any] | None = None,
    ) -> str:
        return await self.repo.submit(
            TaskSpec(
                kind=TaskKind.GOAL,
                goal="open the settings app",
                payload=payload or {"n": 1},
                selector=selector or {},
                priority=priority,
                project=project,
                owner=owner,
                retry=RetryPolicy(
                    max_attempts=max_attempts, backoff_base_s=base, backoff_cap_s=cap
                ),
            )
        )

    async def assigned(self, session: Session, **submit: Any) -> Assignment:
        """Submit a task pinned to this host's devices and assign it."""
        submit.setdefault("selector", {"host": session.host_id})
        task_id = await self.submit(**submit)
        (assignment,) = [a for a in await self.repo.assign() if a.task_id == task_id]
        assert assignment.host_id == session.host_id
        return assignment

    async def dispatched(self, session: Session, **submit: Any) -> Claimed:
        a = await self.assigned(session, **submit)
        return await self.repo.claim(session, a.task_id, a.attempt)

    async def running(self, session: Session, **submit: Any) -> Claimed:
        c = await self.dispatched(session, **submit)
        await self.repo.ack(session, c.task_id, c.attempt, c.lease_token)
        return c

    async def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        async with self.engine.connect() as conn:
            result = await conn.execute(sa.text(sql), params)
            return [dict(r) for r in result.mappings()]

    async def task_row(self, task_id: str) -> dict[str, Any]:
        (row,) = await self.rows("SELECT * FROM tasks WHERE id = :id", id=task_id)
        return row

    async def attempt_rows(self, task_id: str) -> list[dict[str, Any]]:
        return await self.rows(
            "SELECT * FROM attempts WHERE task_id = :id ORDER BY number", id=task_id
        )

    async def reservations(self) -> list[dict[str, Any]]:
        return await self.rows("SELECT * FROM device_reservations ORDER BY host_id, device_id")

    async def snapshot(self) -> list[list[dict[str, Any]]]:
        """Every scheduling row, to show that a rejected message changed nothing."""
        return [
            await self.rows("SELECT * FROM tasks ORDER BY id"),
            await self.rows("SELECT * FROM attempts ORDER BY task_id, number"),
            await self.rows("SELECT * FROM device_reservations ORDER BY host_id, device_id"),
        ]


async def make_world(engine: AsyncEngine, clock: ManualClock) -> World:
    repo = Repository(engine, clock, TIMINGS)
    w = World(repo=repo, clock=clock, engine=engine)
    for name in ("alice", "bob", "carol"):
        await repo.add_user(name)
    await repo.add_user("root", platform_admin=True)
    await repo.add_project("p1", owner="alice", admins=["carol"])
    await repo.add_project("p2", owner="bob")
    return w


@pytest.fixture
async def world(engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[World]:
    yield await make_world(engine, clock)
