"""Fire-and-forget tasks on the running loop: their result is never awaited,
and an exception in them is retrieved (so asyncio does not log it as never
retrieved) and dropped. For publishes and purges whose failure the caller
cannot act on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


def background(coro: Awaitable[None]) -> None:
    task = asyncio.ensure_future(coro)
    task.add_done_callback(_ignore_result)


def _ignore_result(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()
