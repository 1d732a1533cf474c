"""List reads of the user API: they read only what they return, their pages are
bounded, and a cursor pages through every task exactly once.

The memory figure comes from a real ``fleetlease serve`` child on the test
PostgreSQL and NATS, read from ``/proc/<pid>/status`` while sixteen clients ask
for a page of the longest length at once over tasks with 100 KB payloads. It is
printed; only a generous bound is asserted (the serving process must not hold
every page's payloads)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from fleetlease.persistence import tables as t
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.model import TaskKind, TaskSpec
from fleetlease.persistence.reads import MAX_PAGE
from fleetlease.persistence.repository import Repository
from fleetlease.transport import wire
from fleetlease.transport.subjects import Subjects
from tests.inbox import request
from tests.integration.test_serve import Serve, serve_args, spawn

pytestmark = pytest.mark.embedded

PAYLOAD_BYTES = 100_000
CLIENTS = 16
MIB = 1024 * 1024


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident set (or its peak, ``VmHWM``) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


class Ops:
    """Raw ops requests over NATS (what the CLI's client sends)."""

    def __init__(self, nc: NatsClient, prefix: str, user: str, token: str) -> None:
        self.nc, self.subjects, self.user, self.token = nc, Subjects(prefix), user, token

    async def call(self, verb: str, **args: Any) -> Any:
        req = wire.encode(wire.OpsRequest(token=self.token, verb=verb, args=args))
        msg = await request(self.nc, self.subjects, self.subjects.ops(self.user, verb), req, 60)
        return wire.decode(msg.data).msg


@pytest.fixture
async def repo(db_url: str) -> AsyncIterator[Repository]:
    engine = create_engine(db_url, pool_size=4, max_overflow=4)
    try:
        yield Repository(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def serve(
    db_url: str, nats_url: str, subject_prefix: str, state_dir: Path
) -> AsyncIterator[Serve]:
    s = await spawn(*serve_args(db_url, nats_url, subject_prefix, state_dir))
    try:
        await s.logged("server_started")
        yield s
    finally:
        s.kill()
        await s.wait()


@pytest.fixture
async def ops(
    repo: Repository, serve: Serve, nats_url: str, subject_prefix: str
) -> AsyncIterator[Ops]:
    token = await repo.add_user("admin", platform_admin=True)
    await repo.add_project("default", owner="admin")
    nc = await nats.connect(nats_url)
    try:
        yield Ops(nc, subject_prefix, "admin", token)
    finally:
        await nc.close()


def _spec(i: int, payload_bytes: int = 0, goal_chars: int = 0) -> TaskSpec:
    payload = {"i": i, "blob": "x" * payload_bytes} if payload_bytes else {"i": i}
    goal = f"task {i} " + "g" * goal_chars
    return TaskSpec(kind=TaskKind.GOAL, goal=goal, payload=payload)


async def _submit(
    repo: Repository, n: int, *, first: int = 0, payload_bytes: int = 0, goal_chars: int = 0
) -> list[str]:
    ids: list[str] = []
    for start in range(first, first + n, 100):
        chunk = [
            _spec(i, payload_bytes, goal_chars) for i in range(start, min(start + 100, first + n))
        ]
        ids.extend(await repo.submit_many(chunk))
    return ids


def _page(reply: Any) -> list[dict[str, Any]]:
    assert isinstance(reply, wire.OpsReply), reply
    assert isinstance(reply.data, list)
    return reply.data


async def test_sixteen_longest_pages_at_once_leave_the_payloads_in_the_database(
    repo: Repository, serve: Serve, ops: Ops
) -> None:
    await _submit(repo, MAX_PAGE, payload_bytes=PAYLOAD_BYTES)
    pid = serve.proc.pid
    warm = _page(await ops.call("tasks", limit=MAX_PAGE))
    assert len(warm) == MAX_PAGE
    assert "payload" not in warm[0] and "selector" not in warm[0]

    before = rss_bytes(pid)
    peak = before
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes(pid))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.01)

    sampler = asyncio.ensure_future(sample())
    try:
        pages = await asyncio.gather(*(ops.call("tasks", limit=MAX_PAGE) for _ in range(CLIENTS)))
    finally:
        done.set()
        await sampler
    after = rss_bytes(pid)
    for reply in pages:
        assert len(_page(reply)) == MAX_PAGE
    growth = max(peak, after) - before
    print(
        f"\nserve RSS: {before / MIB:.0f} MiB before, peak {peak / MIB:.0f} MiB, "
        f"{after / MIB:.0f} MiB after {CLIENTS} concurrent pages of {MAX_PAGE} "
        f"(tasks with {PAYLOAD_BYTES // 1000} KB payloads): growth {growth / MIB:.1f} MiB"
    )
    assert growth < 200 * MIB


async def test_a_limit_over_the_longest_page_is_a_bad_request(ops: Ops) -> None:
    reply = await ops.call("tasks", limit=MAX_PAGE + 1)
    assert isinstance(reply, wire.Error), reply
    assert reply.code == "bad_request" and "limit" in reply.message
    reply = await ops.call("tasks", cursor="not-a-cursor")
    assert isinstance(reply, wire.Error) and reply.code == "bad_request", reply


async def test_the_cursor_pages_through_every_task_once_while_new_ones_arrive(
    repo: Repository, ops: Ops
) -> None:
    existing = await _submit(repo, 250)
    seen: list[str] = []
    cursor: str | None = None
    arrived: list[str] = []
    while True:
        args: dict[str, Any] = {"limit": 40}
        if cursor is not None:
            args["cursor"] = cursor
        page = _page(await ops.call("tasks", **args))
        seen.extend(t["id"] for t in page)
        # New tasks arrive between every two pages.
        arrived.extend(await _submit(repo, 7, first=1000 + len(arrived)))
        if not page:
            break
        assert len(page) == 40 or len(seen) == len(existing)
        cursor = page[-1]["cursor"]
    assert len(seen) == len(set(seen)), "a task was listed twice"
    assert set(seen) == set(existing)
    assert seen == list(reversed(existing))  # newest first
    # The newest page now starts with the tasks that arrived meanwhile.
    first = _page(await ops.call("tasks", limit=len(arrived)))
    assert {t["id"] for t in first} == set(arrived)


async def test_a_page_of_long_tasks_is_cut_to_fit_one_reply_and_paging_finds_them_all(
    repo: Repository, ops: Ops
) -> None:
    # 1000 goals of 4000 characters: about 4 MB, more than one NATS message holds.
    existing = await _submit(repo, MAX_PAGE, goal_chars=4000)
    seen: list[str] = []
    pages = 0
    cursor: str | None = None
    while True:
        args: dict[str, Any] = {"limit": MAX_PAGE}
        if cursor is not None:
            args["cursor"] = cursor
        page = _page(await ops.call("tasks", **args))
        if not page:
            break
        pages += 1
        seen.extend(t["id"] for t in page)
        cursor = page[-1]["cursor"]
    print(f"\n{MAX_PAGE} tasks with 4000-character goals came in {pages} pages")
    assert pages > 1
    assert seen == list(reversed(existing))


async def test_large_results_are_cut_to_the_page_budget_in_the_database(
    repo: Repository, serve: Serve, ops: Ops
) -> None:
    ids = await _submit(repo, 300)
    async with repo.engine.begin() as conn:  # finished tasks with 100 KB results
        await conn.execute(
            t.tasks.update()
            .where(t.tasks.c.id.in_(ids))
            .values(result={"blob": "r" * PAYLOAD_BYTES}, status="done")
        )
    pid = serve.proc.pid
    assert _page(await ops.call("tasks", limit=MAX_PAGE))
    before = rss_bytes(pid)
    pages = await asyncio.gather(*(ops.call("tasks", limit=MAX_PAGE) for _ in range(CLIENTS)))
    growth = rss_bytes(pid) - before
    sizes = {len(_page(p)) for p in pages}
    print(
        f"\n{CLIENTS} concurrent pages over tasks with {PAYLOAD_BYTES // 1000} KB results: "
        f"{sorted(sizes)} tasks per page, serve RSS growth {growth / MIB:.1f} MiB"
    )
    assert all(1 <= n < 10 for n in sizes)
    assert all(p["result"] == {"blob": "r" * PAYLOAD_BYTES} for p in _page(pages[0]))
    assert growth < 200 * MIB
