"""The event loop's lag: how late it runs a timer that is due.

A probe on the loop sleeps ``interval_s`` and records by how much the wake-up
came late (``fleetlease_event_loop_lag_seconds``), timed with the
performance counter (uvloop's own clock counts whole milliseconds). Every
request the process answers waits behind the same ready queue, so the lag is
the part of a reply's latency that is the loop being busy (or blocked, or
paused by a garbage collection), whatever the request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fleetlease.ops.observe.metrics import LOOP_LAG_SECONDS

__all__ = ["LoopLagProbe"]


class LoopLagProbe:
    """Started on the loop it measures (``start``), stopped with ``stop``. Each
    lag, in seconds, goes to ``record`` (the histogram unless told)."""

    def __init__(
        self,
        interval_s: float = 0.1,
        record: Callable[[float], None] = LOOP_LAG_SECONDS.observe,
    ) -> None:
        self.interval_s = interval_s
        self.record = record
        self._task: asyncio.Task[None] | None = None

    def start(self) -> LoopLagProbe:
        self._task = asyncio.get_running_loop().create_task(self._probe())
        return self

    async def _probe(self) -> None:
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(max(0.0, time.perf_counter() - due))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the caller was cancelled too: not ours to swallow
