"""The console's live feed: server-sent events fed by ``ops.client.task_events``
(the control plane's ``events`` long-poll, filtered by the user's roles)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fleetlease.ops.client import OpsError, task_events
from fleetlease.ops.web.pages import Pages
from fleetlease.ops.web.sessions import Session

#: Queued by a gap in the feed: the page is told ``ready`` again.
_GAP: dict[str, Any] = {}


class LiveRoutes(Pages):
    """``/events``: a stream of the user's task events, or of one task's."""

    async def events(self, request: Request) -> Response:
        request.state.fragment = True
        session = self.session(request)
        only = request.query_params.get("task")
        if only is not None:
            try:
                only = str(uuid.UUID(only))
            except ValueError:
                raise HTTPException(404, "no such task") from None
            await self.call(session, "task_show", id=only)  # 403/404 before streaming
        return StreamingResponse(
            self._stream(session, only),
            media_type="text/event-stream",
            headers={"x-accel-buffering": "no"},
        )

    async def _stream(self, session: Session, only: str | None) -> AsyncIterator[str]:
        """``ready`` once subscribed, then ``task`` events (the allow-listed fields
        of ``ops.client.normalize_event``), a comment line when idle, and ``end``
        when the console stops or the session's token stops being accepted.
        ``ready`` again after a gap in the feed (the page re-reads what it
        shows, as after a reconnect)."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=10_000)
        client = await self.console.client(session)
        keepalive = self.console.settings.keepalive_s

        subscribed = asyncio.Event()

        def on_gap() -> None:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_GAP)

        async def pump() -> None:
            try:
                async for event in task_events(client, subscribed=subscribed, on_gap=on_gap):
                    if only is None or event["task_id"] == only:
                        with contextlib.suppress(asyncio.QueueFull):
                            queue.put_nowait(event)
            except OpsError:
                pass
            finally:
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(None)

        pumping = asyncio.create_task(pump())
        closing = asyncio.create_task(self.console.closing.wait())
        try:
            # "ready" (the page then says "live" and re-reads what it shows)
            # only once the subscription is in place: no later event is missed.
            ready = asyncio.create_task(subscribed.wait())
            await asyncio.wait({ready, pumping, closing}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if not subscribed.is_set():
                yield "event: end\ndata: {}\n\n"
                return
            yield "retry: 2000\nevent: ready\ndata: {}\n\n"
            while True:
                getting = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {getting, closing}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
                )
                if getting not in done:
                    getting.cancel()
                    if closing in done:
                        yield "event: end\ndata: {}\n\n"
                        return
                    yield ": idle\n\n"
                    continue
                event = getting.result()
                if event is None:
                    yield "event: end\ndata: {}\n\n"
                    return
                if event is _GAP:
                    yield "event: ready\ndata: {}\n\n"
                    continue
                yield f"event: task\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
        finally:
            for t in (pumping, closing):
                t.cancel()
            await asyncio.gather(pumping, closing, return_exceptions=True)
