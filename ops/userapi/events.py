"""The ``EventFeed``: the recent committed task events, in commit order, with
long-poll waits; what the ``events`` verb serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("fleetlease.ops")

#: Recent task events kept for the ``events`` verb.
EVENT_RING = 10_000


class NotHeld(LookupError):
    """The feed does not hold this cursor (it started listening after it, the
    ring overflowed past it, or its listen connection dropped since)."""


class EventFeed:
    """The recent committed task events of the whole deployment, in a bounded
    ring, in commit order, with long-poll waits: what the ``events`` verb
    serves. Fed by ``persistence.taskevents.TaskEventStream`` (on the loop),
    so every ``serve`` process holds the same events in the same order, each
    named by the same id.

    A cursor is the id of the last event a client has seen (marks included:
    entries with no event, which name the present when nothing happens). The
    feed holds a cursor when the ring has it: then everything after it, with no
    hole, is in the ring too. ``reset`` (the listen connection dropped)
    forgets everything: a cursor from before cannot be continued here."""

    def __init__(self, capacity: int = EVENT_RING) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._ring: deque[tuple[int, dict[str, Any] | None]] = deque()
        #: Event id -> position (positions count every append of this feed).
        self._index: dict[int, int] = {}
        self._first = 0  # the position of _ring[0]
        self._waiters: set[asyncio.Future[None]] = set()
        self.closed = False
        #: Times the feed was reset (its listen connection dropped).
        self.resets = 0
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    @property
    def parked(self) -> int:
        """Event polls parked now."""
        return len(self._waiters)

    @property
    def present(self) -> int | None:
        """The id of the newest entry: the cursor of "from now on"; None until
        the first entry since the start or the last reset (not live yet)."""
        return self._ring[-1][0] if self._ring else None

    def add_listener(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """``callback(event)`` for each committed event appended from now on,
        whichever process made it (marks are not events)."""
        self._listeners.append(callback)

    def append(self, event_id: int, event: dict[str, Any] | None) -> None:
        """The next committed event (None: a mark), in commit order."""
        if event_id in self._index:
            return  # delivered once by PostgreSQL; never numbered twice here
        if event is not None:
            for callback in self._listeners:
                try:
                    callback(event)
                except Exception as exc:  # one bad listener must not stop the feed
                    log.error("event_feed.listener_failed", error=repr(exc))
        if len(self._ring) >= self.capacity:
            old, _ = self._ring.popleft()
            del self._index[old]
            self._first += 1
        self._index[event_id] = self._first + len(self._ring)
        self._ring.append((event_id, event))
        self._wake()

    def reset(self) -> None:
        """Events may have been missed: forget every entry (and so every cursor
        held), and release the parked polls."""
        self._first += len(self._ring)
        self._ring.clear()
        self._index.clear()
        self.resets += 1
        self._wake()

    def holds(self, cursor: int) -> bool:
        return cursor in self._index

    def page(self, after: int, limit: int) -> list[tuple[int, dict[str, Any] | None]]:
        """Up to ``limit`` entries after cursor ``after`` (``NotHeld`` when the
        feed does not hold it)."""
        position = self._index.get(after)
        if position is None:
            raise NotHeld(after)
        start = position + 1 - self._first
        return [self._ring[i] for i in range(start, min(len(self._ring), start + limit))]

    async def changed(self, timeout_s: float) -> None:
        """Until the next append or reset, the feed closes or ``timeout_s``
        passes."""
        if self.closed or timeout_s <= 0:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiters.discard(waiter)

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def close(self) -> None:
        """Release every long-poll (the control plane is stopping)."""
        self.closed = True
        self._wake()
