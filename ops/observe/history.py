"""The fleet's last hour, kept in memory for the console's health page.

``FleetHistory`` is a ring of points, one every ``interval_s`` (the oldest
dropped once it holds ``window_s`` of them, so its memory is bounded). Each
point has:

* ``queued`` and ``retrying``: tasks waiting for a device at that moment;
* ``devices``: devices by the fleet view's state (``busy``, ``idle``, ``offline``);
* ``finished``: tasks that finished since the previous point, by outcome
  (``done``, ``failed``, ``cancelled``), as a rate per minute;
* ``dispatch_p50`` and ``dispatch_p99``: the dispatch latency (from the
  commit of an assignment to the commit of its claim by the host, by the
  events' ``at``, in seconds) of the dispatches since the previous point, or
  None when there were none.

The counts of tasks and devices come from one read of the database per point
(``HistorySampler``); the finished tasks and the latencies from the committed
task events of the whole deployment, whichever ``serve`` made them
(``FleetHistory.on_event``, an ``EventFeed.add_listener`` callback, one
dictionary operation per event), so every process shows the same history.
The latencies of one interval are kept exactly up to ``max_latencies``, then as
a uniform reservoir sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
import structlog

from fleetlease.persistence import fleet_view
from fleetlease.persistence.model import TaskState
from fleetlease.persistence.tables import tasks

log = structlog.get_logger("fleetlease.observe")

#: The outcomes of a finished task, in the order the page shows them.
OUTCOMES: tuple[str, ...] = (TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED)
#: The device states of the fleet view, in the order the page shows them.
DEVICE_STATES: tuple[str, ...] = ("busy", "idle", "offline")
WAITING: tuple[str, ...] = (TaskState.QUEUED, TaskState.RETRYING)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 < q <= 100) of ``values`` by the nearest-rank
    method (always one of the values), or None when there are none."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile out of range: {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


@dataclass(frozen=True)
class Point:
    #: Seconds since the epoch (UTC) when the point was taken.
    at: float
    queued: int
    retrying: int
    devices: dict[str, int]
    finished: dict[str, float]
    dispatch_p50: float | None
    dispatch_p99: float | None
    #: How many dispatches the latencies are of.
    dispatches: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FleetHistory:
    """The ring of the last ``window_s`` and what is counted towards its next point."""

    interval_s: float = 10.0
    window_s: float = 3600.0
    #: Latencies kept exactly per interval; beyond, a reservoir of this size.
    max_latencies: int = 10_000
    #: Tasks whose assignment time is remembered (the oldest forgotten first).
    max_pending: int = 100_000
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s < self.interval_s:
            raise ValueError("interval_s must be positive and at most window_s")
        if self.max_latencies < 1 or self.max_pending < 1:
            raise ValueError("max_latencies and max_pending must be positive")
        self.points: deque[Point] = deque(maxlen=math.ceil(self.window_s / self.interval_s))
        self._finished = dict.fromkeys(OUTCOMES, 0)
        self._latencies: list[float] = []
        self._dispatches = 0
        # Ordered by arrival: the oldest goes first, in O(1) (popping the front
        # of a plain dict scans the slots its earlier pops left).
        self._assigned_at: OrderedDict[str, float] = OrderedDict()
        self._since = self.clock()

    # --- the task events -------------------------------------------------------------
    def on_event(self, event: dict[str, Any]) -> None:
        """A task event of the control plane (``state``, ``task_id``)."""
        state = event.get("state")
        task_id = event.get("task_id")
        if not isinstance(state, str) or not isinstance(task_id, str):
            return
        assigned = self._assigned_at.pop(task_id, None)
        if state == TaskState.ASSIGNED:
            if len(self._assigned_at) >= self.max_pending:
                self._assigned_at.popitem(last=False)
            self._assigned_at[task_id] = self._time_of(event)
        elif state == TaskState.DISPATCHED:
            if assigned is not None:
                self._latency(max(self._time_of(event) - assigned, 0.0))
        elif state in self._finished:
            self._finished[state] += 1

    def _time_of(self, event: dict[str, Any]) -> float:
        """When the transition was committed: the event's ``at`` (the task's
        ``updated_at``, written by the transaction that committed it; an
        assignment and its claim made together share it), else now."""
        at = event.get("at")
        if isinstance(at, str):
            with contextlib.suppress(ValueError):
                when = datetime.fromisoformat(at)
                if when.tzinfo is not None:
                    return when.timestamp()
        return self.wall()

    def _latency(self, seconds: float) -> None:
        self._dispatches += 1
        if len(self._latencies) < self.max_latencies:
            self._latencies.append(seconds)
            return
        slot = self.rng.randrange(self._dispatches)
        if slot < self.max_latencies:
            self._latencies[slot] = seconds

    # --- the points --------------------------------------------------------------------
    def record(self, *, queued: int, retrying: int, devices: dict[str, int]) -> Point:
        """Close the interval: a point of these counts and of the events since
        the previous point. The oldest point goes once the ring is full."""
        now = self.clock()
        # At least a second: the first point of a process may close an interval
        # of milliseconds, whose rate would say nothing.
        per_minute = 60.0 / max(now - self._since, 1.0)
        point = Point(
            at=self.wall(),
            queued=int(queued),
            retrying=int(retrying),
            devices={s: int(devices.get(s, 0)) for s in DEVICE_STATES},
            finished={s: round(n * per_minute, 3) for s, n in self._finished.items()},
            dispatch_p50=percentile(self._latencies, 50),
            dispatch_p99=percentile(self._latencies, 99),
            dispatches=self._dispatches,
        )
        self.points.append(point)
        self._since = now
        self._finished = dict.fromkeys(OUTCOMES, 0)
        self._latencies = []
        self._dispatches = 0
        return point

    def snapshot(self) -> dict[str, Any]:
        """The ring as plain data, oldest point first."""
        return {
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "outcomes": list(OUTCOMES),
            "device_states": list(DEVICE_STATES),
            "points": [p.as_dict() for p in self.points],
        }


async def read_counts(engine: Any, timeout_ms: int = 2000) -> tuple[int, int, dict[str, int]]:
    """Tasks queued and retrying, and devices by the fleet view's state, in one
    read-only transaction bounded by ``statement_timeout``."""
    async with engine.connect() as conn:
        await conn.execute(sa.text(f"SET LOCAL statement_timeout = {int(timeout_ms)}"))
        counts = await fleet_view.read_counts(conn, visible=tasks.c.status.in_(WAITING))
        await conn.rollback()
    waiting: dict[str, int] = counts["tasks"]
    return (
        waiting.get(TaskState.QUEUED, 0),
        waiting.get(TaskState.RETRYING, 0),
        dict(counts["devices"]),
    )


class HistorySampler:
    """Takes a point of ``history`` every ``history.interval_s`` on the event
    loop, the first at once. A failed read skips its point (logged); the
    events counted meanwhile go to the next one."""

    def __init__(self, history: FleetHistory, engine: Any) -> None:
        self.history = history
        self.engine = engine
        self._task: asyncio.Task[None] | None = None

    def start(self) -> HistorySampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            try:
                queued, retrying, devices = await read_counts(self.engine)
            except Exception as exc:
                log.warning("history_sample_failed", error=str(exc) or type(exc).__name__)
            else:
                self.history.record(queued=queued, retrying=retrying, devices=devices)
            await asyncio.sleep(self.history.interval_s)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
