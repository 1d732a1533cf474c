"""Submitting tasks, with request ids that make a repeated submit safe."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict, Invalid, Unavailable
from fleetlease.persistence.model import TaskSpec, TaskState
from fleetlease.persistence.repository._sql import _prebuilt
from fleetlease.persistence.repository._tx import FOREIGN_KEY_VIOLATION, _sqlstate, log
from fleetlease.persistence.repository._validate import _check_spec
from fleetlease.persistence.repository.users import UserMixin
from fleetlease.persistence.tables import projects, tasks, users

# What a repeated submit must match for its request id to return the first task.
_SPEC_COLUMNS = (
    "kind",
    "goal",
    "workflow",
    "payload",
    "selector",
    "priority",
    "project",
    "max_attempts",
    "backoff_base_s",
    "backoff_cap_s",
)


class SubmitMixin(UserMixin):
    """Submitting tasks."""

    async def submit(self, spec: TaskSpec) -> str:
        """Insert a queued task, eligible now. Returns the task id (UUID string).
        ``Invalid(field=...)`` for a bad payload/selector/priority/attempts/backoff;
        ``NotFound`` for an unknown project or owner."""
        return (await self.submit_many([spec]))[0]

    async def submit_many(self, specs: Sequence[TaskSpec]) -> list[str]:
        """Several submits in one transaction (all or nothing). A spec with a
        ``request_id`` its owner used before gets that first task's id, and no
        new task, if it asks for the same task; ``Conflict`` if not."""
        return (await self.submit_many_new(specs))[0]

    async def submit_many_new(self, specs: Sequence[TaskSpec]) -> tuple[list[str], set[str]]:
        """``submit_many``, also saying which of the ids are new tasks (the others
        are repeated request ids)."""
        if isinstance(specs, str | bytes) or not isinstance(specs, Sequence):
            raise Invalid("specs must be a sequence of TaskSpec", field="specs")
        values = [_check_spec(s) for s in specs]
        if not values:
            return [], set()
        keys = [(v["owner"], v["request_id"]) for v in values if v["request_id"] is not None]
        if len(set(keys)) != len(keys):
            raise Invalid("a request_id is repeated within one submit", field="request_id")
        ids = [str(uuid.uuid4()) for _ in values]

        async def run(conn: AsyncConnection, now: datetime) -> list[str]:
            rows = [
                {
                    **v,
                    "id": tid,
                    "status": TaskState.QUEUED.value,
                    "eligible_at": now,
                    "attempt": 0,
                    "created_at": now,
                    "updated_at": now,
                }
                for tid, v in zip(ids, values, strict=True)
            ]
            insert = _prebuilt("task_insert", tasks.insert)
            if not keys:
                # One row: one INSERT (not an executemany of one).
                await conn.execute(insert, rows[0] if len(rows) == 1 else rows)
                return ids
            return await self._submit_keyed(conn, rows)

        try:
            # A single task without a request id is one INSERT, atomic by itself:
            # no BEGIN and COMMIT round trips around it (the user API's one-task
            # submit). Several rows may be several statements: a transaction.
            one = len(values) == 1 and not keys
            out = await self._tx("submit", run, autocommit=one, driver=one)
            return out, set(ids).intersection(out)
        except sa.exc.IntegrityError as exc:
            # The foreign keys refused an unknown project or owner (nothing was
            # written): read which, for the precise error. Checking first would
            # cost two reads on every submit.
            if _sqlstate(exc) != FOREIGN_KEY_VIOLATION:
                raise

        async def which(conn: AsyncConnection, now: datetime) -> None:
            await self._require_names(conn, projects, {v["project"] for v in values}, "project")
            await self._require_names(conn, users, {v["owner"] for v in values}, "owner")

        await self._tx("submit_check", which)
        # Both exist now (created since): the caller may submit again.
        raise Unavailable("a project or owner changed during the submit; retry")

    async def _submit_keyed(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> list[str]:
        """Insert the rows whose (owner, request id) is new; a row whose key exists
        takes the existing task's id, if that task was submitted with the same
        spec (else ``Conflict``, and the transaction writes nothing). A concurrent
        submit with the same key waits on the unique index, then reads as existing."""
        stmt = (
            pg_insert(tasks)
            .values(rows)
            .on_conflict_do_nothing(
                index_elements=[tasks.c.owner, tasks.c.request_id],
                index_where=tasks.c.request_id.isnot(None),
            )
            .returning(tasks.c.id)
        )
        inserted = {str(i) for i in (await conn.execute(stmt)).scalars()}
        repeated = [r for r in rows if r["id"] not in inserted]
        if not repeated:
            return [r["id"] for r in rows]
        pair = sa.tuple_(tasks.c.owner, tasks.c.request_id)
        found = {
            (row.owner, row.request_id): row
            for row in (
                await conn.execute(
                    sa.select(
                        tasks.c.id,
                        tasks.c.owner,
                        tasks.c.request_id,
                        *(tasks.c[c] for c in _SPEC_COLUMNS),
                    ).where(pair.in_([(r["owner"], r["request_id"]) for r in repeated]))
                )
            ).mappings()
        }
        ids = {}
        for r in repeated:
            first = found.get((r["owner"], r["request_id"]))
            if first is None:  # pragma: no cover - the conflicting row is committed
                raise Unavailable("a repeated submit's first task vanished; retry")
            if any(first[c] != r[c] for c in _SPEC_COLUMNS):
                raise Conflict(
                    f"request_id {r['request_id']!r} was used for a different task ({first['id']})",
                    field="request_id",
                    task_id=str(first["id"]),
                )
            ids[r["id"]] = str(first["id"])
        log.info("repository.submit_repeated", count=len(ids))
        return [ids.get(r["id"], r["id"]) for r in rows]
