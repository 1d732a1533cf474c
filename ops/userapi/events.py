"""The ``EventFeed``: the recent task events of this process, numbered, with
long-poll waits; what the ``events`` verb serves."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections import deque
from typing import Any

#: Recent task events kept for the ``events`` verb.
EVENT_RING = 10_000


class EventFeed:
    """The recent task events of this control-plane process, numbered from 1, in a
    bounded ring, with long-poll waits: what the ``events`` verb serves. Fed by
    ``ControlPlane.add_listener`` (on the loop; a call from another thread is
    handed to the loop). Each event is stored as ``ops.client.normalize_event``
    shapes it (allow-listed fields only).

    The ring holds only this process's transitions and its numbering starts
    again at each start (``epoch`` names the run): with several ``serve``
    processes behind one NATS, a poll answered by another process reports a
    ``gap`` and starts from that process's present."""

    def __init__(self, capacity: int = EVENT_RING) -> None:
        self.epoch = uuid.uuid4().hex
        self._ring: deque[tuple[int, dict[str, Any]]] = deque(maxlen=capacity)
        self._seq = 0
        self._waiters: set[asyncio.Future[None]] = set()
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()

    @property
    def parked(self) -> int:
        """Event polls parked now."""
        return len(self._waiters)

    @property
    def last(self) -> int:
        """The number of the newest event (0: none yet)."""
        return self._seq

    def add(self, event: Any) -> None:
        loop = self._loop
        if loop is not None:
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                with contextlib.suppress(RuntimeError):  # loop closed: shutting down
                    loop.call_soon_threadsafe(self.add, event)
                return
        from fleetlease.ops.client import normalize_event

        for raw in event if isinstance(event, list) else [event]:
            shaped = normalize_event(raw)
            if shaped is not None:
                self._seq += 1
                self._ring.append((self._seq, shaped))
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def page(self, after: int, limit: int) -> tuple[list[tuple[int, dict[str, Any]]], bool]:
        """Up to ``limit`` events numbered above ``after``, and whether some after
        it already left the ring."""
        if not self._ring:
            return [], False
        first = self._ring[0][0]
        start = max(after + 1, first) - first
        return list(itertools.islice(self._ring, start, start + limit)), after < first - 1

    async def wait(self, after: int, timeout_s: float) -> None:
        """Until an event numbered above ``after`` exists, the feed closes or
        ``timeout_s`` passes."""
        if self._seq > after or self.closed or timeout_s <= 0:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._waiters.discard(waiter)

    def close(self) -> None:
        """Release every long-poll (the control plane is stopping)."""
        self.closed = True
        self._wake()
