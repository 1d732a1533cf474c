"""The task verbs of the user API: ``submit``, ``tasks``, ``task_show``, ``cancel``,
``cancel_many``, ``events`` (the long-poll of task events), ``logs``,
``artifacts`` and ``artifact_get``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import msgpack
import structlog

from fleetlease.ops.limits import MAX_NAME
from fleetlease.ops.userapi.args import STATES, Args
from fleetlease.ops.userapi.context import ApiContext
from fleetlease.ops.userapi.events import NotHeld
from fleetlease.ops.userapi.projection import (
    project_artifact,
    project_cancel,
    project_log_line,
    project_task,
)
from fleetlease.persistence.bulk import MAX_CANCEL_BATCH, CancelFilter
from fleetlease.persistence.errors import Invalid, NotFound, Unavailable
from fleetlease.persistence.model import RetryPolicy, TaskKind, TaskSpec, TaskState, User
from fleetlease.persistence.reads import MAX_PAGE

log = structlog.get_logger("fleetlease.ops")

MAX_BATCH = 1000
#: The longest page of ``tasks`` (and of ``events``): docs/cli.md, "JSON output".
MAX_LIST = MAX_PAGE
#: The most bytes of tasks one ``tasks`` reply carries (a reply must fit in one
#: NATS message, 1 MiB by default; long goals or large results would not).
MAX_LIST_BYTES = 768 * 1024
MAX_LOG_PAGE = 1000
#: An artifact travels in slices well under NATS's default 1 MiB payload limit.
MAX_ARTIFACT_SLICE = 512 * 1024
#: The longest wait of an ``events`` long-poll.
MAX_EVENTS_WAIT_S = 30.0
#: How long an ``events`` poll waits for a cursor this process does not hold
#: yet (made by another process an instant ago) before calling it unavailable.
HOLD_WAIT_S = 1.0
#: The ``epoch`` of every ``events`` reply, a constant: cursors are ids valid on every process.
EVENTS_EPOCH = "commit-order"


class TaskVerbs(ApiContext):
    """Submitting, listing, showing and cancelling tasks; their events, logs
    and artifacts."""

    async def submit(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(
            args,
            (
                "goal",
                "workflow",
                "payload",
                "selector",
                "priority",
                "max_attempts",
                "backoff_base_s",
                "backoff_cap_s",
                "project",
                "count",
                "request_id",
            ),
        )
        goal = a.text("goal")
        workflow = a.text("workflow", max_len=MAX_NAME)
        if (goal is None) == (workflow is None):
            raise Invalid("exactly one of goal or workflow is required", field="goal")
        defaults = RetryPolicy()
        retry = RetryPolicy(
            max_attempts=a.integer("max_attempts", lo=1, hi=100, default=defaults.max_attempts),
            backoff_base_s=a.number(
                "backoff_base_s", lo=0.0, hi=86400.0, default=defaults.backoff_base_s
            ),
            backoff_cap_s=a.number(
                "backoff_cap_s", lo=0.0, hi=86400.0, default=defaults.backoff_cap_s
            ),
        )
        project = a.name("project", default="default")
        count = a.integer("count", lo=1, hi=MAX_BATCH)
        spec = TaskSpec(
            kind=TaskKind.GOAL if goal is not None else TaskKind.WORKFLOW,
            goal=goal,
            workflow=workflow,
            payload=a.doc("payload"),
            selector=a.str_map("selector"),
            priority=a.integer("priority", lo=-1000, hi=1000, default=0),
            project=project,
            owner=user.name,
            retry=retry,
        )
        # The idempotency key: a submit repeated with it returns the first task(s).
        # With a count, task i of the request gets the key "{request_id}#{i}".
        request_id = a.text("request_id", max_len=100)
        if request_id is not None and "#" in request_id:
            raise Invalid("request_id must not contain '#'", field="request_id")
        await self.repo.check_submit_role(user, project)
        if count is None:
            return {"id": await self.cp.submit(replace(spec, request_id=request_id))}
        specs = [
            replace(spec, request_id=None if request_id is None else f"{request_id}#{i}")
            for i in range(count)
        ]
        ids = await self.cp.submit_many(specs)
        return {"ids": list(ids)}

    async def tasks(self, user: User, args: Any) -> list[dict[str, Any]]:
        """One page of the tasks the user may read, newest first, without
        payloads or selectors. Each carries its ``cursor``: passed back as
        ``cursor``, the next page starts after that task. A page holds fewer
        than ``limit`` tasks at the end of the list, or when its tasks fill
        ``MAX_LIST_BYTES``: the end of the list is an empty page."""
        a = Args(args, ("states", "host", "limit", "cursor", "project", "request_id"))
        rows = await self.reads.list_tasks(
            user,
            states=a.names("states", choices=STATES),
            host_id=a.name("host"),
            project=a.name("project"),
            request_id=a.text("request_id", max_len=100),
            limit=a.integer("limit", lo=1, hi=MAX_LIST, default=100),
            cursor=a.text("cursor", max_len=32),
            max_bytes=MAX_LIST_BYTES,
        )
        page: list[dict[str, Any]] = []
        size = 0
        for row in rows:
            task = project_task(row, with_attempts=False)
            size += len(msgpack.packb(task))
            if page and size > MAX_LIST_BYTES:
                break  # the rest on the next page (after the last cursor)
            page.append(task)
        return page

    async def task_show(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id",))
        return project_task(await self.reads.task_view(a.task_id(), user))

    async def cancel(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id",))
        record = await self.cp.cancel(a.task_id(), user)
        return project_cancel(record)

    async def cancel_many(self, user: User, args: Any) -> dict[str, Any]:
        """One batch (one transaction) of a bulk cancel of waiting tasks of a
        project, oldest first: ``cancelled`` tasks (``ids``), how many
        ``matched`` before it, and the ``bound`` to pass on (tasks submitted
        after the first batch are never taken). ``dry_run``: only count."""
        a = Args(args, ("project", "states", "host", "older_than_s", "bound", "limit", "dry_run"))
        f = CancelFilter(
            project=a.name("project", required=True),
            states=a.names("states", choices=STATES) or [TaskState.QUEUED.value],
            host_id=a.name("host"),
            older_than_s=a.number("older_than_s", lo=0.0, hi=10 * 365 * 86400.0),
            bound=a.integer("bound", lo=0, hi=2**63 - 1),
        )
        limit = a.integer("limit", lo=1, hi=MAX_CANCEL_BATCH, default=MAX_CANCEL_BATCH)
        dry_run = a.flag("dry_run")
        batch = await self.bulk.batch(user, f, limit=limit, dry_run=dry_run)
        if batch.cancelled:
            log.info("tasks_cancelled", count=len(batch.cancelled), project=f.project, by=user.name)
        return {
            "cancelled": len(batch.cancelled),
            "ids": [tid for tid, _ in batch.cancelled],
            "matched": batch.matched,
            "bound": batch.bound,
            "more": batch.matched > len(batch.cancelled) and not dry_run,
        }

    async def events(self, user: User, args: Any) -> dict[str, Any]:
        """Long-poll of the committed task events this user may read, the same
        on every control-plane process. Without ``after``: the cursor of the
        present, at once (a live view is live from there). With it: the
        readable events after that cursor (waiting up to ``wait_s`` for one),
        and ``next``, the cursor to pass next time. A cursor this process does
        not hold (it started listening after it, its ring overflowed past it,
        or its listen connection dropped since) is ``unavailable``, a retryable
        error: another process may hold it (``ops.client.task_events`` asks
        again, and reports a gap when none does). ``epoch`` is accepted and
        ignored, and answered with a constant; ``gap`` is always false (both
        kept for older clients, which pass ``epoch`` back and read ``gap``)."""
        a = Args(args, ("after", "wait_s", "limit", "epoch"))
        after = a.integer("after", lo=0, hi=2**63 - 1)
        wait_s = a.number("wait_s", lo=0.0, hi=MAX_EVENTS_WAIT_S, default=0.0)
        limit = a.integer("limit", lo=1, hi=MAX_LIST, default=500)
        a.text("epoch", max_len=64)
        feed = self.feed

        def reply(events: list[dict[str, Any]], cursor: int) -> dict[str, Any]:
            return {"events": events, "next": cursor, "epoch": EVENTS_EPOCH, "gap": False}

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        if after is None:
            # Not live yet (starting, or listening again after a drop): briefly.
            live_by = loop.time() + HOLD_WAIT_S
            while feed.present is None and not feed.closed and loop.time() < live_by:
                await feed.changed(live_by - loop.time())
            present = feed.present
            if present is None:
                raise Unavailable("the events feed of this control plane is not live yet")
            return reply([], present)
        # A cursor another process just handed out may take a moment to get here.
        hold_until = loop.time() + HOLD_WAIT_S
        while not feed.holds(after) and not feed.closed and loop.time() < hold_until:
            await feed.changed(hold_until - loop.time())
        cursor = after
        while True:
            try:
                page = feed.page(cursor, limit)
            except NotHeld:
                raise Unavailable(
                    "this control plane does not hold that events cursor: ask again"
                ) from None
            if page:
                cursor = page[-1][0]
                shown = [(n, e) for n, e in page if e is not None]
                if shown:
                    readable = await self.repo.readable_task_ids(
                        user, list({e["task_id"] for _, e in shown})
                    )
                    visible = [dict(e, seq=n) for n, e in shown if e["task_id"] in readable]
                    if visible:
                        return reply(visible, cursor)
                continue
            remaining = deadline - loop.time()
            if remaining <= 0 or feed.closed:
                return reply([], cursor)
            await feed.changed(remaining)

    async def logs(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id", "after_id", "limit"))
        task_id = a.task_id()
        after_id = a.integer("after_id", lo=0, hi=2**63 - 1, default=0)
        limit = a.integer("limit", lo=1, hi=MAX_LOG_PAGE, default=MAX_LOG_PAGE)
        # The state is read first: a line written after it is then still returned
        # by this or the next page, so a follower that stops at a terminal state
        # with an empty page has seen every line.
        state = await self.reads.task_state(task_id, user)
        lines = [
            project_log_line(r)
            for r in await self.repo.read_logs(task_id, user, after_id=after_id, limit=limit)
        ]
        next_after = lines[-1]["id"] if lines else after_id
        return {
            "id": task_id,
            "state": state,
            "terminal": state in {s.value for s in TaskState if s.is_terminal},
            "lines": lines,
            "next_after_id": next_after,
        }

    async def artifacts(self, user: User, args: Any) -> list[dict[str, Any]]:
        a = Args(args, ("id",))
        return [project_artifact(r) for r in await self.reads.list_artifacts(a.task_id(), user)]

    async def artifact_get(self, user: User, args: Any) -> dict[str, Any]:
        a = Args(args, ("id", "name", "attempt", "offset", "length"))
        task_id = a.task_id()
        name = a.text("name", required=True, max_len=MAX_NAME)
        attempt = a.integer("attempt", lo=1, hi=2**31 - 1)
        offset = a.integer("offset", lo=0, hi=2**62, default=0)
        length = a.integer("length", lo=1, hi=MAX_ARTIFACT_SLICE, default=MAX_ARTIFACT_SLICE)
        rows = [
            r
            for r in await self.reads.list_artifacts(task_id, user)
            if r.get("name") == name and (attempt is None or r.get("attempt") == attempt)
        ]
        if not rows:
            raise NotFound(f"task {task_id} has no artifact {name!r}", field="name")
        row = max(rows, key=lambda r: int(r.get("attempt") or 0))
        server = getattr(self.service, "server", None)
        if server is None:
            raise NotFound("artifacts are not served here", field="name")
        # Only the range is read, within the user's and the process's read slots.
        data, size = await server.read_artifact_range(
            str(row["object_name"]), offset=offset, length=length, reader=user.name
        )
        meta = project_artifact(row)
        meta.update(offset=offset, data=data)
        meta["eof"] = offset + length >= size
        return meta
