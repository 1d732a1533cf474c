"""The messages actors exchange: frozen keyword-only dataclasses, one per verb.

Requests carry a :class:`~actors.bridge.Reply` created on the event loop; the
actor completes it after the transaction commits (or with a typed error). Every
message checks its own shape (:meth:`Message.validate`) before any handler runs,
so a malformed message is a ``bad_request`` reply, never a crashed actor.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fleetlease.actors.bridge import Reply
from fleetlease.persistence.errors import Invalid
from fleetlease.persistence.model import (
    Assignment,
    LeaseStatus,
    Outcome,
    Session,
    User,
    canonical_uuid,
)


def _check_int(value: object, name: str, *, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Invalid(f"{name} must be an integer >= {minimum}", field=name)


def _check_str(value: object, name: str, *, nonempty: bool = True) -> None:
    if not isinstance(value, str) or (nonempty and not value):
        raise Invalid(f"{name} must be a non-empty string", field=name)


def check_task_id(value: object) -> str:
    """A task id is a UUID string; anything else is ``Invalid(field='task_id')``."""
    if not isinstance(value, str):
        raise Invalid("task_id must be a UUID string", field="task_id")
    try:
        canonical_uuid(value)
    except ValueError as exc:
        raise Invalid("task_id must be a UUID string", field="task_id") from exc
    return value


@dataclass(frozen=True, kw_only=True)
class Message:
    reply: Reply[Any] | None = None

    def validate(self) -> None:
        """Raise ``Invalid`` when a field has the wrong type or range."""
        if self.reply is not None and not isinstance(self.reply, Reply):
            raise Invalid("reply must be a Reply", field="reply")


# --- Lease actor -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HostRequest(Message):
    """A host's message about one attempt of one task (fenced by the repository)."""

    session: Session
    task_id: str
    attempt: int

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.session, Session):
            raise Invalid("session must be a Session", field="session")
        _check_str(self.session.host_id, "session.host_id")
        _check_int(self.session.generation, "session.generation")
        check_task_id(self.task_id)
        _check_int(self.attempt, "attempt", minimum=1)


@dataclass(frozen=True, kw_only=True)
class Claim(HostRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class FencedRequest(HostRequest):
    lease_token: str

    def validate(self) -> None:
        super().validate()
        _check_str(self.lease_token, "lease_token")


@dataclass(frozen=True, kw_only=True)
class Ack(FencedRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class Renew(FencedRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class CancelPoll(FencedRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class Renewed(Message):
    """A renewal of this actor's task committed with this answer (renewals go
    around the actor; it is told only when the answer matters to it)."""

    status: LeaseStatus

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.status, LeaseStatus):
            raise Invalid("status must be a LeaseStatus", field="status")


@dataclass(frozen=True, kw_only=True)
class Progress(FencedRequest):
    seq: int

    def validate(self) -> None:
        super().validate()
        _check_int(self.seq, "seq")


@dataclass(frozen=True, kw_only=True)
class ReportResult(FencedRequest):
    outcome: Outcome
    retryable: bool
    reason: str
    result: dict[str, Any] | None
    fingerprint: str

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.outcome, str) or self.outcome not in set(Outcome):
            raise Invalid("outcome must be done, failed or cancelled", field="outcome")
        if not isinstance(self.retryable, bool):
            raise Invalid("retryable must be a boolean", field="retryable")
        _check_str(self.reason, "reason", nonempty=False)
        if self.result is not None and not isinstance(self.result, dict):
            raise Invalid("result must be a map or null", field="result")
        _check_str(self.fingerprint, "fingerprint")


@dataclass(frozen=True, kw_only=True)
class Cancel(Message):
    """A user's cancel of an in-flight task."""

    task_id: str
    user: User

    def validate(self) -> None:
        super().validate()
        check_task_id(self.task_id)
        if not isinstance(self.user, User):
            raise Invalid("user must be a User", field="user")


@dataclass(frozen=True, kw_only=True)
class Adopt(Message):
    """A (newer) assignment for the actor's task."""

    assignment: Assignment

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.assignment, Assignment):
            raise Invalid("assignment must be an Assignment", field="assignment")


@dataclass(frozen=True, kw_only=True)
class Committed(Message):
    """A host transition this actor handed to the event loop has committed, and
    its host has the answer: the actor brings its cache up to date (and emits,
    stops). ``kind`` names the transition: ``claim``, ``ack``, ``progress`` or
    ``result``; ``outcome`` is what the repository returned."""

    kind: str
    outcome: Any

    def validate(self) -> None:
        super().validate()
        if self.kind not in ("claim", "ack", "progress", "result"):
            raise Invalid("kind must be claim, ack, progress or result", field="kind")


@dataclass(frozen=True, kw_only=True)
class AttemptEnded(Message):
    """The attempt ended in the database (expiry, reconcile, sweep): stop if it is
    the actor's current attempt."""

    attempt: int

    def validate(self) -> None:
        super().validate()
        _check_int(self.attempt, "attempt")


@dataclass(frozen=True, kw_only=True)
class Rebuild(Message):
    """Reload the actor's state from the database (first message after a restart)."""


@dataclass(frozen=True, kw_only=True)
class Crash(Message):
    """Test and fault-injection hook: the handler raises, crashing the actor.
    ``reason`` (optional) is what the crash is logged with: a fail point that
    fired on the event loop names itself there."""

    reason: str = ""

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.reason, str):
            raise Invalid("reason must be a string", field="reason")


# --- Scheduler ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Wake(Message):
    """Something may be assignable: run assign until a batch comes back short."""


# --- Reaper ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Tick(Message):
    """Run ``expire_due`` now. ``seq`` identifies the timer that sent it (a stale
    timer's tick is ignored); None is an explicit poke (tests, ManualClock)."""

    seq: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.seq is not None:
            _check_int(self.seq, "seq")


@dataclass(frozen=True, kw_only=True)
class DeadlineHint(Message):
    """A deadline now exists at ``at``: wake no later than that."""

    at: datetime

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.at, datetime) or self.at.tzinfo is None:
            raise Invalid("at must be an aware datetime", field="at")
