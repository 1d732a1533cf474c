"""The fleet history's pure logic: percentiles, the ring's bound and order,
rates per minute by outcome, dispatch latencies per interval and the bounded
memory of assignment times."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import pytest

from fleetlease.ops.observe.history import FleetHistory, percentile


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def event(task_id: str, state: str, at: float | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"task_id": task_id, "state": state, "attempt": 1}
    if at is not None:
        e["at"] = datetime.fromtimestamp(at, UTC).isoformat()
    return e


def history(clock: FakeClock, **kw: Any) -> FleetHistory:
    return FleetHistory(clock=clock, wall=clock, rng=random.Random(7), **kw)


def test_percentile_is_the_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    random.Random(1).shuffle(values)
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([1.0, 2.0], 50) == 1.0
    assert percentile([1.0, 2.0, 10.0], 99) == 10.0
    for bad in (0, -1, 101):
        with pytest.raises(ValueError):
            percentile([1.0], bad)


def test_the_ring_keeps_the_last_window_oldest_first() -> None:
    clock = FakeClock()
    h = history(clock, interval_s=10.0, window_s=60.0)
    for i in range(20):
        clock.now += 10
        h.record(queued=i, retrying=0, devices={"busy": 1})
    snap = h.snapshot()
    assert len(snap["points"]) == 6
    assert [p["queued"] for p in snap["points"]] == [14, 15, 16, 17, 18, 19]
    assert snap["points"][-1]["devices"] == {"busy": 1, "idle": 0, "offline": 0}
    assert snap["interval_s"] == 10.0 and snap["window_s"] == 60.0


def test_finished_tasks_become_a_rate_per_minute_by_outcome_then_reset() -> None:
    clock = FakeClock()
    h = history(clock, interval_s=15.0)
    for i in range(3):
        h.on_event(event(f"t{i}", "done"))
    h.on_event(event("t9", "failed"))
    h.on_event(event("t8", "running"))
    h.on_event({"state": "done"})  # malformed: ignored
    clock.now += 15
    point = h.record(queued=2, retrying=1, devices={})
    assert point.finished == {"done": 12.0, "failed": 4.0, "cancelled": 0.0}
    assert (point.queued, point.retrying) == (2, 1)
    clock.now += 15
    assert h.record(queued=0, retrying=0, devices={}).finished == dict.fromkeys(
        ("done", "failed", "cancelled"), 0.0
    )


def test_dispatch_latency_percentiles_are_of_their_interval_only() -> None:
    clock = FakeClock()
    h = history(clock)
    for i in range(100):
        h.on_event(event(f"t{i}", "assigned"))
        clock.now += (i + 1) / 1000
        h.on_event(event(f"t{i}", "dispatched"))
    h.on_event(event("lone", "dispatched"))  # no assignment seen: not a latency
    point = h.record(queued=0, retrying=0, devices={})
    assert point.dispatches == 100
    assert point.dispatch_p50 == pytest.approx(0.050)
    assert point.dispatch_p99 == pytest.approx(0.099)
    empty = h.record(queued=0, retrying=0, devices={})
    assert (empty.dispatch_p50, empty.dispatch_p99, empty.dispatches) == (None, None, 0)


def test_latency_is_between_the_commits_the_events_stamp_not_their_delivery() -> None:
    clock = FakeClock()
    h = history(clock)
    for i in range(100):
        # Delivered together (the clock stands still), committed (i + 1) ms apart.
        h.on_event(event(f"t{i}", "assigned", at=5000.0))
        h.on_event(event(f"t{i}", "dispatched", at=5000.0 + (i + 1) / 1000))
    h.on_event(event("late", "assigned", at=5000.0))
    h.on_event(event("late", "dispatched", at=4999.0))  # clocks disagree: 0, never negative
    point = h.record(queued=0, retrying=0, devices={})
    assert point.dispatches == 101
    assert point.dispatch_p50 == pytest.approx(0.050)
    assert point.dispatch_p99 == pytest.approx(0.099)


def test_memory_is_bounded_assignments_and_latencies() -> None:
    clock = FakeClock()
    h = history(clock, max_pending=10, max_latencies=50)
    for i in range(1000):
        h.on_event(event(f"t{i}", "assigned"))
    assert len(h._assigned_at) == 10
    h.on_event(event("t0", "dispatched"))  # forgotten: no latency
    for i in range(990, 1000):
        clock.now += 0.5
        h.on_event(event(f"t{i}", "dispatched"))
    assert len(h._assigned_at) == 0
    for i in range(500):
        h.on_event(event(f"x{i}", "assigned"))
        h.on_event(event(f"x{i}", "dispatched"))
    assert len(h._latencies) == 50
    point = h.record(queued=0, retrying=0, devices={})
    assert point.dispatches == 510
    assert point.dispatch_p99 is not None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        FleetHistory(interval_s=0)
    with pytest.raises(ValueError):
        FleetHistory(interval_s=10, window_s=5)
    with pytest.raises(ValueError):
        FleetHistory(max_latencies=0)
