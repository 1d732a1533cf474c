"""The payloads of the task-event notifications (``persistence.taskevents``):
what the trigger of migration 0008 sends is read back exactly, and anything
else is refused with ``ValueError`` and never becomes an event."""

from __future__ import annotations

import pytest

from fleetlease.persistence.taskevents import parse

TASK = "7b76e01c-8986-4129-ac29-7b1aa99a55f4"


def test_an_event_and_a_mark_are_read_back() -> None:
    event_id, event = parse(f'[41, "{TASK}", "running", 2, "h1", "sim-0", 1733391823.25]')
    assert event_id == 41
    assert event == {
        "task_id": TASK,
        "state": "running",
        "attempt": 2,
        "host_id": "h1",
        "device_id": "sim-0",
        "at": "2024-12-05T09:43:43.250000+00:00",
    }
    _, queued = parse(f'[42, "{TASK}", "queued", 0, null, null, 1733391823]')
    assert queued is not None and queued["host_id"] is None and queued["device_id"] is None
    assert parse("[43]") == (43, None)


@pytest.mark.parametrize(
    "payload",
    [
        "",
        "not json",
        "{}",
        "[]",
        '["41"]',
        "[true]",
        "[1.5]",
        f'[41, "{TASK}", "running", 2, "h1", "sim-0"]',
        '[41, 7, "running", 2, "h1", "sim-0", 1]',
        f'[41, "{TASK}", null, 2, "h1", "sim-0", 1]',
        f'[41, "{TASK}", "running", "2", "h1", "sim-0", 1]',
        f'[41, "{TASK}", "running", true, "h1", "sim-0", 1]',
    ],
)
def test_anything_else_is_refused(payload: str) -> None:
    with pytest.raises(ValueError):
        parse(payload)
