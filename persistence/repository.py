"""The durable scheduling repository: every task transition as one fenced
PostgreSQL transaction (compare-and-set), the time taken from an injected clock.

CONTRACT (signatures fixed; bodies being implemented). Every method is one
transaction that commits the whole transition or changes nothing; errors are the
typed ones of ``persistence.errors``. Host-facing methods take the caller's
``Session`` (host id + generation), already authenticated by the transport; they
re-check in the same transaction that the generation is the host's current one
and the host is not revoked (else ``Unauthorized``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from persistence.clock import Clock, SystemClock
from persistence.model import (
    Assignment,
    CancelRecord,
    Claimed,
    DeviceSnapshot,
    Expired,
    JournalEntry,
    LeaseStatus,
    LeaseTimings,
    Outcome,
    ReconcileReport,
    ResultRecord,
    Session,
    TaskSpec,
    User,
)


@dataclass(frozen=True, kw_only=True)
class Renewal:
    """One renewal in a batch (``renew_many``)."""

    session: Session
    task_id: str
    attempt: int
    lease_token: str


class Repository:
    def __init__(
        self, engine: AsyncEngine, clock: Clock | None = None,
        timings: LeaseTimings | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock or SystemClock()
        self.timings = timings or LeaseTimings()

    # --- tasks -----------------------------------------------------------------
    async def submit(self, spec: TaskSpec) -> str:
        """Insert a queued task, eligible now. Returns the task id (UUID string).
        ``Invalid(field=...)`` for a bad payload/selector/priority/attempts/backoff;
        ``NotFound`` for an unknown project or owner."""
        raise NotImplementedError

    async def submit_many(self, specs: Sequence[TaskSpec]) -> list[str]:
        """Several submits in one transaction (all or nothing)."""
        raise NotImplementedError

    async def assign(self, *, limit: int = 64) -> list[Assignment]:
        """Bind up to ``limit`` eligible waiting tasks (queued, or retrying with
        ``eligible_at <= now``) to distinct idle devices of live hosts matching each
        selector, fair across projects (round-robin by project), priority then FIFO
        within a project; one transaction: attempt n+1, lease id, claim deadline,
        reservation row. Uses FOR UPDATE SKIP LOCKED so concurrent assigners never
        collide; the reservation primary key makes a double reservation impossible."""
        raise NotImplementedError

    async def claim(self, session: Session, task_id: str, attempt: int) -> Claimed:
        """assigned -> dispatched, only by the owning host with its current session
        before the claim deadline. Generates the lease token (returned once), stores
        only its SHA-256, sets ack deadline and the session generation on the
        attempt. Concurrent claims: exactly one wins, the others get ``Conflict``."""
        raise NotImplementedError

    async def claim_next(self, session: Session, *, device_ids: Sequence[str] = ()) -> Claimed | None:
        """Claim the oldest unexpired assigned attempt of this host (optionally only
        on the given devices), or None. SKIP LOCKED among candidates."""
        raise NotImplementedError

    async def pending_assignments(self, host_id: str) -> list[Assignment]:
        """Assigned (unclaimed, unexpired) attempts of a host (read only)."""
        raise NotImplementedError

    async def ack(self, session: Session, task_id: str, attempt: int, lease_token: str) -> LeaseStatus:
        """dispatched -> running before the ack deadline; starts the execution lease.
        Repeated ack of a running attempt returns the current status."""
        raise NotImplementedError

    async def renew(self, session: Session, task_id: str, attempt: int, lease_token: str) -> LeaseStatus:
        """Extend the lease of a dispatched/running attempt (now + lease_s), same
        attempt and device; reports ``cancel_requested``. Expired, replaced or
        foreign lease: ``Conflict`` (or ``Gone`` when terminal) and nothing changes."""
        raise NotImplementedError

    async def renew_many(self, renewals: Sequence[Renewal]) -> list[LeaseStatus | Exception]:
        """Many renewals in one transaction; each entry gets its own outcome (an
        error for one never rolls back the others)."""
        raise NotImplementedError

    async def progress(
        self, session: Session, task_id: str, attempt: int, lease_token: str, seq: int
    ) -> LeaseStatus:
        """A progress report: counts as a renewal; ``progress_seq`` only grows (an
        older or equal seq is accepted as a renewal but does not move it back)."""
        raise NotImplementedError

    async def report_result(
        self, session: Session, task_id: str, attempt: int, lease_token: str, *,
        outcome: Outcome, retryable: bool = False, reason: str = "",
        result: dict[str, Any] | None = None, fingerprint: str,
    ) -> ResultRecord:
        """Terminal report from the active lease: done / failed / cancelled; a
        retryable failure with attempts left goes to retrying (eligible_at = now +
        backoff). Releases the reservation. Replay with the same attempt and
        fingerprint returns the recorded outcome (``replayed=True``); a different
        fingerprint or a stale attempt is ``Conflict``."""
        raise NotImplementedError

    async def request_cancel(self, task_id: str, user: User) -> CancelRecord:
        """Authorized (owner, project admin, platform admin; else ``Forbidden`` and
        nothing written). queued/retrying -> cancelled at once; in flight -> durable
        intent on the task and its current attempt; repeated requests return the
        first intent; terminal tasks return their state unchanged."""
        raise NotImplementedError

    async def expire_due(self, *, limit: int = 500) -> list[Expired]:
        """Attempts whose claim, ack or lease deadline passed: retrying with capped
        exponential backoff (queued at once if base is 0), failed ``lease_expired``
        at the limit, cancelled when a cancel is pending. Reservation released,
        attempt kept with its end reason."""
        raise NotImplementedError

    async def next_deadline(self) -> datetime | None:
        """The earliest claim/ack/lease deadline of any active attempt, or the
        earliest ``eligible_at`` of a retrying task, or None."""
        raise NotImplementedError

    async def active_attempts(self, host_id: str | None = None) -> list[Assignment]:
        """Every active attempt (for rebuilding Lease actors after a restart)."""
        raise NotImplementedError

    # --- hosts -----------------------------------------------------------------
    async def add_host(self, host_id: str) -> str:
        """Create a host; returns its raw credential once (only the hash stored).
        ``Conflict`` if it exists (unless revoked: then re-issued)."""
        raise NotImplementedError

    async def revoke_host(self, host_id: str) -> list[Expired]:
        """Revoke the credential and every session; active attempts of the host end
        (retry policy) and their reservations are released."""
        raise NotImplementedError

    async def register_session(self, host_id: str, credential: str) -> Session:
        """Check the credential (constant time) and start generation n+1; every older
        generation is dead. ``Unauthorized`` for unknown host, wrong credential or
        revoked host (same message for all three)."""
        raise NotImplementedError

    async def current_generation(self, host_id: str) -> int | None:
        """The host's current session generation (None if unknown or revoked)."""
        raise NotImplementedError

    async def heartbeat(self, session: Session, devices: Sequence[DeviceSnapshot]) -> None:
        """Refresh last_seen and replace only this host's device records."""
        raise NotImplementedError

    async def reconcile(self, session: Session, entries: Sequence[JournalEntry]) -> ReconcileReport:
        """Confirm and rebind (to this generation) matching active attempts; verdict
        'discard' for stale/unknown/foreign/wrong-lease/terminal entries; active
        attempts of this host that the host did not report: cancel or retry policy,
        end reason ``reconcile_lost``. Records the outcome on each task."""
        raise NotImplementedError

    # --- users and projections -----------------------------------------------------
    async def add_user(self, name: str, *, platform_admin: bool = False) -> str:
        """Returns the raw user token once."""
        raise NotImplementedError

    async def add_project(self, name: str, *, owner: str, admins: Sequence[str] = ()) -> None:
        raise NotImplementedError

    async def authenticate_user(self, token: str) -> User:
        raise NotImplementedError

    async def task_view(self, task_id: str, user: User) -> dict[str, Any]:
        """The safe projection of one task with its attempts (see ops JSON in the
        README). ``NotFound`` when missing, ``Forbidden`` without a role."""
        raise NotImplementedError

    async def list_tasks(
        self, user: User, *, states: Sequence[str] = (), host_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def list_hosts(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def list_devices(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    # --- logs and artifacts (their own channels; never on the job path) -------------
    async def append_logs(
        self, session: Session, task_id: str, attempt: int, first_seq: int, lines: Sequence[str]
    ) -> int:
        """Store log lines of an attempt the host owns (any state: logs may trail the
        result). Duplicate (task, attempt, seq) lines are ignored (retries are safe).
        Returns the number of new lines. ``Forbidden`` for another host's attempt."""
        raise NotImplementedError

    async def read_logs(
        self, task_id: str, user: User, *, after_id: int = 0, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Lines in order (id, attempt, seq, ts, line), authorized like task_view."""
        raise NotImplementedError

    async def record_artifact(
        self, session: Session, task_id: str, attempt: int, *, name: str, size: int,
        sha256: str, object_name: str,
    ) -> None:
        raise NotImplementedError

    async def list_artifacts(self, task_id: str, user: User) -> list[dict[str, Any]]:
        raise NotImplementedError
