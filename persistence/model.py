"""The task state machine and the domain records: pure, no I/O.

One enum whose values are the database strings, the transition table beside it,
and frozen keyword-only dataclasses for what the repository returns. See
ARCHITECTURE.md and ../shared/spec/model.md.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def canonical_uuid(value: str) -> str:
    """``value`` as a canonical UUID string (lower case, hyphenated); ValueError if
    it is none. Canonical input, what every client sends, is returned unparsed:
    a renewal's task id was parsed three times on its way in."""
    if _CANONICAL_UUID.fullmatch(value) is not None:
        return value
    return str(uuid.UUID(value))


class TaskState(enum.StrEnum):
    QUEUED = "queued"
    ASSIGNED = "assigned"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    RETRYING = "retrying"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_active(self) -> bool:
        return self in ACTIVE_STATES

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


ACTIVE_STATES = frozenset({TaskState.ASSIGNED, TaskState.DISPATCHED, TaskState.RUNNING})
TERMINAL_STATES = frozenset({TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED})
WAITING_STATES = frozenset({TaskState.QUEUED, TaskState.RETRYING})

#: Every legal move. Repository updates are guarded by ``WHERE status IN (...)``
#: built from this table; anything else is a typed error.
TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.QUEUED: frozenset({TaskState.ASSIGNED, TaskState.CANCELLED}),
    TaskState.RETRYING: frozenset({TaskState.ASSIGNED, TaskState.CANCELLED, TaskState.QUEUED}),
    TaskState.ASSIGNED: frozenset(
        {
            TaskState.DISPATCHED,
            TaskState.RETRYING,
            TaskState.QUEUED,
            TaskState.FAILED,
            TaskState.CANCELLED,
        }
    ),
    TaskState.DISPATCHED: frozenset(
        {
            TaskState.RUNNING,
            TaskState.RETRYING,
            TaskState.QUEUED,
            TaskState.FAILED,
            TaskState.CANCELLED,
            TaskState.DONE,
        }
    ),
    TaskState.RUNNING: frozenset(
        {
            TaskState.DONE,
            TaskState.FAILED,
            TaskState.CANCELLED,
            TaskState.RETRYING,
            TaskState.QUEUED,
        }
    ),
    TaskState.DONE: frozenset(),
    TaskState.FAILED: frozenset(),
    TaskState.CANCELLED: frozenset(),
}


def can_transition(src: TaskState, dst: TaskState) -> bool:
    return dst in TRANSITIONS[src]


class TaskKind(enum.StrEnum):
    GOAL = "goal"
    WORKFLOW = "workflow"


class Outcome(enum.StrEnum):
    """What a host reports at the end of an attempt."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class EndReason(enum.StrEnum):
    """Why an attempt ended (attempts.end_reason)."""

    DONE = "done"
    FAILED = "failed"
    RETRYABLE_FAILURE = "retryable_failure"
    CANCELLED = "cancelled"
    CLAIM_EXPIRED = "claim_expired"
    ACK_EXPIRED = "ack_expired"
    LEASE_EXPIRED = "lease_expired"
    RECONCILE_LOST = "reconcile_lost"
    HOST_REVOKED = "host_revoked"
    DRAINED = "drained"


class Role(enum.StrEnum):
    OWNER = "owner"
    PROJECT_ADMIN = "project_admin"
    PLATFORM_ADMIN = "platform_admin"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    max_attempts: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0

    def delay_after(self, attempt: int) -> timedelta:
        """Backoff before attempt ``attempt + 1``: min(base * 2^(attempt-1), cap)."""
        if self.backoff_base_s <= 0:
            return timedelta(0)
        exp = min(attempt - 1, 62)
        return timedelta(seconds=min(self.backoff_base_s * (2**exp), self.backoff_cap_s))


@dataclass(frozen=True, kw_only=True)
class LeaseTimings:
    """Deadlines handed out by the repository (seconds)."""

    claim_s: float = 30.0
    ack_s: float = 15.0
    lease_s: float = 30.0
    liveness_s: float = 30.0


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    kind: TaskKind
    payload: dict[str, Any] = field(default_factory=dict)
    selector: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    project: str = "default"
    owner: str = "admin"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    goal: str | None = None
    workflow: str | None = None
    # The client's idempotency key: a submit repeated with the same key (by the
    # same owner) returns the first task instead of making another one, so a
    # client whose reply was lost may simply submit again.
    request_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class HostAdvert:
    """What a host says it runs, with every heartbeat: the workflows it serves
    (None: any workflow, as a simulated runner does) and its goal runner."""

    workflows: tuple[str, ...] | None = None
    goal_runner: str = ""


@dataclass(frozen=True, kw_only=True)
class DeviceSnapshot:
    device_id: str
    state: str = "idle"  # idle | busy | offline
    capabilities: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Assignment:
    task_id: str
    attempt: int
    host_id: str
    device_id: str
    lease_id: str
    claim_deadline: datetime
    project: str = "default"


@dataclass(frozen=True, kw_only=True)
class Claimed:
    """A claimed assignment, as handed to the owning host. Holds the raw lease
    token: it exists only here, once, on its way to the host."""

    task_id: str
    attempt: int
    host_id: str
    device_id: str
    lease_id: str
    lease_token: str = field(repr=False)
    kind: TaskKind
    payload: dict[str, Any]
    goal: str | None
    workflow: str | None
    ack_deadline: datetime
    lease_s: float


@dataclass(frozen=True, kw_only=True)
class LeaseStatus:
    """Reply to ack, renew and progress."""

    task_id: str
    attempt: int
    state: TaskState
    lease_expires_at: datetime
    cancel_requested: bool
    #: This call moved the task to ``state`` (an ack that was not a replay);
    #: not part of the answer to the host.
    moved: bool = field(default=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class ResultRecord:
    """The recorded outcome of a terminal (or retryable) report."""

    task_id: str
    attempt: int
    state: TaskState
    outcome: Outcome
    fingerprint: str
    replayed: bool
    retry_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class CancelRecord:
    """The answer to a cancel request. ``requested_at``/``requested_by``: the
    task's first cancel request (None when it ended without one). ``completed``:
    the task is cancelled. ``ended_before``: the task had ended (done, failed,
    or cancelled without a request) before this request, which wrote nothing.
    ``repeated``: a request was already recorded; this one returned it and
    wrote nothing."""

    task_id: str
    state: TaskState
    requested_at: datetime | None
    requested_by: str | None
    completed: bool
    ended_before: bool = False
    repeated: bool = False


@dataclass(frozen=True, kw_only=True)
class Expired:
    task_id: str
    attempt: int
    host_id: str
    device_id: str
    reason: EndReason
    new_state: TaskState
    retry_at: datetime | None


@dataclass(frozen=True, kw_only=True)
class JournalEntry:
    """What a host reports about an attempt it holds, at reconciliation."""

    task_id: str
    attempt: int
    lease_token: str = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class ReconcileVerdict:
    task_id: str
    attempt: int
    verdict: str  # "confirmed" | "discard"
    reason: str
    state: TaskState | None = None
    cancel_requested: bool = False
    lease_expires_at: datetime | None = None


@dataclass(frozen=True, kw_only=True)
class ReconcileReport:
    generation: int
    verdicts: list[ReconcileVerdict]
    lost: list[Expired]  # active attempts the host no longer reported


@dataclass(frozen=True, kw_only=True)
class Session:
    host_id: str
    generation: int


@dataclass(frozen=True, kw_only=True)
class User:
    name: str
    platform_admin: bool
