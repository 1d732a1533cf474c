"""The retry policy: where a task goes when its current attempt ends without
success."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.engine import RowMapping

from fleetlease.persistence.model import RetryPolicy, TaskState


def _retry_policy(row: RowMapping) -> RetryPolicy:
    return RetryPolicy(
        max_attempts=row["max_attempts"],
        backoff_base_s=row["backoff_base_s"],
        backoff_cap_s=row["backoff_cap_s"],
    )


def _after_failure(
    row: RowMapping, now: datetime, terminal_reason: str
) -> tuple[TaskState, datetime | None, str | None]:
    """Where a task goes when its current attempt ends without success: cancelled
    with a pending cancel, failed at the attempt limit, else queued (zero base) or
    retrying until ``now + backoff``. Returns (state, eligible_at, terminal_reason)."""
    if row["cancel_requested_at"] is not None:
        return TaskState.CANCELLED, None, "cancelled"
    if row["attempt"] >= row["max_attempts"]:
        return TaskState.FAILED, None, terminal_reason
    delay = _retry_policy(row).delay_after(row["attempt"])
    if delay <= timedelta(0):
        return TaskState.QUEUED, now, None
    return TaskState.RETRYING, now + delay, None
