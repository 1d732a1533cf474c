"""Shared by the actor integration tests and the chaos tests: waiting for
conditions (never a bare sleep), simulated in-process hosts that call the
``ControlPlane`` facade the way the transport would, and database checks."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.actors.runtime import ControlPlane
from fleetlease.persistence import tables
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.model import (
    Claimed,
    DeviceSnapshot,
    LeaseStatus,
    Outcome,
    ResultRecord,
    Session,
    TaskKind,
    TaskSpec,
)
from fleetlease.persistence.repository import Repository

T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    *,
    timeout: float = 20.0,
    what: str = "condition",
    interval: float = 0.02,
) -> None:
    """Re-check ``predicate`` until it holds; fail with ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


async def retrying(
    call: Callable[[], Awaitable[T]], *, attempts: int = 200, what: str = "call"
) -> T:
    """What a host does with a retryable error: try again (a lost reply, a
    restarting actor)."""
    for _ in range(attempts):
        try:
            return await call()
        except Unavailable:
            await asyncio.sleep(0.01)
    raise AssertionError(f"{what} still unavailable after {attempts} attempts")


def spec(**kw: Any) -> TaskSpec:
    kw.setdefault("kind", TaskKind.GOAL)
    kw.setdefault("goal", "g")
    return TaskSpec(**kw)


def fingerprint(result: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()


@dataclass
class SimHost:
    """An in-process host agent: registers, heartbeats its devices, and runs
    what it claims by calling the facade."""

    cp: ControlPlane
    host_id: str
    credential: str
    devices: list[str]
    session: Session | None = None
    held: dict[str, Claimed] = field(default_factory=dict)

    @classmethod
    async def create(
        cls, cp: ControlPlane, repo: Repository, host_id: str, n_devices: int = 1
    ) -> SimHost:
        credential = await repo.add_host(host_id)
        host = cls(cp, host_id, credential, [f"{host_id}-d{i}" for i in range(n_devices)])
        host.session = await cp.register(host_id, credential)
        await host.heartbeat()
        return host

    @property
    def s(self) -> Session:
        assert self.session is not None
        return self.session

    async def heartbeat(self) -> None:
        await self.cp.heartbeat(self.s, [DeviceSnapshot(device_id=d) for d in self.devices])

    async def claim(self, wait_s: float = 0.0, device_ids: Sequence[str] = ()) -> Claimed | None:
        c = await self.cp.claim(self.s, wait_s=wait_s, device_ids=device_ids)
        if c is not None:
            self.held[c.task_id] = c
        return c

    async def ack(self, c: Claimed) -> LeaseStatus:
        return await self.cp.ack(self.s, c.task_id, c.attempt, c.lease_token)

    async def renew(self, c: Claimed) -> LeaseStatus:
        return await self.cp.renew(self.s, c.task_id, c.attempt, c.lease_token)

    async def progress(self, c: Claimed, seq: int = 1) -> LeaseStatus:
        """A progress report: renews too, and passes through the Lease actor."""
        return await self.cp.progress(self.s, c.task_id, c.attempt, c.lease_token, seq)

    async def report(
        self,
        c: Claimed,
        outcome: Outcome = Outcome.DONE,
        *,
        result: dict[str, Any] | None = None,
        retryable: bool = False,
        reason: str = "",
    ) -> ResultRecord:
        result = result if result is not None else {"task": c.task_id, "attempt": c.attempt}
        return await self.cp.report_result(
            self.s,
            c.task_id,
            c.attempt,
            c.lease_token,
            outcome=outcome,
            retryable=retryable,
            reason=reason,
            result=result,
            fingerprint=fingerprint(result),
        )


# --- database checks ----------------------------------------------------------------------


async def task_rows(engine: AsyncEngine) -> dict[str, dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(tables.tasks))).mappings().all()
    return {str(r["id"]): dict(r) for r in rows}


async def task_state(engine: AsyncEngine, task_id: str) -> str:
    async with engine.connect() as conn:
        return str(
            (
                await conn.execute(
                    sa.select(tables.tasks.c.status).where(tables.tasks.c.id == task_id)
                )
            ).scalar_one()
        )


async def attempt_rows(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = (
            (
                await conn.execute(
                    sa.select(tables.attempts).order_by(
                        tables.attempts.c.task_id, tables.attempts.c.number
                    )
                )
            )
            .mappings()
            .all()
        )
    return [dict(r) for r in rows]


async def reservation_count(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(
            (
                await conn.execute(
                    sa.select(sa.func.count()).select_from(tables.device_reservations)
                )
            ).scalar_one()
        )


async def states_of(engine: AsyncEngine, ids: Sequence[str]) -> dict[str, str]:
    rows = await task_rows(engine)
    return {t: str(rows[t]["status"]) for t in ids}
