"""The task pages: the list with its filters, one task's history with its logs
and artifacts, cancelling a task and downloading an artifact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode

import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from fleetlease.ops.client import OpsError
from fleetlease.ops.web.pages import Pages, task_id_of
from fleetlease.ops.web.sessions import Session
from fleetlease.ops.web.templating import TASK_STATES, fmt_when

log = structlog.get_logger("fleetlease.web")

LOG_PAGE = 1000


class TaskRoutes(Pages):
    """``/tasks`` and ``/tasks/{task_id}`` with their parts, cancel and artifacts."""

    def _filters(self, request: Request) -> dict[str, Any]:
        q = request.query_params
        states = [s for s in q.getlist("state") if s in TASK_STATES]
        host = (q.get("host") or "").strip() or None
        try:
            limit = min(1000, max(1, int(q.get("limit") or 100)))
        except ValueError:
            limit = 100
        return {"states": states, "host": host, "limit": limit}

    async def _tasks(self, session: Session, filters: dict[str, Any]) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = await self.call(
            session,
            "tasks",
            states=filters["states"] or None,
            host=filters["host"],
            limit=filters["limit"],
        )
        return tasks

    async def tasks(self, request: Request) -> Response:
        session = self.session(request)
        filters = self._filters(request)
        tasks = await self._tasks(session, filters)
        query = urlencode(
            [("state", s) for s in filters["states"]]
            + ([("host", filters["host"])] if filters["host"] else [])
            + [("limit", filters["limit"])]
        )
        return self.render(
            request,
            "tasks.html",
            {"tasks": tasks, "filters": filters, "query": query},
            nav="tasks",
        )

    async def tasks_part(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        tasks = await self._tasks(session, self._filters(request))
        return self.render(request, "_task_rows.html", {"tasks": tasks})

    async def task_row(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        task = await self.call(session, "task_show", id=task_id_of(request))
        return self.render(request, "_task_rows.html", {"tasks": [task]})

    async def _task(self, session: Session, task_id: str) -> dict[str, Any]:
        task = await self.call(session, "task_show", id=task_id)
        artifacts = await self.call(session, "artifacts", id=task_id)
        lines: list[dict[str, Any]] = []
        after = 0
        while True:
            page = await self.call(session, "logs", id=task_id, after_id=after, limit=LOG_PAGE)
            lines.extend(page["lines"])
            after = page["next_after_id"]
            if len(page["lines"]) < LOG_PAGE:
                break
            lines = lines[-self.console.settings.max_log_lines :]
        return {"task": task, "artifacts": artifacts, "lines": lines}

    async def task(self, request: Request) -> Response:
        session = self.session(request)
        return self.render(
            request, "task.html", await self._task(session, task_id_of(request)), nav="tasks"
        )

    async def task_part(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        return self.render(request, "_task.html", await self._task(session, task_id_of(request)))

    async def cancel_confirm(self, request: Request) -> Response:
        session = self.session(request)
        task = await self.call(session, "task_show", id=task_id_of(request))
        return self.render(request, "cancel.html", {"task": task}, nav="tasks")

    async def cancel(self, request: Request) -> Response:
        session = self.session(request)
        task_id = task_id_of(request)
        await self.checked_form(request, session)
        try:
            record = await self.call(session, "cancel", id=task_id)
        except OpsError as exc:
            if exc.code not in ("conflict", "gone"):
                raise
            session.flash("error", f"Not cancelled: {exc.args[0]}")
        else:
            cancel = record.get("cancel") or {}
            by, at = cancel.get("by"), fmt_when(cancel.get("at"))
            if record.get("already_ended"):
                session.flash("error", f"Not cancelled: the task is already {record.get('state')}.")
            elif record.get("completed"):
                text = f"Task cancelled (requested by {by} at {at})."
                if by != session.user:
                    text = f"This task was already cancelled by {by} at {at}."
                session.flash("ok", text)
            else:
                session.flash(
                    "ok",
                    f"Cancel requested by {by} at {at}: the task is {record.get('state')} and "
                    "its host is stopping the attempt; this page shows when it ends.",
                )
            log.info("web_cancel", user=session.user, task_id=task_id)
        return RedirectResponse(f"/tasks/{task_id}", status_code=303)

    async def artifact(self, request: Request) -> Response:
        session = self.session(request)
        task_id = task_id_of(request)
        name = str(request.path_params["name"])
        attempt = int(request.path_params["attempt"])
        first = await self.call(
            session, "artifact_get", id=task_id, name=name, attempt=attempt, offset=0
        )
        client = await self.console.client(session)

        async def body() -> AsyncIterator[bytes]:
            meta = first
            offset = len(meta["data"])
            yield bytes(meta["data"])
            while not meta["eof"] and meta["data"]:
                meta = await client.call(
                    "artifact_get", id=task_id, name=name, attempt=attempt, offset=offset
                )
                offset += len(meta["data"])
                yield bytes(meta["data"])

        filename = name.rsplit("/", 1)[-1] or "artifact"
        headers = {
            "content-disposition": f"attachment; filename*=UTF-8''{quote(filename, safe='')}",
        }
        if isinstance(first.get("size"), int):
            headers["content-length"] = str(first["size"])
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)
