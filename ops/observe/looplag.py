"""The event loop's lag: how late it runs a timer that is due.

A probe on the loop sleeps ``interval_s`` and records by how much the wake-up
came late (``fleetlease_event_loop_lag_seconds``). Every request the process
answers waits behind the same ready queue, so the lag is the part of a reply's
latency that is the loop being busy, whatever the request.
"""

from __future__ import annotations

import asyncio
import contextlib

from fleetlease.ops.observe.metrics import LOOP_LAG_SECONDS

__all__ = ["LoopLagProbe"]


class LoopLagProbe:
    """Started on the loop it measures (``start``), stopped with ``stop``."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> LoopLagProbe:
        self._task = asyncio.get_running_loop().create_task(self._probe())
        return self

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            LOOP_LAG_SECONDS.observe(max(0.0, loop.time() - due))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
