"""Retention on a real PostgreSQL and nats-server: expired finished tasks go
with their attempts, log lines, artifact rows and objects, in bounded batches
that never hold up a transition; everything else stays; ``gc --dry-run``
reports and deletes nothing."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.ops.observe.collectors import ControlPlaneCollector
from fleetlease.persistence.errors import Invalid, NotFound
from fleetlease.persistence.model import TaskKind, TaskSpec, User
from fleetlease.persistence.repository import Repository
from fleetlease.persistence.retention import (
    Retention,
    expired_of,
    format_retention,
    parse_retention,
)
from tests.integration.test_transport_e2e import System, start_service, until

pytestmark = pytest.mark.embedded

ADMIN = User(name="admin", platform_admin=True)
HOUR = 3600
TABLES = ("tasks", "attempts", "log_lines", "artifacts")

_INSERT_FINISHED = sa.text(
    """
    WITH t AS (
        INSERT INTO tasks (id, status, kind, goal, project, owner, max_attempts,
                           backoff_base_s, backoff_cap_s, eligible_at, attempt,
                           created_at, updated_at, finished_at)
        SELECT gen_random_uuid(), :status, 'goal', 'g', :project, 'admin', 3, 1, 10,
               :at, 1, :at, :at, :at
        FROM generate_series(1, :n)
        RETURNING id
    ), a AS (
        INSERT INTO attempts (task_id, number, host_id, device_id, lease_id, assigned_at,
                              claim_deadline, ended_at, end_reason)
        SELECT id, 1, 'h0', 'd0', gen_random_uuid(), :at, :at, :at, 'result'
        FROM t
        RETURNING task_id
    ), l AS (
        INSERT INTO log_lines (task_id, attempt, seq, ts, line)
        SELECT t.id, 1, s, :at, 'line ' || s
        FROM t, generate_series(0, :lines - 1) s
        RETURNING task_id
    ), r AS (
        INSERT INTO artifacts (task_id, attempt, name, size, sha256, object_name, created_at)
        SELECT t.id, 1, 'out.txt', 10, 'x', t.id || '/1/x/out.txt', :at
        FROM t
        RETURNING task_id
    )
    SELECT id FROM t
    """
)


async def insert_finished(
    engine: AsyncEngine,
    project: str,
    n: int,
    *,
    age_s: float,
    status: str = "done",
    lines: int = 3,
) -> list[str]:
    """``n`` finished tasks of ``project``, finished ``age_s`` ago, each with an
    attempt, ``lines`` log lines and one artifact row."""
    at = datetime.now(UTC) - timedelta(seconds=age_s)
    async with engine.begin() as conn:
        rows = await conn.execute(
            _INSERT_FINISHED,
            {"status": status, "project": project, "at": at, "n": n, "lines": lines},
        )
        return [str(r[0]) for r in rows]


async def counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {
            t: int((await conn.execute(sa.text(f"SELECT count(*) FROM {t}"))).scalar_one())
            for t in TABLES
        }


async def present(engine: AsyncEngine, ids: list[str]) -> set[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.text("SELECT id::text FROM tasks WHERE id = ANY(CAST(:ids AS uuid[]))"),
            {"ids": ids},
        )
        return {r[0] for r in rows}


@pytest.fixture
async def repo(engine: AsyncEngine) -> Repository:
    r = Repository(engine)
    await r.add_user("admin", platform_admin=True)
    for p in ("default", "short", "keep", "long"):
        await r.add_project(p, owner="admin")
    await r.add_host("h0")
    return r


# --- the policy --------------------------------------------------------------------


def test_durations_parse_and_print() -> None:
    assert parse_retention("30d") == 30 * 86400
    assert parse_retention("12h") == 12 * HOUR
    assert parse_retention("90m") == 5400
    assert parse_retention("45") == 45
    assert parse_retention("2w") == 14 * 86400
    assert parse_retention("none") == parse_retention("0") == 0
    for bad in ("", "-1d", "3y", "1.5h", "d", "1000000000w"):
        with pytest.raises(Invalid):
            parse_retention(bad)
    assert format_retention(30 * 86400) == "30d"
    assert format_retention(0) == "forever"
    assert format_retention(None) == "default"
    assert format_retention(61) == "61s"


def test_the_finished_predicate_is_the_terminal_states() -> None:
    from fleetlease.persistence import retention
    from fleetlease.persistence.model import TERMINAL_STATES

    states = {s.value for s in TERMINAL_STATES}
    assert str(retention._FINISHED) == "tasks.status IN ('done', 'failed', 'cancelled')"
    assert states == {"done", "failed", "cancelled"}


async def test_expired_tasks_are_found_on_the_index(engine: AsyncEngine, repo: Repository) -> None:
    """The batch's scan, with bound parameters as the driver sends them, uses
    the finished tasks' partial index (its predicate is matched literally)."""
    await insert_finished(engine, "short", 50, age_s=2 * HOUR, lines=0)
    compiled = expired_of("short", datetime.now(UTC), 10).compile(dialect=engine.dialect)
    params = [compiled.params[name] for name in compiled.positiontup or ()]
    async with engine.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        await raw.execute("SET enable_seqscan = off")
        await raw.execute("SET plan_cache_mode = force_generic_plan")
        rows = await raw.fetch("EXPLAIN " + str(compiled), *params)
        await raw.execute("RESET ALL")
    plan = "\n".join(r[0] for r in rows)
    assert "ix_tasks_finished" in plan, plan
    assert (await Retention(engine, default_s=HOUR).collect()).batches == [50]


async def test_a_project_override_beats_the_default(engine: AsyncEngine, repo: Repository) -> None:
    ret = Retention(engine, default_s=HOUR)
    await ret.set_project("keep", 0)  # forever
    await ret.set_project("long", 30 * 86400)
    await ret.set_project("short", 60)
    default_old = await insert_finished(engine, "default", 2, age_s=2 * HOUR)
    default_new = await insert_finished(engine, "default", 2, age_s=60)
    keep_old = await insert_finished(engine, "keep", 2, age_s=400 * 86400)
    long_old = await insert_finished(engine, "long", 2, age_s=2 * HOUR, status="failed")
    short_old = await insert_finished(engine, "short", 2, age_s=120, status="cancelled")

    report = await ret.collect()

    assert report.as_dict()["total"]["tasks"] == 4
    assert set(report.projects) == {"default", "short"}
    assert await present(engine, default_old + short_old) == set()
    kept = default_new + keep_old + long_old
    assert await present(engine, kept) == set(kept)
    # Back to the default (1h): the year-old tasks of "keep" go now.
    await ret.set_project("keep", None)
    assert await ret.project_retention("keep") is None
    await ret.collect()
    assert await present(engine, keep_old) == set()
    with pytest.raises(NotFound):
        await ret.set_project("nope", 60)
    with pytest.raises(Invalid):
        await ret.set_project("short", -1)


async def test_no_default_keeps_everything_forever(engine: AsyncEngine, repo: Repository) -> None:
    old = await insert_finished(engine, "default", 3, age_s=10 * 365 * 86400)
    report = await Retention(engine, default_s=None).collect()
    assert report.batches == [] and report.complete
    assert await present(engine, old) == set(old)


async def test_batches_are_bounded(engine: AsyncEngine, repo: Repository) -> None:
    await insert_finished(engine, "short", 1200, age_s=2 * HOUR, lines=2)
    ret = Retention(engine, default_s=HOUR, batch=500)
    plan = await ret.plan()
    assert plan.projects["short"].as_dict() == {
        "tasks": 1200,
        "attempts": 1200,
        "log_lines": 2400,
        "log_bytes": 2400 * len("line 0"),
        "artifacts": 1200,
        "artifact_bytes": 12000,
    }
    freed: list[int] = []

    async def after(batch: Any) -> tuple[int, int]:
        freed.append(len(batch.object_names))
        return len(batch.object_names), 0

    started = time.perf_counter()
    report = await ret.collect(after)
    took = time.perf_counter() - started
    print(f"gc: 1200 tasks (2400 log lines, 1200 artifacts) in 3 batches, {took * 1000:.0f} ms")
    assert report.batches == [500, 500, 200]
    assert freed == [500, 500, 200]
    assert report.projects["short"].as_dict() == plan.projects["short"].as_dict()
    assert report.objects_deleted == 1200
    assert await counts(engine) == dict.fromkeys(TABLES, 0)


async def test_max_batches_leaves_the_rest_for_the_next_pass(
    engine: AsyncEngine, repo: Repository
) -> None:
    await insert_finished(engine, "short", 25, age_s=2 * HOUR, lines=0)
    ret = Retention(engine, default_s=HOUR, batch=10)
    first = await ret.collect(max_batches=2)
    assert first.batches == [10, 10] and not first.complete
    second = await ret.collect(max_batches=2)
    assert second.batches == [5] and second.complete


async def test_a_locked_task_is_skipped_not_waited_for(
    engine: AsyncEngine, repo: Repository
) -> None:
    ids = await insert_finished(engine, "short", 5, age_s=2 * HOUR)
    ret = Retention(engine, default_s=HOUR)
    async with engine.connect() as holder:
        # A transition in flight on ids[0] holds its row.
        await holder.execute(
            sa.text("SELECT 1 FROM tasks WHERE id = :id FOR UPDATE"), {"id": ids[0]}
        )
        report = await asyncio.wait_for(ret.collect(), 60)
        assert report.batches == [4]
        await holder.rollback()
    assert await present(engine, ids) == {ids[0]}
    assert (await ret.collect()).batches == [1]


async def test_a_transition_on_another_task_proceeds_during_a_batch(
    engine: AsyncEngine, repo: Repository
) -> None:
    doomed = await insert_finished(engine, "short", 3, age_s=2 * HOUR)
    queued = await repo.submit(TaskSpec(kind=TaskKind.GOAL, goal="g", project="short"))
    ret = Retention(engine, default_s=HOUR)
    async with engine.connect() as holder:
        # Hold one of the batch's log lines: the batch, its task rows locked,
        # waits inside its transaction until the holder lets go.
        await holder.execute(
            sa.text("SELECT 1 FROM log_lines WHERE task_id = :id LIMIT 1 FOR UPDATE"),
            {"id": doomed[0]},
        )
        gc = asyncio.ensure_future(ret.collect())

        async def gc_waits_on_the_line() -> bool:
            async with engine.connect() as conn:
                waiting = await conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query ILIKE 'DELETE FROM log_lines%'"
                    )
                )
                return int(waiting.scalar_one()) == 1

        await until(gc_waits_on_the_line)
        record = await asyncio.wait_for(repo.request_cancel(queued, ADMIN), 60)
        assert record.completed
        assert not gc.done()
        await holder.rollback()
    report = await asyncio.wait_for(gc, 60)
    assert report.batches == [3]
    assert await present(engine, [*doomed, queued]) == {queued}


# --- end to end: the service, its verbs and the object store -------------------------


@pytest.fixture
async def system(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[System]:
    import nats

    svc = await start_service(
        db_url, nats_url, subject_prefix, state_dir, retain_s=None, gc_interval_s=None
    )
    nc = await nats.connect(nats_url)
    sys_ = System(svc, nats_url, nc)
    try:
        await svc.repo.add_user("admin", platform_admin=True)  # type: ignore[union-attr]
        await svc.repo.add_project("default", owner="admin")  # type: ignore[union-attr]
        await svc.repo.add_project("short", owner="admin")  # type: ignore[union-attr]
        yield sys_
    finally:
        for h in sys_.hosts:
            await h.client.close()
        if svc.server is not None:
            await svc.server.delete_storage()
        await nc.close()
        await svc.stop()


async def _finish(system: System, host: Any, project: str, *, artifact: bytes) -> str:
    await system.submit(project=project)
    a = await host.client.claim(wait_s=30)
    assert a is not None
    await host.client.ack(a.task_id, a.attempt, a.lease_token)
    await host.client.append_logs(a.task_id, a.attempt, 0, ["one", "two"])
    await host.client.upload_artifact(a.task_id, a.attempt, a.lease_token, "out.bin", artifact)
    await host.client.result(a.task_id, a.attempt, a.lease_token, outcome="done", fingerprint="f")
    return str(a.task_id)


async def _age(system: System, task_id: str, age_s: float) -> None:
    assert system.svc.engine is not None
    async with system.svc.engine.begin() as conn:
        await conn.execute(
            sa.text(
                "UPDATE tasks SET finished_at = now() - make_interval(secs => :s) WHERE id = :id"
            ),
            {"s": age_s, "id": task_id},
        )


async def test_gc_deletes_expired_tasks_with_their_objects_and_keeps_the_rest(
    system: System,
) -> None:
    ops = system.svc.ops
    token = await system.repo.add_user("root", platform_admin=True)
    user_token = await system.repo.add_user("bob")
    h = await system.host("h1", devices=1)
    data = os.urandom(200 * 1024)
    old = await _finish(system, h, "short", artifact=data)
    recent = await _finish(system, h, "short", artifact=b"recent")
    elsewhere = await _finish(system, h, "default", artifact=b"kept")
    running = (await system.running(h)).task_id
    [queued] = await system.submit(project="short", selector={"os": "none"})
    for task_id in (old, elsewhere):
        await _age(system, task_id, 2 * HOUR)
    await _age(system, recent, 60)
    object_name = (await system.repo.list_artifacts(old, ADMIN))[0]["object_name"]

    # Only a platform admin may set a retention or collect.
    for verb, args in (("project_set_retention", {"name": "short", "retain_s": 60}), ("gc", {})):
        with pytest.raises(Exception) as err:
            await ops.handle(verb, user_token, args)
        assert getattr(err.value, "code", None) == "forbidden"
    with pytest.raises(Invalid):
        await ops.handle("project_set_retention", token, {"name": "short", "retain_s": "1h"})
    reply = await ops.handle("project_set_retention", token, {"name": "short", "retain_s": HOUR})
    assert reply == {"name": "short", "retain_s": HOUR, "retain": "1h", "effective": "1h"}

    before = await system.snapshot()
    plan = await ops.handle("gc", token, {"dry_run": True})
    assert await system.snapshot() == before
    assert plan["dry_run"] and plan["batches"] == []
    assert plan["projects"] == {
        "short": {
            "tasks": 1,
            "attempts": 1,
            "log_lines": 2,
            "log_bytes": 6,
            "artifacts": 1,
            "artifact_bytes": len(data),
        }
    }
    assert await system.server.read_artifact(object_name) == data

    js = system.nc.jetstream()
    stream = f"OBJ_{system.server.artifact_bucket}"
    encoded = base64.urlsafe_b64encode(object_name.encode()).decode()
    meta = f"$O.{system.server.artifact_bucket}.M.{encoded}"
    stored_before = (await js.stream_info(stream)).state.bytes
    assert (await js.stream_info(stream, subjects_filter=meta)).state.subjects

    done = await ops.handle("gc", token, {})
    assert done["batches"] == [1] and done["complete"]
    assert done["projects"] == plan["projects"]
    assert done["objects_deleted"] == 1 and done["objects_failed"] == 0
    assert system.svc.engine is not None
    assert await present(system.svc.engine, [old, recent, elsewhere, running, queued]) == {
        recent,
        elsewhere,
        running,
        queued,
    }
    async with system.svc.engine.connect() as conn:
        for table in ("attempts", "log_lines", "artifacts"):
            n = await conn.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE task_id = :id"), {"id": old}
            )
            assert n.scalar_one() == 0, table
    with pytest.raises(NotFound):
        await system.server.read_artifact(object_name)
    # Its chunks and its metadata are gone from the stream, no tombstone left.
    assert not (await js.stream_info(stream, subjects_filter=meta)).state.subjects
    stored_after = (await js.stream_info(stream)).state.bytes
    assert stored_before - stored_after >= len(data)
    print(f"object store: {stored_before} -> {stored_after} bytes")
    # The others' objects are untouched.
    kept = (await system.repo.list_artifacts(recent, ADMIN))[0]["object_name"]
    assert await system.server.read_artifact(kept) == b"recent"
    # Nothing left to do: a second pass deletes nothing.
    again = await ops.handle("gc", token, {})
    assert again["batches"] == [] and again["total"]["tasks"] == 0


async def test_serve_collects_by_itself_every_interval(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> None:
    svc = await start_service(
        db_url, nats_url, subject_prefix, state_dir, retain_s=HOUR, gc_interval_s=0.2
    )
    try:
        assert svc.repo is not None and svc.engine is not None
        await svc.repo.add_user("admin", platform_admin=True)
        await svc.repo.add_project("short", owner="admin")
        await svc.repo.add_host("h0")
        old = await insert_finished(svc.engine, "short", 3, age_s=2 * HOUR)
        recent = await insert_finished(svc.engine, "short", 2, age_s=60)
        engine = svc.engine

        async def gone() -> bool:
            return not await present(engine, old)

        async def counted() -> bool:
            return bool(svc.gc.counters()["tasks"] == 3)

        await until(gone)
        await until(counted)  # the pass ends after its batch's objects
        assert await present(engine, recent) == set(recent)
        assert svc.gc.last is not None
        # The metrics hook: what this process deleted, read at scrape time.
        scraped = ControlPlaneCollector(svc, asyncio.get_running_loop())
        families = {m.name: m for m in await asyncio.to_thread(lambda: list(scraped.collect()))}
        deleted = {s.labels["what"]: s.value for s in families["fleetlease_gc_deleted"].samples}
        assert deleted["tasks"] == 3 and deleted["log_lines"] == 9 and deleted["artifacts"] == 3
    finally:
        if svc.server is not None:
            await svc.server.delete_storage()
        await svc.stop()
    assert svc.gc is None
