"""The pure task model: states, transitions and the retry policy."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetlease.persistence.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    WAITING_STATES,
    Claimed,
    JournalEntry,
    RetryPolicy,
    TaskKind,
    TaskState,
    can_transition,
)


def test_every_state_is_exactly_one_of_waiting_active_or_terminal() -> None:
    groups = [WAITING_STATES, ACTIVE_STATES, TERMINAL_STATES]
    for state in TaskState:
        assert sum(state in g for g in groups) == 1


def test_terminal_states_have_no_way_out() -> None:
    for state in TERMINAL_STATES:
        assert TRANSITIONS[state] == frozenset()
        assert state.is_terminal and not state.is_active


def test_every_move_out_of_an_active_state_is_legal_only_as_listed() -> None:
    assert can_transition(TaskState.QUEUED, TaskState.ASSIGNED)
    assert can_transition(TaskState.ASSIGNED, TaskState.DISPATCHED)
    assert can_transition(TaskState.DISPATCHED, TaskState.RUNNING)
    assert can_transition(TaskState.RETRYING, TaskState.ASSIGNED)
    assert not can_transition(TaskState.QUEUED, TaskState.RUNNING)
    assert not can_transition(TaskState.ASSIGNED, TaskState.RUNNING)
    assert not can_transition(TaskState.DONE, TaskState.QUEUED)


def test_cancelled_is_reachable_from_queued_assigned_dispatched_running_and_retrying() -> None:
    for state in (*WAITING_STATES, *ACTIVE_STATES):
        assert can_transition(state, TaskState.CANCELLED)


def test_state_values_are_the_database_strings() -> None:
    assert {s.value for s in TaskState} == {
        "queued",
        "assigned",
        "dispatched",
        "running",
        "retrying",
        "done",
        "failed",
        "cancelled",
    }


def test_backoff_doubles_from_the_base_and_stops_at_the_cap() -> None:
    policy = RetryPolicy(max_attempts=10, backoff_base_s=1.5, backoff_cap_s=10)

    assert [policy.delay_after(n).total_seconds() for n in range(1, 6)] == [1.5, 3, 6, 10, 10]


def test_a_zero_base_means_no_backoff() -> None:
    assert RetryPolicy(backoff_base_s=0).delay_after(5) == timedelta(0)


@given(
    base=st.floats(0.001, 1000),
    extra=st.floats(0, 1000),
    attempt=st.integers(1, 10_000),
)
def test_backoff_is_never_negative_never_above_the_cap_and_never_shrinks(
    base: float, extra: float, attempt: int
) -> None:
    policy = RetryPolicy(backoff_base_s=base, backoff_cap_s=base + extra)

    delay = policy.delay_after(attempt)
    assert timedelta(0) < delay <= timedelta(seconds=base + extra)
    assert policy.delay_after(attempt + 1) >= delay


@pytest.mark.parametrize("record", ["claimed", "journal"])
def test_raw_lease_tokens_never_appear_in_a_records_repr(record: str) -> None:
    from datetime import UTC, datetime

    if record == "claimed":
        obj: object = Claimed(
            task_id="t",
            attempt=1,
            host_id="h",
            device_id="d",
            lease_id="l",
            lease_token="secret-token",
            kind=TaskKind.GOAL,
            payload={},
            goal=None,
            workflow=None,
            ack_deadline=datetime(2030, 1, 1, tzinfo=UTC),
            lease_s=30,
        )
    else:
        obj = JournalEntry(task_id="t", attempt=1, lease_token="secret-token")
    assert "secret-token" not in repr(obj)


def test_canonical_uuid_returns_canonical_input_as_is_and_normalizes_the_rest() -> None:
    from fleetlease.persistence.model import canonical_uuid

    c = "0b0e5c52-9a2e-4f58-a7a3-0e0f1b8e2d6a"
    assert canonical_uuid(c) is c
    assert canonical_uuid(c.upper()) == c
    assert canonical_uuid("{" + c + "}") == c
    assert canonical_uuid(c.replace("-", "")) == c
    for bad in ("", "not-a-uuid", c[:-1], c + "0", c.replace("a", "g")):
        with pytest.raises(ValueError):
            canonical_uuid(bad)
