"""Retention: finished tasks expire, with everything they stored.

A finished task (done, failed, cancelled) is kept for its project's retention
(``projects.retain_s``), or the control plane's default when the project has
none (``serve --retain``), counted from its ``finished_at``. Zero, for the
project or as the default, keeps finished tasks forever. Queued, retrying and
in-flight tasks are never touched, whatever their age.

``Retention.collect`` deletes expired tasks with their attempts, log lines and
artifact rows in bounded batches: each batch is one short transaction that
takes at most ``batch`` expired tasks with ``FOR UPDATE SKIP LOCKED``, so a
transition holding a task's row is never waited for (that task simply goes in
a later pass) and no transition waits for more than one batch. The artifact
objects the deleted rows named, and any chunks their attempts still had
staged, are returned for the caller to delete once the batch has committed
(``transport.artifacts.Artifacts.delete_objects``): an object's name is its
own task's and attempt's, so no remaining row can refer to it.

``Retention.plan`` is the dry run: what a collection would delete now, per
project, without deleting anything.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.errors import Invalid, NotFound
from fleetlease.persistence.tables import artifacts, attempts, log_lines, projects, tasks

#: Expired tasks deleted per transaction by default.
DEFAULT_BATCH = 500
#: The longest retention accepted (100 years, in seconds).
MAX_RETAIN_S = 100 * 365 * 86400

#: Finished tasks, literally: the partial index's predicate, which the planner
#: matches only against constants (never against bound parameters).
_FINISHED = sa.text("tasks.status IN ('done', 'failed', 'cancelled')")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_FOREVER = frozenset({"0", "none", "never", "forever"})


def parse_retention(text: str, *, field_name: str = "retain") -> int:
    """A retention as whole seconds: ``30d``, ``12h``, ``90m``, ``45s``, ``2w``
    or a bare number of seconds; ``0``, ``none``, ``never`` or ``forever``
    keep forever (0). Anything else is ``Invalid`` naming ``field_name``."""
    if not isinstance(text, str):
        raise Invalid(f"{field_name} must be a duration such as 30d", field=field_name)
    if text.strip().lower() in _FOREVER:
        return 0
    m = _DURATION.match(text.lower())
    if m is None:
        raise Invalid(
            f"{field_name} must be a duration such as 30d, 12h, 90m or 45s, or none",
            field=field_name,
        )
    seconds = int(m.group(1)) * _UNITS[m.group(2) or "s"]
    check_retention(seconds, field_name=field_name)
    return seconds


def check_retention(seconds: object, *, field_name: str = "retain_s") -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise Invalid(f"{field_name} must be a whole number of seconds", field=field_name)
    if not 0 <= seconds <= MAX_RETAIN_S:
        raise Invalid(f"{field_name} must be in 0..{MAX_RETAIN_S} seconds", field=field_name)
    return seconds


def format_retention(seconds: int | None) -> str:
    """``30d``, ``12h``, ... (the largest unit that divides it); ``forever`` for 0;
    ``default`` for None."""
    if seconds is None:
        return "default"
    if seconds == 0:
        return "forever"
    for unit in ("w", "d", "h", "m"):
        if seconds % _UNITS[unit] == 0:
            return f"{seconds // _UNITS[unit]}{unit}"
    return f"{seconds}s"


@dataclass
class Usage:
    """What expired finished tasks hold (a plan) or held (a collection)."""

    tasks: int = 0
    attempts: int = 0
    log_lines: int = 0
    log_bytes: int = 0
    artifacts: int = 0
    artifact_bytes: int = 0

    def add(self, other: Usage) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in self.__dataclass_fields__}


@dataclass
class Batch:
    """One committed deletion: per-project counts, and the storage outside
    PostgreSQL it freed (artifact object names; (host, task, attempt) of the
    deleted attempts, whose staged chunks may be purged)."""

    projects: dict[str, Usage] = field(default_factory=dict)
    object_names: list[str] = field(default_factory=list)
    attempts: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def tasks(self) -> int:
        return sum(u.tasks for u in self.projects.values())


@dataclass
class Report:
    """A collection's (or, ``dry_run``, a plan's) outcome."""

    dry_run: bool
    projects: dict[str, Usage] = field(default_factory=dict)
    #: Tasks deleted by each committed batch, in order (empty for a dry run).
    batches: list[int] = field(default_factory=list)
    objects_deleted: int = 0
    objects_failed: int = 0
    #: Whether nothing expired was left (unlocked) when the collection ended;
    #: False when it stopped at ``max_batches``.
    complete: bool = True

    def total(self) -> Usage:
        out = Usage()
        for u in self.projects.values():
            out.add(u)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "projects": {p: u.as_dict() for p, u in sorted(self.projects.items())},
            "total": self.total().as_dict(),
            "batches": list(self.batches),
            "objects_deleted": self.objects_deleted,
            "objects_failed": self.objects_failed,
            "complete": self.complete,
        }


#: Called after each committed batch with what it freed outside PostgreSQL;
#: returns (objects deleted, objects failed).
AfterBatch = Callable[[Batch], Awaitable[tuple[int, int]]]


def expired_of(project: str, cutoff: datetime, limit: int) -> sa.Select[Any]:
    """The oldest ``limit`` of ``project``'s tasks finished before ``cutoff``,
    locked, skipping those locked by others."""
    return (
        sa.select(tasks.c.id, tasks.c.project)
        .where(tasks.c.project == project, _FINISHED, tasks.c.finished_at < cutoff)
        .order_by(tasks.c.finished_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


class Retention:
    """The retention policy of one database: the default (seconds, 0 or None:
    forever), the per-project overrides, the dry run and the collection."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        default_s: int | None = None,
        clock: Clock | None = None,
        batch: int = DEFAULT_BATCH,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch!r}")
        self.engine = engine
        self.default_s = check_retention(default_s or 0, field_name="default_s")
        self.clock = clock or SystemClock()
        self.batch = batch
        self._stopping = False

    def stop(self) -> None:
        """A collection running stops after its current batch, and none starts."""
        self._stopping = True

    # --- the per-project policy ---------------------------------------------------------

    async def set_project(self, project: str, retain_s: int | None) -> None:
        """Set ``project``'s retention (seconds; 0 forever; None: the default).
        ``not_found`` for an unknown project, nothing written."""
        if retain_s is not None:
            check_retention(retain_s)
        async with self.engine.begin() as conn:
            result = await conn.execute(
                sa.update(projects).where(projects.c.name == project).values(retain_s=retain_s)
            )
            if result.rowcount != 1:
                raise NotFound(f"no project {project!r}", field="name")

    async def project_retention(self, project: str) -> int | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(sa.select(projects.c.retain_s).where(projects.c.name == project))
            ).first()
        if row is None:
            raise NotFound(f"no project {project!r}", field="name")
        return None if row.retain_s is None else int(row.retain_s)

    # --- which tasks have expired ----------------------------------------------------------

    def _expired(self, now: datetime) -> sa.ColumnElement[bool]:
        default = sa.literal(self.default_s, sa.BigInteger()) if self.default_s else sa.null()
        keep = sa.func.coalesce(projects.c.retain_s, default)
        seconds = sa.literal_column("interval '1 second'", type_=sa.Interval())
        return sa.and_(
            _FINISHED,
            keep > 0,
            tasks.c.finished_at < sa.literal(now, tasks.c.finished_at.type) - keep * seconds,
        )

    def _doomed(self, now: datetime) -> sa.Select[Any]:
        return (
            sa.select(tasks.c.id, tasks.c.project)
            .join(projects, projects.c.name == tasks.c.project)
            .where(self._expired(now))
        )

    # --- the dry run ----------------------------------------------------------------------------

    async def plan(self) -> Report:
        """What ``collect`` would delete now, per project; deletes nothing."""
        now = self.clock.now()
        doomed = self._doomed(now).cte("doomed")
        report = Report(dry_run=True)

        def usage(project: str) -> Usage:
            return report.projects.setdefault(project, Usage())

        async with self.engine.connect() as plain:
            # One snapshot for the four counts.
            conn = await plain.execution_options(isolation_level="REPEATABLE READ")
            for row in await conn.execute(
                sa.select(doomed.c.project, sa.func.count()).group_by(doomed.c.project)
            ):
                usage(row[0]).tasks = int(row[1])
            for row in await conn.execute(
                sa.select(doomed.c.project, sa.func.count())
                .join(attempts, attempts.c.task_id == doomed.c.id)
                .group_by(doomed.c.project)
            ):
                usage(row[0]).attempts = int(row[1])
            for row in await conn.execute(
                sa.select(
                    doomed.c.project,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(sa.func.octet_length(log_lines.c.line)), 0),
                )
                .join(log_lines, log_lines.c.task_id == doomed.c.id)
                .group_by(doomed.c.project)
            ):
                usage(row[0]).log_lines, usage(row[0]).log_bytes = int(row[1]), int(row[2])
            for row in await conn.execute(
                sa.select(
                    doomed.c.project,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(artifacts.c.size), 0),
                )
                .join(artifacts, artifacts.c.task_id == doomed.c.id)
                .group_by(doomed.c.project)
            ):
                usage(row[0]).artifacts, usage(row[0]).artifact_bytes = int(row[1]), int(row[2])
            await conn.rollback()
        return report

    # --- the collection -------------------------------------------------------------------------

    async def _cutoffs(self, conn: Any, now: datetime) -> list[tuple[str, datetime]]:
        """Each project whose finished tasks expire, with the time before which
        they have: the project's retention, else the default."""
        rows = await conn.execute(sa.select(projects.c.name, projects.c.retain_s))
        out = []
        for name, retain_s in rows:
            keep = self.default_s if retain_s is None else int(retain_s)
            if keep > 0:
                out.append((name, now - timedelta(seconds=keep)))
        return out

    async def delete_batch(self, limit: int | None = None) -> Batch:
        """One transaction: at most ``limit`` (default ``batch``) expired tasks
        not locked by anyone else, deleted with their attempts, log lines and
        artifact rows. An empty batch means nothing (unlocked) has expired.
        Each project's expired tasks are found oldest first on the finished
        tasks' (project, finished_at) index, so tasks kept (another project's,
        or not yet expired) are never scanned."""
        limit = self.batch if limit is None else limit
        now = self.clock.now()
        batch = Batch()
        async with self.engine.begin() as conn:
            picked: list[Any] = []
            for project, cutoff in await self._cutoffs(conn, now):
                picked += (
                    await conn.execute(expired_of(project, cutoff, limit - len(picked)))
                ).all()
                if len(picked) >= limit:
                    break
            if not picked:
                return batch
            ids = [row.id for row in picked]
            project_of = {row.id: row.project for row in picked}

            def usage(task_id: Any) -> Usage:
                return batch.projects.setdefault(project_of[task_id], Usage())

            for row in await conn.execute(
                sa.delete(artifacts)
                .where(artifacts.c.task_id.in_(ids))
                .returning(artifacts.c.task_id, artifacts.c.size, artifacts.c.object_name)
            ):
                u = usage(row.task_id)
                u.artifacts += 1
                u.artifact_bytes += int(row.size)
                batch.object_names.append(row.object_name)
            for row in await conn.execute(
                sa.select(
                    log_lines.c.task_id,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(sa.func.octet_length(log_lines.c.line)), 0),
                )
                .where(log_lines.c.task_id.in_(ids))
                .group_by(log_lines.c.task_id)
            ):
                u = usage(row[0])
                u.log_lines += int(row[1])
                u.log_bytes += int(row[2])
            await conn.execute(sa.delete(log_lines).where(log_lines.c.task_id.in_(ids)))
            for row in await conn.execute(
                sa.delete(attempts)
                .where(attempts.c.task_id.in_(ids))
                .returning(attempts.c.host_id, attempts.c.task_id, attempts.c.number)
            ):
                usage(row.task_id).attempts += 1
                batch.attempts.append((row.host_id, str(row.task_id), int(row.number)))
            deleted = (
                await conn.execute(
                    sa.delete(tasks).where(tasks.c.id.in_(ids)).returning(tasks.c.id)
                )
            ).all()
            for row in deleted:
                usage(row.id).tasks += 1
        return batch

    async def collect(
        self, after_batch: AfterBatch | None = None, *, max_batches: int | None = None
    ) -> Report:
        """Delete every expired task, ``batch`` per transaction, until none is
        left (or ``max_batches``); ``after_batch`` frees each committed batch's
        objects and staged chunks."""
        report = Report(dry_run=False, complete=False)
        while not self._stopping and (max_batches is None or len(report.batches) < max_batches):
            batch = await self.delete_batch()
            if batch.tasks < self.batch:
                report.complete = True
            if not batch.tasks:
                break
            report.batches.append(batch.tasks)
            for project, u in batch.projects.items():
                report.projects.setdefault(project, Usage()).add(u)
            if after_batch is not None:
                deleted, failed = await after_batch(batch)
                report.objects_deleted += deleted
                report.objects_failed += failed
            if report.complete:
                break
        return report
