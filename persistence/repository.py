"""The durable scheduling repository: every task transition as one fenced
PostgreSQL transaction (compare-and-set), the time taken from an injected clock.

CONTRACT (signatures fixed). Every method is one transaction that commits the
whole transition or changes nothing (the host transitions built by ``claim_op``,
``ack_op``, ``progress_op`` and ``report_result_op`` may share one transaction
through ``run_many``, group commit: each still takes effect whole or not at
all, and a refused one never undoes another); errors are the typed ones of
``persistence.errors``. Host-facing methods take the caller's ``Session`` (host
id + generation), already authenticated by the transport; they re-check in the
same transaction that the generation is the host's current one and the host is
not revoked (else ``Unauthorized``).

Decisions worth knowing when coding against this module:

* Deadlines: an attempt in ``assigned`` expires at ``claim_deadline``; in
  ``dispatched`` at ``ack_deadline`` (``lease_expires_at`` is set equal to it at
  claim, and a renewal in ``dispatched`` is accepted, reports the cancel flag, but
  never extends past the ack deadline); in ``running`` at ``lease_expires_at``
  (``now + lease_s`` from ack, renew, progress and a confirming reconciliation).
  A message exactly at the deadline loses (``deadline > now`` is required).
* Fencing order for host messages: session current and host not revoked
  (``Unauthorized``), task exists (``NotFound``), the referenced attempt exists
  (else ``Conflict`` reason ``unknown_attempt``), the lease token matches
  (``Conflict`` ``wrong_lease``; claim has no token yet), the attempt belongs to
  the caller's host (``Forbidden``), it is the current attempt (``Conflict``
  ``stale_attempt``), it is bound to the caller's session generation (``Conflict``
  ``session_not_bound``: after a new registration ``reconcile`` rebinds it), the
  task is not terminal (``Gone``), the state accepts the message (``Conflict``
  ``wrong_state``), the deadline has not passed (``Gone`` for claim and ack;
  ``Conflict`` ``lease_expired`` for renew, progress and result). Every error
  carries ``reason`` in ``fields``. A result replay (same attempt and fingerprint
  as the recorded one) needs a current session, the host and the token only.
* A zero backoff base sends an expired or retryably failed task straight back to
  ``queued``; otherwise ``retrying`` until ``eligible_at``. A pending cancel turns
  any expiry, loss or retryable failure into ``cancelled``.
* ``current_generation`` returns None also for a host that never registered.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import re
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

import asyncpg
import sqlalchemy as sa
import structlog
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from fleetlease.persistence.clock import Clock, SystemClock
from fleetlease.persistence.driver import DriverConnection
from fleetlease.persistence.errors import (
    Conflict,
    Forbidden,
    Gone,
    Invalid,
    NotFound,
    RepositoryError,
    Unauthorized,
    Unavailable,
)
from fleetlease.persistence.matching import (
    advert_params,
    advert_stmt,
    host_serves,
    serves_workflow,
)
from fleetlease.persistence.model import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    WAITING_STATES,
    Assignment,
    CancelRecord,
    Claimed,
    DeviceSnapshot,
    EndReason,
    Expired,
    HostAdvert,
    JournalEntry,
    LeaseStatus,
    LeaseTimings,
    Outcome,
    ReconcileReport,
    ReconcileVerdict,
    ResultRecord,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
    TaskState,
    User,
    canonical_uuid,
)
from fleetlease.persistence.secrets import hash_secret, matches, new_token, secrets_equal
from fleetlease.persistence.tables import (
    artifacts,
    attempts,
    device_reservations,
    devices,
    hosts,
    log_lines,
    project_admins,
    projects,
    tasks,
    users,
)

log = structlog.get_logger("fleetlease.repository")

T = TypeVar("T")

UUIDT = UUID(as_uuid=False)
MAX_PAYLOAD_BYTES = 256 * 1024
MAX_INT32 = 2**31 - 1
MAX_BACKOFF_S = 7 * 24 * 3600.0
HOST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
#: Transitions ``run_many`` runs without a transaction around them (see
#: ``Repository._run_optimistic``): each only defers its writes.
_OPTIMISTIC_OPS = frozenset({"claim", "ack", "report_result"})
#: SQLSTATEs after which the whole transaction is simply run again: serialization
#: failure, deadlock, and a refused connection (the transaction never started).
RETRY_SQLSTATES = frozenset({"40001", "40P01", "53300", "57P03"})
TX_ATTEMPTS = 5

_ACTIVE = [s.value for s in ACTIVE_STATES]
_WAITING = [s.value for s in WAITING_STATES]
_LEASED = [TaskState.DISPATCHED.value, TaskState.RUNNING.value]
_DUMMY_HASH = hash_secret("no such host")


@dataclass(frozen=True, kw_only=True)
class Renewal:
    """One renewal in a batch (``renew_many``)."""

    session: Session
    task_id: str
    attempt: int
    lease_token: str


#: How far past the first device a task may take ``_reserve`` looks for one
#: whose waiting request is still free (see ``assign_and_claim``), and how many
#: devices one transaction asks about at most: past that (a backlog on hosts
#: whose few requests each wait for hundreds of devices), devices are taken in
#: order, as without requests.
_PREFER_LOOKAHEAD = 64
_PREFER_BUDGET = 4096


class _Prefer:
    """The requests waiting for devices that this assignment transaction has
    given an assignment already (see ``assign_and_claim``)."""

    __slots__ = ("budget", "taken", "waiting")

    def __init__(self, waiting: Callable[[str, str], Hashable | None]) -> None:
        self.waiting = waiting
        self.taken: set[Hashable] = set()
        self.budget = _PREFER_BUDGET

    @property
    def spent(self) -> bool:
        return self.budget <= 0

    def take(self, host_id: str, device_id: str) -> bool:
        """Whether a request waits for this device and has no assignment of
        this transaction yet (it has one now)."""
        self.budget -= 1
        key = self.waiting(host_id, device_id)
        if key is None or key in self.taken:
            return False
        self.taken.add(key)
        return True


class _BatchAborted(Exception):
    """A transition of a shared transaction failed after it may have written."""


@dataclass(frozen=True)
class Transition:
    """One fenced host transition (claim, ack, progress, result), validated and
    ready to run inside a transaction: ``run(conn, now)`` loads, fences and
    writes. Built by the ``*_op`` methods; ``run_one`` gives it a transaction of
    its own, ``run_many`` lets many share one (group commit).

    Every ``run`` raises its typed errors before its first write, so a refused
    transition leaves nothing behind in a shared transaction."""

    op: str
    task_id: str
    attempt: int
    host_id: str
    #: ``run(conn, now, batch)``: ``batch`` is the shared state of ``run_many``
    #: (rows it already loaded and locked, device releases it does at the end),
    #: None in a transaction of its own.
    run: Callable[[AsyncConnection, datetime, _Batch | None], Awaitable[Any]]


class _Batch:
    """What the transitions of one ``run_many`` transaction share."""

    __slots__ = ("free", "generations", "rows", "writes")

    def __init__(
        self, rows: dict[tuple[str, int, str], RowMapping], *, defer_writes: bool = False
    ) -> None:
        self.rows = rows
        #: The attempt's session generation each task's row was read with: the
        #: deferred compare-and-set writes only if it is unchanged.
        self.generations: dict[str, int | None] = {
            r["task_id"]: r["a_generation"] for r in rows.values()
        }
        #: Tasks whose device reservation is released at the end of the batch, in
        #: one statement locking devices in (host, device) order, as heartbeats do:
        #: released one by one in task order they deadlocked with heartbeats.
        self.free: list[str] = []
        #: With ``defer_writes`` (no task twice in the batch), the compare-and-set
        #: of each transition is collected here by statement shape and written at
        #: the end, one multi-row statement per shape: the rows are already locked
        #: by the batch read, and no transition reads what another one writes.
        self.writes: dict[Any, list[tuple[str, int, dict[str, Any], dict[str, Any]]]] | None = (
            {} if defer_writes else None
        )

    def row(self, task_id: str, attempt: int, host_id: str) -> RowMapping | None:
        return self.rows.get((task_id, attempt, host_id))


@dataclass(frozen=True, kw_only=True)
class _Ending:
    """How one active attempt ends (expiry, loss, revocation)."""

    task_id: str
    attempt: int
    host_id: str
    device_id: str
    old_state: str
    reason: EndReason
    new_state: TaskState
    eligible_at: datetime | None
    terminal_reason: str | None

    def expired(self) -> Expired:
        return Expired(
            task_id=self.task_id,
            attempt=self.attempt,
            host_id=self.host_id,
            device_id=self.device_id,
            reason=self.reason,
            new_state=self.new_state,
            retry_at=self.eligible_at if self.new_state is TaskState.RETRYING else None,
        )


# --- small SQL helpers ------------------------------------------------------------


def _arr(values: Sequence[Any], typ: Any) -> sa.ColumnElement[Any]:
    """A typed array parameter (constant SQL text whatever the length)."""
    return sa.cast(sa.literal(list(values), ARRAY(typ)), ARRAY(typ))


def _unnest(name: str, **cols: tuple[Any, Sequence[Any]]) -> Any:
    """``unnest(array, array, ...) AS name(col, col, ...)`` for batch statements."""
    args = [_arr(values, typ) for typ, values in cols.values()]
    return (
        sa.func.unnest(*args)
        .table_valued(*[sa.column(n, typ) for n, (typ, _) in cols.items()])
        .render_derived(name=name)
    )


def _arr_param(name: str, typ: Any) -> sa.ColumnElement[Any]:
    """A typed array bind parameter, for statements built once."""
    return sa.cast(sa.bindparam(name, type_=ARRAY(typ)), ARRAY(typ))


def _unnest_params(name: str, **cols: Any) -> Any:
    """``_unnest`` with bind parameters ``<name>_<col>`` instead of values."""
    args = [_arr_param(f"{name}_{col}", typ) for col, typ in cols.items()]
    return (
        sa.func.unnest(*args)
        .table_valued(*[sa.column(n, typ) for n, typ in cols.items()])
        .render_derived(name=name)
    )


# Statements on the hot paths are built once, with bind parameters, and kept:
# building a SQLAlchemy expression and its cache key anew for every execution was
# most of the control plane's CPU per task. ``_prebuilt(key, build)`` returns the
# statement of that shape, building it on first use.
_PREBUILT: dict[Any, Any] = {}


_PREBUILT_IDS: set[int] = set()


def _prebuilt(key: Any, build: Callable[[], Any]) -> Any:
    stmt = _PREBUILT.get(key)
    if stmt is None:
        stmt = _PREBUILT[key] = build()
        _PREBUILT_IDS.add(id(stmt))
    return stmt


def _is_prebuilt(stmt: Any) -> bool:
    """Whether ``stmt`` is one of ``_prebuilt``'s (kept for the process's life:
    ``DriverConnection`` may keep its compilation)."""
    return id(stmt) in _PREBUILT_IDS


def _live_host(now: datetime, liveness_s: float) -> sa.ColumnElement[bool]:
    return sa.and_(
        hosts.c.revoked_at.is_(None),
        hosts.c.session_generation > 0,
        hosts.c.last_seen > now - timedelta(seconds=liveness_s),
    )


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


FOREIGN_KEY_VIOLATION = "23503"


def _sqlstate(exc: BaseException) -> str | None:
    orig = getattr(exc, "orig", None)
    for obj in (orig, getattr(orig, "__cause__", None)):
        code = getattr(obj, "sqlstate", None) or getattr(obj, "pgcode", None)
        if isinstance(code, str):
            return code
    return None


# --- validation (before touching the database) -------------------------------------


def _check_int(value: object, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise Invalid(f"{field} must be an integer in {lo}..{hi}", field=field)
    return value


def _check_number(value: object, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"{field} must be a number", field=field)
    f = float(value)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise Invalid(f"{field} must be in {lo}..{hi}", field=field)
    return f


def _check_str(value: object, field: str, *, max_len: int = 256, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > max_len:
        raise Invalid(f"{field} must be a string of at most {max_len} characters", field=field)
    if "\x00" in value:
        raise Invalid(f"{field} must not contain NUL", field=field)
    return value


def _check_json_value(value: object, field: str, depth: int = 0) -> None:
    if depth > 64:
        raise Invalid(f"{field} is nested too deeply", field=field)
    if value is None or isinstance(value, bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise Invalid(f"{field} must not contain NaN or infinity", field=field)
        return
    if isinstance(value, str):
        if "\x00" in value:
            raise Invalid(f"{field} must not contain NUL", field=field)
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_json_value(item, field, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or "\x00" in key:
                raise Invalid(f"{field} keys must be strings", field=field)
            _check_json_value(item, field, depth + 1)
        return
    raise Invalid(f"{field} must be JSON-serialisable", field=field)


def _check_json_dict(value: object, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{field} must be an object", field=field)
    _check_json_value(value, field)
    if len(json.dumps(value, allow_nan=False).encode("utf-8")) > MAX_PAYLOAD_BYTES:
        raise Invalid(f"{field} is larger than {MAX_PAYLOAD_BYTES} bytes", field=field)
    return value


def _check_selector(value: object, field: str = "selector") -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > 64:
        raise Invalid(f"{field} must be a mapping of at most 64 string pairs", field=field)
    for k, v in value.items():
        if not isinstance(k, str) or not k or not isinstance(v, str):
            raise Invalid(f"{field} must map strings to strings", field=field)
        if "\x00" in k or "\x00" in v or len(k) > 256 or len(v) > 1024:
            raise Invalid(f"{field} has an invalid entry", field=field)
    return dict(value)


def _check_task_id(value: object) -> str:
    """A task id: wrong type is ``Invalid``; a string that is no UUID names no task."""
    if not isinstance(value, str):
        raise Invalid("task_id must be a string", field="task_id")
    try:
        return canonical_uuid(value)
    except ValueError:
        raise NotFound("no such task", task_id=value) from None


def _check_host_id(value: object, field: str = "host_id") -> str:
    if not isinstance(value, str) or not HOST_ID_RE.match(value):
        raise Invalid(f"{field} must match {HOST_ID_RE.pattern}", field=field)
    return value


def _check_session(session: object) -> Session:
    if not isinstance(session, Session):
        raise Invalid("session must be a Session", field="session")
    _check_host_id(session.host_id, "session.host_id")
    _check_int(session.generation, "session.generation", 0, MAX_INT32)
    return session


def _check_user(user: object) -> User:
    if not isinstance(user, User):
        raise Invalid("user must be a User", field="user")
    return user


def _check_spec(spec: object) -> dict[str, Any]:
    """Validate a TaskSpec into the column values of a new task (no id/times)."""
    if not isinstance(spec, TaskSpec):
        raise Invalid("spec must be a TaskSpec", field="spec")
    try:
        kind = TaskKind(spec.kind)
    except ValueError:
        raise Invalid("kind must be 'goal' or 'workflow'", field="kind") from None
    retry = spec.retry
    if not isinstance(retry, RetryPolicy):
        raise Invalid("retry must be a RetryPolicy", field="retry")
    base = _check_number(retry.backoff_base_s, "backoff_base_s", 0.0, MAX_BACKOFF_S)
    cap = _check_number(retry.backoff_cap_s, "backoff_cap_s", 0.0, MAX_BACKOFF_S)
    if cap < base:
        raise Invalid("backoff_cap_s must be >= backoff_base_s", field="backoff_cap_s")
    return {
        "kind": kind.value,
        "payload": _check_json_dict(spec.payload, "payload"),
        "selector": _check_selector(spec.selector),
        "priority": _check_int(spec.priority, "priority", -1000, 1000),
        "project": _check_str(spec.project, "project", max_len=128),
        "owner": _check_str(spec.owner, "owner", max_len=128),
        "max_attempts": _check_int(retry.max_attempts, "max_attempts", 1, 100),
        "backoff_base_s": base,
        "backoff_cap_s": cap,
        "goal": None if spec.goal is None else _check_str(spec.goal, "goal", max_len=65536),
        "workflow": (
            None if spec.workflow is None else _check_str(spec.workflow, "workflow", max_len=1024)
        ),
        "request_id": _check_request_id(spec.request_id),
    }


_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@#/+=-]{0,127}")
# What a repeated submit must match for its request id to return the first task.
_SPEC_COLUMNS = (
    "kind",
    "goal",
    "workflow",
    "payload",
    "selector",
    "priority",
    "project",
    "max_attempts",
    "backoff_base_s",
    "backoff_cap_s",
)


def _check_request_id(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise Invalid(
            "request_id must be 1-128 characters: letters, digits and . _ : @ # / + = - "
            "(starting with a letter or digit)",
            field="request_id",
        )
    return value


def _check_devices(snapshot: object) -> list[DeviceSnapshot]:
    if isinstance(snapshot, str | bytes) or not isinstance(snapshot, Sequence):
        raise Invalid("devices must be a sequence of DeviceSnapshot", field="devices")
    seen: set[str] = set()
    out: list[DeviceSnapshot] = []
    for dev in snapshot:
        if not isinstance(dev, DeviceSnapshot):
            raise Invalid("devices must be a sequence of DeviceSnapshot", field="devices")
        _check_str(dev.device_id, "devices.device_id", max_len=256)
        if dev.device_id in seen:
            raise Invalid("duplicate device_id", field="devices.device_id")
        seen.add(dev.device_id)
        if dev.state not in ("idle", "busy", "offline"):
            raise Invalid("device state must be idle, busy or offline", field="devices.state")
        _check_selector(dev.capabilities, "devices.capabilities")
        out.append(dev)
    if len(out) > 10_000:
        raise Invalid("too many devices", field="devices")
    return out


# --- policy ------------------------------------------------------------------------


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


_EXPIRY_REASON = {
    TaskState.ASSIGNED.value: EndReason.CLAIM_EXPIRED,
    TaskState.DISPATCHED.value: EndReason.ACK_EXPIRED,
    TaskState.RUNNING.value: EndReason.LEASE_EXPIRED,
}

_OUTCOME_OF_END = {
    EndReason.DONE.value: Outcome.DONE,
    EndReason.FAILED.value: Outcome.FAILED,
    EndReason.RETRYABLE_FAILURE.value: Outcome.FAILED,
    EndReason.CANCELLED.value: Outcome.CANCELLED,
}


# Columns read when fencing a host message: the task, the referenced attempt and
# the caller's host row, in one locking statement.
_FENCE_COLUMNS: list[sa.ColumnElement[Any]] = [
    tasks.c.id.label("task_id"),
    tasks.c.status,
    tasks.c.attempt,
    tasks.c.kind,
    tasks.c.goal,
    tasks.c.workflow,
    tasks.c.payload,
    tasks.c.project,
    tasks.c.max_attempts,
    tasks.c.backoff_base_s,
    tasks.c.backoff_cap_s,
    tasks.c.eligible_at,
    tasks.c.cancel_requested_at,
    tasks.c.result_fingerprint,
    tasks.c.result_attempt,
    tasks.c.progress_seq,
    attempts.c.number.label("a_number"),
    attempts.c.host_id.label("a_host_id"),
    attempts.c.device_id.label("a_device_id"),
    attempts.c.lease_id.label("a_lease_id"),
    attempts.c.lease_token_hash.label("a_token_hash"),
    attempts.c.session_generation.label("a_generation"),
    attempts.c.claim_deadline.label("a_claim_deadline"),
    attempts.c.ack_deadline.label("a_ack_deadline"),
    attempts.c.lease_expires_at.label("a_lease_expires_at"),
    attempts.c.ended_at.label("a_ended_at"),
    attempts.c.end_reason.label("a_end_reason"),
]
#: What fencing a renewal and answering it read (not the task's payload, a
#: JSON document decoded for every renewal otherwise).
_LEASE_FENCE_COLUMNS: list[sa.ColumnElement[Any]] = [
    c
    for c in _FENCE_COLUMNS
    if c.key
    in {
        "task_id",
        "status",
        "attempt",
        "cancel_requested_at",
        "a_number",
        "a_host_id",
        "a_token_hash",
        "a_generation",
        "a_ack_deadline",
        "a_lease_expires_at",
    }
]


def _session_ok(session: Session, generation: int | None, revoked_at: datetime | None) -> bool:
    return (
        generation is not None
        and revoked_at is None
        and session.generation > 0
        and generation == session.generation
    )


def _unauthorized(session: Session) -> Unauthorized:
    return Unauthorized("session is not current", host_id=session.host_id)


async def _may_retry(op: str, state: str | None, attempt: int) -> bool:
    """After a failed ``attempt``: wait a little and say True when the whole
    transaction should simply run again (``RETRY_SQLSTATES``, attempts left)."""
    if state not in RETRY_SQLSTATES or attempt >= TX_ATTEMPTS:
        return False
    log.info("repository.tx_retry", op=op, sqlstate=state, attempt=attempt)
    await asyncio.sleep(random.uniform(0, 0.01 * 2**attempt))
    return True


class Repository:
    def __init__(
        self,
        engine: AsyncEngine,
        clock: Clock | None = None,
        timings: LeaseTimings | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock or SystemClock()
        self.timings = timings or LeaseTimings()

    # --- the transaction boundary ------------------------------------------------
    async def _tx(
        self,
        op: str,
        fn: Callable[[Any, datetime], Awaitable[T]],
        *,
        autocommit: bool = False,
        driver: bool = False,
    ) -> T:
        """Run ``fn`` in one READ COMMITTED transaction with the clock's time. Typed
        errors roll back and propagate; serialization failures and deadlocks run
        the transaction again; driver and connection errors become ``Unavailable``.

        ``autocommit``: ``fn``'s statements each commit on their own (autocommit
        mode), saving the BEGIN and COMMIT round trips. For one read (the hot
        long-poll path reads the session and the pending assignments), one write
        that is atomic by itself (a one-task submit), or statements written to be
        correct each alone (``_run_optimistic``).

        ``driver``: ``fn`` is given a :class:`DriverConnection` instead, which
        runs the same Core statements on the driver's (asyncpg) connection
        without SQLAlchemy's execution layer, in a transaction of the driver's
        (about 75 us of CPU less per statement: the hot paths)."""
        for attempt in range(1, TX_ATTEMPTS + 1):
            try:
                if driver:
                    return await self._on_driver(fn, autocommit)
                if autocommit:
                    async with self.engine.connect() as conn:
                        await conn.execution_options(isolation_level="AUTOCOMMIT")
                        return await fn(conn, self.clock.now())
                async with self.engine.begin() as conn:
                    return await fn(conn, self.clock.now())
            except RepositoryError:
                raise
            except sa.exc.DBAPIError as exc:
                state = _sqlstate(exc)
                if await _may_retry(op, state, attempt):
                    continue
                if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError) or (
                    exc.connection_invalidated or state in RETRY_SQLSTATES
                ):
                    raise Unavailable(
                        f"database unavailable during {op}", op=op, sqlstate=state
                    ) from exc
                if state is not None and state.startswith(("08", "53", "57")):
                    raise Unavailable(
                        f"database unavailable during {op}", op=op, sqlstate=state
                    ) from exc
                raise
            except asyncpg.PostgresError as exc:  # hand-written SQL on the driver's path
                state = exc.sqlstate
                if await _may_retry(op, state, attempt):
                    continue
                if (
                    isinstance(exc, asyncpg.PostgresConnectionError)
                    or state in RETRY_SQLSTATES
                    or (state or "").startswith(("08", "53", "57"))
                ):
                    raise Unavailable(
                        f"database unavailable during {op}", op=op, sqlstate=state
                    ) from exc
                raise
            except (
                asyncpg.InterfaceError,  # the driver's own, on the driver's path
                asyncpg.InternalClientError,  # e.g. a connection the server closed
                OSError,
                TimeoutError,
                sa.exc.TimeoutError,
            ) as exc:
                raise Unavailable(f"database unavailable during {op}", op=op) from exc
        raise Unavailable(f"database kept aborting {op}", op=op)  # pragma: no cover

    async def _on_driver(self, fn: Callable[[Any, datetime], Awaitable[T]], autocommit: bool) -> T:
        """``fn`` with a :class:`DriverConnection` (``_tx``'s ``driver``). A
        failure that may have broken the connection discards it rather than
        return it to the pool."""
        async with self.engine.connect() as conn:
            dconn = await DriverConnection.of(conn, _is_prebuilt)
            try:
                if autocommit:
                    return await fn(dconn, self.clock.now())
                async with dconn.raw.transaction():
                    return await fn(dconn, self.clock.now())
            except RepositoryError:
                raise
            except BaseException as exc:
                # A server's refusal (raised by the driver, or translated by
                # ``DriverConnection``) leaves the connection usable; anything
                # else (lost, or a statement cut short) leaves it unknown.
                cause = exc.__cause__ if isinstance(exc, sa.exc.DBAPIError) else exc
                if not isinstance(cause, asyncpg.PostgresError) or isinstance(
                    cause, asyncpg.PostgresConnectionError
                ):
                    await conn.invalidate()
                raise

    async def _raw(self, op: str, fn: Callable[[Any, datetime], Awaitable[T]]) -> T:
        """``_tx`` for hand-written SQL: ``fn`` is given the driver's (asyncpg)
        connection itself, in autocommit: each statement is its own
        transaction, with no BEGIN or COMMIT round trip (the renewal's hot
        path, the user request's reads)."""
        return await self._tx(op, lambda conn, now: fn(conn.raw, now), autocommit=True, driver=True)

    # --- tasks -----------------------------------------------------------------
    async def submit(self, spec: TaskSpec) -> str:
        """Insert a queued task, eligible now. Returns the task id (UUID string).
        ``Invalid(field=...)`` for a bad payload/selector/priority/attempts/backoff;
        ``NotFound`` for an unknown project or owner."""
        return (await self.submit_many([spec]))[0]

    async def submit_many(self, specs: Sequence[TaskSpec]) -> list[str]:
        """Several submits in one transaction (all or nothing). A spec with a
        ``request_id`` its owner used before gets that first task's id, and no
        new task, if it asks for the same task; ``Conflict`` if not."""
        return (await self.submit_many_new(specs))[0]

    async def submit_many_new(self, specs: Sequence[TaskSpec]) -> tuple[list[str], set[str]]:
        """``submit_many``, also saying which of the ids are new tasks (the others
        are repeated request ids)."""
        if isinstance(specs, str | bytes) or not isinstance(specs, Sequence):
            raise Invalid("specs must be a sequence of TaskSpec", field="specs")
        values = [_check_spec(s) for s in specs]
        if not values:
            return [], set()
        keys = [(v["owner"], v["request_id"]) for v in values if v["request_id"] is not None]
        if len(set(keys)) != len(keys):
            raise Invalid("a request_id is repeated within one submit", field="request_id")
        ids = [str(uuid.uuid4()) for _ in values]

        async def run(conn: AsyncConnection, now: datetime) -> list[str]:
            rows = [
                {
                    **v,
                    "id": tid,
                    "status": TaskState.QUEUED.value,
                    "eligible_at": now,
                    "attempt": 0,
                    "created_at": now,
                    "updated_at": now,
                }
                for tid, v in zip(ids, values, strict=True)
            ]
            insert = _prebuilt("task_insert", tasks.insert)
            if not keys:
                # One row: one INSERT (not an executemany of one).
                await conn.execute(insert, rows[0] if len(rows) == 1 else rows)
                return ids
            return await self._submit_keyed(conn, rows)

        try:
            # A single task without a request id is one INSERT, atomic by itself:
            # no BEGIN and COMMIT round trips around it (the user API's one-task
            # submit). Several rows may be several statements: a transaction.
            one = len(values) == 1 and not keys
            out = await self._tx("submit", run, autocommit=one, driver=one)
            return out, set(ids).intersection(out)
        except sa.exc.IntegrityError as exc:
            # The foreign keys refused an unknown project or owner (nothing was
            # written): read which, for the precise error. Checking first cost
            # two reads on every submit.
            if _sqlstate(exc) != FOREIGN_KEY_VIOLATION:
                raise

        async def which(conn: AsyncConnection, now: datetime) -> None:
            await self._require_names(conn, projects, {v["project"] for v in values}, "project")
            await self._require_names(conn, users, {v["owner"] for v in values}, "owner")

        await self._tx("submit_check", which)
        # Both exist now (created since): the caller may submit again.
        raise Unavailable("a project or owner changed during the submit; retry")

    async def _submit_keyed(self, conn: AsyncConnection, rows: list[dict[str, Any]]) -> list[str]:
        """Insert the rows whose (owner, request id) is new; a row whose key exists
        takes the existing task's id, if that task was submitted with the same
        spec (else ``Conflict``, and the transaction writes nothing). A concurrent
        submit with the same key waits on the unique index, then reads as existing."""
        stmt = (
            pg_insert(tasks)
            .values(rows)
            .on_conflict_do_nothing(
                index_elements=[tasks.c.owner, tasks.c.request_id],
                index_where=tasks.c.request_id.isnot(None),
            )
            .returning(tasks.c.id)
        )
        inserted = {str(i) for i in (await conn.execute(stmt)).scalars()}
        repeated = [r for r in rows if r["id"] not in inserted]
        if not repeated:
            return [r["id"] for r in rows]
        pair = sa.tuple_(tasks.c.owner, tasks.c.request_id)
        found = {
            (row.owner, row.request_id): row
            for row in (
                await conn.execute(
                    sa.select(
                        tasks.c.id,
                        tasks.c.owner,
                        tasks.c.request_id,
                        *(tasks.c[c] for c in _SPEC_COLUMNS),
                    ).where(pair.in_([(r["owner"], r["request_id"]) for r in repeated]))
                )
            ).mappings()
        }
        ids = {}
        for r in repeated:
            first = found.get((r["owner"], r["request_id"]))
            if first is None:  # pragma: no cover - the conflicting row is committed
                raise Unavailable("a repeated submit's first task vanished; retry")
            if any(first[c] != r[c] for c in _SPEC_COLUMNS):
                raise Conflict(
                    f"request_id {r['request_id']!r} was used for a different task ({first['id']})",
                    field="request_id",
                    task_id=str(first["id"]),
                )
            ids[r["id"]] = str(first["id"])
        log.info("repository.submit_repeated", count=len(ids))
        return [ids.get(r["id"], r["id"]) for r in rows]

    async def _require_names(
        self, conn: AsyncConnection, table: sa.Table, names: set[str], field: str
    ) -> None:
        found = set(
            (await conn.execute(sa.select(table.c.name).where(table.c.name.in_(names)))).scalars()
        )
        missing = names - found
        if missing:
            raise NotFound(f"no such {field}: {sorted(missing)[0]}", field=field)

    async def assign(self, *, limit: int = 64) -> list[Assignment]:
        """Bind up to ``limit`` eligible waiting tasks (queued, or retrying with
        ``eligible_at <= now``) to distinct idle devices of live hosts matching each
        selector, fair across projects (round-robin by project), priority then FIFO
        within a project; one transaction: attempt n+1, lease id, claim deadline,
        reservation row. Uses FOR UPDATE SKIP LOCKED so concurrent assigners never
        collide; the reservation primary key makes a double reservation impossible."""
        _check_int(limit, "limit", 1, 10_000)
        return await self._tx(
            "assign", lambda conn, now: self._assign(conn, now, limit), driver=True
        )

    async def assign_and_claim(
        self,
        *,
        limit: int = 64,
        claimer: Callable[[Assignment], Session | None],
        waiting: Callable[[str, str], Hashable | None] | None = None,
    ) -> tuple[list[Assignment], list[Claimed]]:
        """``assign``, and in the same transaction a claim of each new
        assignment that has a claimer: ``claimer`` is asked once per
        assignment, in rank order, and returns the session of a host request
        waiting for that work now (a parked long-poll), or None. Each such
        claim is the claim ``claim`` would make for that session (fenced the
        same way: current session, owning host), written by the transaction
        that assigns, so the request is answered with the lease at the
        assignment's commit. A claim refused (the session was superseded)
        leaves its assignment assigned, to be claimed as usual. Returns the
        assignments and the claims made.

        ``waiting(host_id, device_id)``, if given, names the request that would
        claim an assignment on that device (any hashable; None: no request
        waits for it). A request claims one assignment at most, so among the
        devices a task may take, one whose request no earlier assignment of
        this transaction took comes first (looking a bounded way past the
        first matching device): a host's requests each waiting for several
        devices then get one assignment each, not several on the devices of
        one."""
        _check_int(limit, "limit", 1, 10_000)
        if not callable(claimer):
            raise Invalid("claimer must be a callable", field="claimer")
        if waiting is not None and not callable(waiting):
            raise Invalid("waiting must be a callable", field="waiting")

        async def run(
            conn: AsyncConnection, now: datetime
        ) -> tuple[list[Assignment], list[Claimed]]:
            prefer = _Prefer(waiting) if waiting is not None else None
            won = await self._assign(conn, now, limit, prefer)
            return won, await self._claim_assigned(conn, now, won, claimer)

        return await self._tx("assign", run, driver=True)

    async def _claim_assigned(
        self,
        conn: AsyncConnection,
        now: datetime,
        won: Sequence[Assignment],
        claimer: Callable[[Assignment], Session | None],
    ) -> list[Claimed]:
        """Claim, in the assigning transaction, the assignments just made that
        have a claimer: one read of their rows (locked already), their writes in
        one statement at the end, as a group commit of claims does."""
        mine: list[tuple[Assignment, Session]] = []
        for a in won:  # rank order
            session = claimer(a)
            if session is not None:
                _check_session(session)
                mine.append((a, session))
        if not mine:
            return []
        mine.sort(key=lambda item: item[0].task_id)
        batch = _Batch(
            await self._load_fenced_many(
                conn, [(a.task_id, a.attempt, a.host_id) for a, _ in mine]
            ),
            defer_writes=True,
        )
        claimed: list[Claimed] = []
        for a, session in mine:
            op = self.claim_op(session, a.task_id, a.attempt)
            try:
                claimed.append(await op.run(conn, now, batch))
            except RepositoryError as exc:
                log.info("repository.claim_at_assign_refused", task_id=a.task_id, code=exc.code)
        if batch.writes:
            await self._write_deferred(conn, batch, now)
        return claimed

    def _free_params(self, now: datetime) -> dict[str, Any]:
        return {"now": now, "live_after": now - timedelta(seconds=self.timings.liveness_s)}

    async def _assign(
        self, conn: AsyncConnection, now: datetime, limit: int, prefer: _Prefer | None = None
    ) -> list[Assignment]:
        """Candidates come in rank order, in batches: each batch re-reads the free
        devices (which then exclude this transaction's own reservations and those
        other assigners committed), locks the next candidates that still match one
        of them, and reserves greedily. Candidates left without a device stay locked
        and are tried again (first, keeping their rank) in the next batch."""
        won: list[Assignment] = []
        pending: list[Any] = []
        seen: list[str] = []
        params = self._free_params(now)
        # The first read of the free devices returns nothing when nothing waits
        # (the common wake-up after a result): the fleet's free devices are not
        # read to find out, and it is one statement either way.
        free = _FreeDevice.load(
            (await conn.execute(_prebuilt("free_if_waiting", _free_if_waiting_stmt), params)).all()
        )
        for batch in range(8):
            if batch:
                free = _FreeDevice.load(
                    (
                        await conn.execute(_prebuilt("free_devices", _free_devices_stmt), params)
                    ).all()
                )
            room = min(limit - len(won), len(free))
            if room <= 0:
                break
            fresh = await self._lock_candidates(conn, now, room, seen)
            seen.extend(t.id for t in fresh)
            pending.extend(fresh)
            got = await self._reserve(conn, now, pending, free, limit - len(won), prefer)
            won.extend(got)
            taken = {a.task_id for a in got}
            pending = [t for t in pending if t.id not in taken]
            if not fresh and not got:
                break
            # Enough; or every device this transaction knew as free is now taken;
            # or the ranking ran out of waiting tasks and none is left unmatched:
            # another read could only find devices freed, or tasks submitted, by
            # commits since, and each of those wakes the Scheduler for another
            # pass anyway. (Saves three round trips of most passes.)
            if len(won) >= limit or len(got) >= len(free) or (len(fresh) < room and not pending):
                break
        return won

    async def _lock_candidates(
        self, conn: AsyncConnection, now: datetime, n: int, exclude: Sequence[str]
    ) -> list[Any]:
        """Lock the next ``n`` waiting tasks, fair across projects (round-robin by
        project, priority then FIFO within one), that match some free device."""
        # Two short statements: the rank (no locks), then the ranked tasks locked
        # by primary key. As one statement the planner, misled by the fast-moving
        # statistics of the tasks table, joined every waiting task against the
        # ranking (8 ms with 3,000 waiting, on every assignment).
        params = {**self._free_params(now), "scan": 2 * n + len(exclude)}
        ranked = [
            r.id
            for r in await conn.execute(_prebuilt("rank_candidates", _rank_candidates_stmt), params)
        ]
        skip = set(exclude)
        ranked = [t for t in ranked if t not in skip]
        if not ranked:
            return []
        return list(
            await conn.execute(
                _prebuilt("lock_candidates", _lock_candidates_stmt),
                {"now": now, "ids": ranked, "n": n},
            )
        )

    async def _reserve(
        self,
        conn: AsyncConnection,
        now: datetime,
        candidates: list[Any],
        free: Sequence[Any],
        limit: int,
        prefer: _Prefer | None = None,
    ) -> list[Assignment]:
        """Match locked candidates to free devices greedily in rank order and insert
        the reservations (ON CONFLICT DO NOTHING: a device another assigner reserved
        first is simply lost, and looked for again with a fresh read). With
        ``prefer``, a task takes a device whose waiting request is still free
        if one comes soon enough after the first it matches."""
        won: list[Assignment] = []
        pending = list(candidates)
        for _round in range(4):
            if not pending or not free or len(won) >= limit:
                break
            pairs: list[tuple[Any, Any]] = []
            used: set[int] = set()
            # Devices before ``first`` are all taken: a task without a selector
            # takes the first one left, without walking past the taken ones again
            # (with thousands free, that walk was quadratic in the batch).
            first = 0
            for task in pending:
                if len(won) + len(pairs) >= limit:
                    break
                while first in used:
                    first += 1
                selector = (task.selector or {}).items()
                fallback: int | None = None
                for i in range(first, len(free)):
                    if i in used:
                        continue
                    dev = free[i]
                    caps = dev.capabilities or {}
                    if not all(caps.get(k) == v for k, v in selector):
                        continue
                    if not host_serves(dev.workflows, task.workflow):
                        continue
                    pick = i
                    if prefer is not None:
                        if prefer.spent:  # the first that matched
                            pick = i if fallback is None else fallback
                        elif not prefer.take(dev.host_id, dev.device_id):
                            if fallback is None:
                                fallback = i
                            if i - fallback < _PREFER_LOOKAHEAD:
                                continue
                            pick = fallback
                    used.add(pick)
                    pairs.append((task, free[pick]))
                    fallback = None
                    break
                if fallback is not None:  # nothing preferred up to the end
                    used.add(fallback)
                    pairs.append((task, free[fallback]))
            if not pairs:
                break
            pairs.sort(key=lambda p: (p[1].host_id, p[1].device_id))
            # One statement reserves the devices (a device another assigner
            # reserved first is skipped), inserts the attempts of the reserved
            # ones and moves their tasks to assigned.
            deadline = now + timedelta(seconds=self.timings.claim_s)
            rows = (
                await conn.execute(
                    _prebuilt("reserve_and_bind", _reserve_and_bind_stmt),
                    {
                        "r_host_id": [d.host_id for _, d in pairs],
                        "r_device_id": [d.device_id for _, d in pairs],
                        "r_task_id": [t.id for t, _ in pairs],
                        "r_attempt": [t.attempt + 1 for t, _ in pairs],
                        "p_now": now,
                        "p_deadline": deadline,
                    },
                )
            ).all()
            if rows and rows[0].bound != len(rows):  # locked rows cannot move: a bug if seen
                raise Conflict("assignment lost its task", reason="assign_race")
            lease_ids = {str(r.task_id): str(r.lease_id) for r in rows}
            got = set(lease_ids)
            won.extend(
                Assignment(
                    task_id=t.id,
                    attempt=t.attempt + 1,
                    host_id=d.host_id,
                    device_id=d.device_id,
                    lease_id=lease_ids[t.id],
                    claim_deadline=deadline,
                    project=t.project,
                )
                for t, d in pairs
                if t.id in got
            )
            pending = [t for t in pending if t.id not in got]
            if len(got) == len(pairs) or not pending:
                break
            # Somebody else reserved some of our devices: look again.
            free = _FreeDevice.load(
                (
                    await conn.execute(
                        _prebuilt("free_devices", _free_devices_stmt), self._free_params(now)
                    )
                ).all()
            )
        # Rank order for the caller, whatever order the devices were inserted in.
        rank = {t.id: i for i, t in enumerate(candidates)}
        return sorted(won, key=lambda a: rank[a.task_id])

    # --- host messages: fencing ----------------------------------------------------
    async def _load(
        self,
        conn: AsyncConnection,
        session: Session,
        task_id: str,
        attempt: int,
        preloaded: RowMapping | None = None,
    ) -> RowMapping:
        """Lock the task and the referenced attempt and read the caller's host row,
        in one statement (or take that row from ``run_many``'s batch read); raise
        the precise error when there is no such pair."""
        if preloaded is not None:
            row: RowMapping | None = preloaded
        else:
            row = (
                (
                    await conn.execute(
                        _prebuilt("load", _load_stmt),
                        {"task_id": task_id, "attempt": attempt, "host_id": session.host_id},
                    )
                )
                .mappings()
                .first()
            )
        if row is not None:
            if not _session_ok(session, row["host_generation"], row["host_revoked_at"]):
                raise _unauthorized(session)
            return row
        await self._check_session_row(conn, session)
        exists = (await conn.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id))).first()
        if exists is None:
            raise NotFound("no such task", task_id=task_id)
        raise Conflict("no such attempt", reason="unknown_attempt", task_id=task_id)

    async def _check_session_row(
        self, conn: AsyncConnection, session: Session, *, lock: bool = False
    ) -> None:
        stmt = sa.select(hosts.c.session_generation, hosts.c.revoked_at).where(
            hosts.c.host_id == session.host_id
        )
        if lock:
            stmt = stmt.with_for_update(read=True)
        host = (await conn.execute(stmt)).first()
        if host is None or not _session_ok(session, host.session_generation, host.revoked_at):
            raise _unauthorized(session)

    @staticmethod
    def _fence_owner(row: RowMapping, session: Session, attempt: int) -> None:
        if row["a_host_id"] != session.host_id:
            raise Forbidden("the attempt belongs to another host", task_id=row["task_id"])
        if attempt != row["attempt"]:
            raise Conflict(
                "stale attempt",
                reason="stale_attempt",
                task_id=row["task_id"],
                current_attempt=row["attempt"],
            )

    @staticmethod
    def _fence_lease(row: RowMapping, session: Session, attempt: int, lease_token: str) -> None:
        """Checks 2-5 of model.md "Fencing" except the deadline (check 1 is done by
        ``_load``). The token is checked first: a lease the caller does not hold is
        a conflict whoever owns it (host-agent.md "Lease is stale or foreign"); valid
        lease evidence presented by another host is forbidden (durable-scheduling.md
        "Invalid endpoint or session")."""
        tid = row["task_id"]
        if not matches(lease_token, row["a_token_hash"]):
            raise Conflict("lease token does not match", reason="wrong_lease", task_id=tid)
        Repository._fence_owner(row, session, attempt)
        if row["a_generation"] != session.generation:
            raise Conflict(
                "the attempt is bound to an older session: reconcile first",
                reason="session_not_bound",
                task_id=tid,
            )
        if row["status"] in TERMINAL_STATES:
            raise Gone("the task is terminal", reason="terminal", task_id=tid, state=row["status"])
        if row["status"] not in _LEASED:
            raise Conflict(
                "the task state does not accept this message",
                reason="wrong_state",
                task_id=tid,
                state=row["status"],
            )

    @staticmethod
    def _check_lease_args(session: Session, task_id: str, attempt: int, lease_token: str) -> str:
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_str(lease_token, "lease_token", max_len=512)
        return tid

    @staticmethod
    def _deadline(row: RowMapping) -> datetime:
        if row["status"] == TaskState.DISPATCHED.value:
            return row["a_ack_deadline"]  # type: ignore[no-any-return]
        return row["a_lease_expires_at"]  # type: ignore[no-any-return]

    def _status(
        self, row: RowMapping, state: str, expires: datetime, *, moved: bool = False
    ) -> LeaseStatus:
        return LeaseStatus(
            task_id=row["task_id"],
            attempt=row["attempt"],
            state=TaskState(state),
            lease_expires_at=expires,
            cancel_requested=row["cancel_requested_at"] is not None,
            moved=moved,
        )

    async def _update_pair(
        self,
        conn: AsyncConnection,
        task_id: str,
        attempt: int,
        from_states: Sequence[str],
        task_values: dict[str, Any],
        attempt_values: dict[str, Any],
        batch: _Batch | None = None,
    ) -> None:
        """Compare-and-set the task (state and attempt) and its attempt in one
        statement; zero rows is a ``Conflict`` (the caller holds the row locks, so
        it means a bug rather than a race). In a batch that defers its writes,
        collected for ``_write_deferred``."""
        # A None is SQL NULL, part of the statement's shape (a JSON column would
        # take a bound None as the JSON value null).
        shape = (
            tuple(from_states),
            tuple(sorted((k, v is None) for k, v in task_values.items())),
            tuple(sorted((k, v is None) for k, v in attempt_values.items())),
        )
        if batch is not None and batch.writes is not None:
            batch.writes.setdefault(shape, []).append(
                (task_id, attempt, task_values, attempt_values)
            )
            return
        params = {f"t_{k}": v for k, v in task_values.items() if v is not None}
        params.update({f"a_{k}": v for k, v in attempt_values.items() if v is not None})
        params["p_task_id"] = task_id
        params["p_attempt"] = attempt
        done = (
            await conn.execute(
                _prebuilt(("update_pair", shape), lambda: _update_pair_stmt(*shape)), params
            )
        ).first()
        if done is None:
            raise Conflict("the task changed underneath", reason="cas_failed", task_id=task_id)

    async def _write_deferred(
        self, conn: AsyncConnection, batch: _Batch, now: datetime, *, strict: bool = True
    ) -> set[str]:
        """A batch's collected compare-and-sets and its device releases, in one
        statement (``_write_batch_stmt``: one round trip for the batch's writes).
        Returns the tasks written. ``strict`` (the rows are locked by the batch's
        read): a row that did not match raises ``_BatchAborted``, the batch is
        rolled back and run one by one."""
        assert batch.writes is not None
        shapes = sorted(batch.writes)
        params: dict[str, Any] = {}
        for n, shape in enumerate(shapes):
            items = batch.writes[shape]
            params[f"v{n}_task_id"] = [i[0] for i in items]
            params[f"v{n}_attempt"] = [i[1] for i in items]
            params[f"v{n}_generation"] = [batch.generations.get(i[0]) for i in items]
            for prefix, keys, at in (("t_", shape[1], 2), ("a_", shape[2], 3)):
                table = tasks if prefix == "t_" else attempts
                for k, is_none in keys:
                    if is_none:
                        continue
                    values = [cast(dict[str, Any], i[at])[k] for i in items]
                    if isinstance(table.c[k].type, sa.JSON):
                        values = [json.dumps(v) for v in values]
                    params[f"v{n}_{prefix}{k}"] = values
        release = bool(batch.free)
        if release:
            params["task_ids"] = list(batch.free)
            params["now"] = now
        key = ("write_batch", tuple(shapes), release)
        rows = (
            await conn.execute(
                _prebuilt(key, functools.partial(_write_batch_stmt, tuple(shapes), release)),
                params,
            )
        ).all()
        written = {str(r.task_id) for r in rows if r.task_id is not None}
        if strict:
            missed = sum(len(items) for items in batch.writes.values()) - len(written)
            if missed:
                raise _BatchAborted(f"{missed} compare-and-set(s) failed")
        batch.writes.clear()
        batch.free.clear()
        return written

    # --- claim / ack / renew / progress ------------------------------------------
    async def run_one(self, t: Transition) -> Any:
        """A transition in a transaction of its own."""
        return await self._tx(t.op, lambda conn, now: t.run(conn, now, None), driver=True)

    async def run_many(self, ts: Sequence[Transition]) -> list[Any]:
        """Many transitions in one transaction (one commit): each gets its own
        outcome (a result or a ``RepositoryError``); a typed error for one never
        rolls back the others (each refuses before writing). They run in task id
        order, so concurrent batches lock rows in one order.

        Claims, acks and results, each task once (the usual batch, and a batch
        of one), take ``_run_optimistic`` instead: a read and one write, both in
        autocommit, each written only if its rows are as read.

        ``Unavailable`` (the database is down or the commit's fate unknown) is
        every transition's outcome. Any other failure that aborts the shared
        transaction (a compare-and-set that found a written row inconsistent, an
        unexpected database error) rolls it all back; then each transition runs
        in a transaction of its own, so only the culprit fails."""
        if not ts:
            return []
        seen = Counter(t.task_id for t in ts)
        distinct = len(seen) == len(ts)
        if distinct and all(t.op in _OPTIMISTIC_OPS for t in ts):
            return await self._run_optimistic(ts)
        if len(ts) == 1:
            return [await self._outcome(ts[0])]
        order = sorted(range(len(ts)), key=lambda i: ts[i].task_id)
        # One locking read for the batch, of every task it names, in task id
        # order: a task named twice is locked here too (then reads its own row
        # again, as the first transition may change it), or two batches naming
        # the same tasks twice lock them in different orders and deadlock.
        keys = list({t.task_id: (t.task_id, t.attempt, t.host_id) for t in ts}.values())

        async def run(conn: AsyncConnection, now: datetime) -> list[Any]:
            rows = await self._load_fenced_many(conn, keys)
            if not distinct:
                rows = {k: r for k, r in rows.items() if seen[k[0]] == 1}
            batch = _Batch(rows, defer_writes=distinct)
            out: list[Any] = [None] * len(ts)
            for i in order:
                t = ts[i]
                try:
                    out[i] = await t.run(conn, now, batch)
                except RepositoryError as exc:
                    if exc.fields.get("reason") == "cas_failed":
                        raise _BatchAborted from exc  # it may have written: undo all
                    out[i] = exc
            if batch.writes:
                await self._write_deferred(conn, batch, now)
            if batch.free:
                await self._release_devices(conn, now, batch.free)
            return out

        try:
            result: list[Any] = await self._tx("transitions", run, driver=True)
            return result
        except Unavailable as exc:
            return [exc] * len(ts)
        except Exception as exc:  # isolated below, one by one
            log.warning("repository.batch_isolated", size=len(ts), error=repr(exc))
        return [await self._outcome(t) for t in ts]

    async def _run_optimistic(self, ts: Sequence[Transition]) -> list[Any]:
        """Claims, acks and results (each task once) without a transaction
        around them: two statements, each its own transaction in autocommit.

        The first reads every transition's task, attempt and host row without
        locking them; each transition fences itself against its row in Python,
        as in a locked batch (a refusal is its answer: the row was the state at
        the time of that read), and defers its compare-and-set. The second writes
        them all (``_write_batch_stmt``), each only if its row is still as read:
        the task's state and attempt, the attempt open and bound to the session
        generation read, the attempt row locked first. A pair is written whole or
        not at all, and whatever one writes does not depend on another. A
        transition whose row changed in between (an expiry, a reconcile, a
        cancel won the race) was not written: it runs again in a locked
        transaction of its own, which gives its precise answer."""
        keys = [(t.task_id, t.attempt, t.host_id) for t in ts]
        order = sorted(range(len(ts)), key=lambda i: ts[i].task_id)

        # What the fence phase decided, kept for the answer when the write fails.
        fenced: dict[str, Any] = {}

        async def run(conn: AsyncConnection, now: datetime) -> tuple[list[Any], set[str], set[str]]:
            fenced.clear()
            batch = _Batch(await self._load_fenced_many(conn, keys, lock=False), defer_writes=True)
            out: list[Any] = [None] * len(ts)
            for i in order:
                try:
                    out[i] = await ts[i].run(conn, now, batch)
                except RepositoryError as exc:
                    out[i] = exc
            assert batch.writes is not None
            deferred = {item[0] for items in batch.writes.values() for item in items}
            fenced.update(out=out, deferred=deferred)
            written: set[str] = set()
            if deferred:
                written = await self._write_deferred(conn, batch, now, strict=False)
            return out, deferred, written

        try:
            # Both statements on one connection, each its own transaction (no
            # BEGIN and COMMIT round trips; a retried run reads again).
            out, deferred, written = await self._tx(
                "transitions", run, autocommit=True, driver=True
            )
        except Unavailable as exc:
            if not fenced:
                return [exc] * len(ts)
            # The write's fate is unknown: so is every deferred transition's.
            return [
                exc if t.task_id in fenced["deferred"] else o
                for t, o in zip(ts, fenced["out"], strict=True)
            ]
        except Exception as exc:  # isolated below, one by one
            log.warning("repository.batch_isolated", size=len(ts), error=repr(exc))
            if not fenced:
                return [await self._outcome(t) for t in ts]
            # The write failed as a whole (one statement): nothing was written.
            out, deferred, written = fenced["out"], fenced["deferred"], set()
        for i, t in enumerate(ts):
            if t.task_id in deferred and t.task_id not in written:
                out[i] = await self._outcome(t)
        return out

    async def _load_fenced_many(
        self,
        conn: AsyncConnection,
        keys: Sequence[tuple[str, int, str]],
        *,
        lock: bool = True,
        lease_only: bool = False,
    ) -> dict[tuple[str, int, str], RowMapping]:
        """``_load`` for a batch: (task, attempt, caller's host) rows, locked in
        task id order unless ``lock`` is false, in one statement. A key with no
        row is left out (its transition loads it itself, to raise the precise
        error)."""
        if not keys:
            return {}
        rows = (
            (
                await conn.execute(
                    _prebuilt(
                        ("load_many", lock, lease_only),
                        functools.partial(_load_many_stmt, lock, lease_only),
                    ),
                    {
                        "k_task_id": [k[0] for k in keys],
                        "k_number": [k[1] for k in keys],
                        "k_host_id": [k[2] for k in keys],
                    },
                )
            )
            .mappings()
            .all()
        )
        return {(r["task_id"], r["a_number"], r["k_host_id"]): r for r in rows}

    async def _release_devices(
        self, conn: AsyncConnection, now: datetime, task_ids: Sequence[str]
    ) -> None:
        """Delete the reservations of ``task_ids`` and turn their devices idle if
        they were reported busy, in one statement that locks the device rows in
        (host, device) order."""
        await conn.execute(
            _prebuilt("release_devices", _release_devices_stmt),
            {"task_ids": list(task_ids), "now": now},
        )

    async def _outcome(self, t: Transition) -> Any:
        try:
            return await self.run_one(t)
        except RepositoryError as exc:
            return exc

    async def claim(self, session: Session, task_id: str, attempt: int) -> Claimed:
        """assigned -> dispatched, only by the owning host with its current session
        before the claim deadline. Generates the lease token (returned once), stores
        only its SHA-256, sets ack deadline and the session generation on the
        attempt. Concurrent claims: exactly one wins, the others get ``Conflict``."""
        result: Claimed = await self.run_one(self.claim_op(session, task_id, attempt))
        return result

    def claim_op(self, session: Session, task_id: str, attempt: int) -> Transition:
        """``claim`` as a :class:`Transition` (validated now, run later)."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> Claimed:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            self._fence_owner(row, session, attempt)
            return await self._claim_row(conn, row, session, now, batch)

        return Transition("claim", tid, attempt, session.host_id, run)

    async def _claim_row(
        self,
        conn: AsyncConnection,
        row: RowMapping,
        session: Session,
        now: datetime,
        batch: _Batch | None = None,
    ) -> Claimed:
        tid = row["task_id"]
        if row["status"] in TERMINAL_STATES:
            raise Gone("the task is terminal", reason="terminal", task_id=tid)
        if row["status"] != TaskState.ASSIGNED.value:
            raise Conflict(
                "the assignment is not claimable",
                reason="already_claimed" if row["status"] in _LEASED else "wrong_state",
                task_id=tid,
                state=row["status"],
            )
        if not row["a_claim_deadline"] > now:
            raise Gone("the claim deadline has passed", reason="deadline_passed", task_id=tid)
        token = new_token()
        ack_deadline = now + timedelta(seconds=self.timings.ack_s)
        await self._update_pair(
            conn,
            tid,
            row["attempt"],
            [TaskState.ASSIGNED.value],
            {"status": TaskState.DISPATCHED.value, "updated_at": now},
            {
                "lease_token_hash": hash_secret(token),
                "session_generation": session.generation,
                "claimed_at": now,
                "ack_deadline": ack_deadline,
                "lease_expires_at": ack_deadline,
            },
            batch,
        )
        return Claimed(
            task_id=tid,
            attempt=row["attempt"],
            host_id=row["a_host_id"],
            device_id=row["a_device_id"],
            lease_id=row["a_lease_id"],
            lease_token=token,
            kind=TaskKind(row["kind"]),
            payload=row["payload"],
            goal=row["goal"],
            workflow=row["workflow"],
            ack_deadline=ack_deadline,
            lease_s=self.timings.lease_s,
        )

    async def claim_next(
        self, session: Session, *, device_ids: Sequence[str] = ()
    ) -> Claimed | None:
        """Claim the oldest unexpired assigned attempt of this host (optionally only
        on the given devices), or None. SKIP LOCKED among candidates."""
        _check_session(session)
        if isinstance(device_ids, str) or not all(isinstance(d, str) for d in device_ids):
            raise Invalid("device_ids must be a sequence of strings", field="device_ids")
        wanted = list(device_ids)

        async def run(conn: AsyncConnection, now: datetime) -> Claimed | None:
            await self._check_session_row(conn, session)
            conds = [
                tasks.c.status == TaskState.ASSIGNED.value,
                attempts.c.host_id == session.host_id,
                attempts.c.claim_deadline > now,
            ]
            if wanted:
                conds.append(attempts.c.device_id.in_(wanted))
            row = (
                (
                    await conn.execute(
                        sa.select(*_FENCE_COLUMNS)
                        .select_from(
                            tasks.join(
                                attempts,
                                sa.and_(
                                    attempts.c.task_id == tasks.c.id,
                                    attempts.c.number == tasks.c.attempt,
                                ),
                            )
                        )
                        .where(*conds)
                        .order_by(attempts.c.assigned_at, tasks.c.seq)
                        .limit(1)
                        .with_for_update(of=[tasks, attempts], skip_locked=True)
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                return None
            return await self._claim_row(conn, row, session, now)

        return await self._tx("claim_next", run, driver=True)

    async def pending_assignments(
        self, host_id: str, *, device_ids: Sequence[str] = (), limit: int | None = None
    ) -> list[Assignment]:
        """Assigned (unclaimed, unexpired) attempts of a host (read only), oldest
        first; only those on ``device_ids`` when given; at most ``limit``."""
        _check_host_id(host_id)
        params = _pending_params(host_id, device_ids, limit)
        on_devices = "device_ids" in params

        async def run(conn: AsyncConnection, now: datetime) -> list[Assignment]:
            stmt = _prebuilt(("pending", on_devices), lambda: _pending_stmt(on_devices))
            rows = (await conn.execute(stmt, {**params, "now": now})).all()
            return [_assignment(r) for r in rows]

        return await self._tx("pending_assignments", run, autocommit=True, driver=True)

    async def session_pending(
        self, session: Session, *, device_ids: Sequence[str] = (), limit: int | None = None
    ) -> list[Assignment]:
        """``pending_assignments`` of the session's host, checking in the same
        statement that the session is current (``Unauthorized`` if not): one read
        per long-poll look instead of two."""
        _check_session(session)
        params = _pending_params(session.host_id, device_ids, limit)
        on_devices = "device_ids" in params

        async def run(conn: AsyncConnection, now: datetime) -> list[Assignment]:
            stmt = _prebuilt(
                ("session_pending", on_devices), lambda: _session_pending_stmt(on_devices)
            )
            rows = (await conn.execute(stmt, {**params, "now": now})).all()
            if not rows or not _session_ok(session, rows[0].session_generation, rows[0].revoked_at):
                raise _unauthorized(session)
            return [_assignment(r) for r in rows if r.id is not None]

        return await self._tx("session_pending", run, autocommit=True, driver=True)

    async def _assignments(
        self, conn: AsyncConnection, *conds: sa.ColumnElement[bool], limit: int | None = None
    ) -> list[Assignment]:
        rows = (await conn.execute(_assignments_select(*conds).limit(limit))).all()
        return [_assignment(r) for r in rows]

    async def ack(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """dispatched -> running before the ack deadline; starts the execution lease.
        Repeated ack of a running attempt returns the current status."""
        result: LeaseStatus = await self.run_one(
            self.ack_op(session, task_id, attempt, lease_token)
        )
        return result

    def ack_op(self, session: Session, task_id: str, attempt: int, lease_token: str) -> Transition:
        """``ack`` as a :class:`Transition`."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> LeaseStatus:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            self._fence_lease(row, session, attempt, lease_token)
            if row["status"] == TaskState.RUNNING.value:
                if not row["a_lease_expires_at"] > now:
                    raise Conflict("the lease has expired", reason="lease_expired", task_id=tid)
                return self._status(row, row["status"], row["a_lease_expires_at"])
            if not row["a_ack_deadline"] > now:
                raise Gone("the ack deadline has passed", reason="deadline_passed", task_id=tid)
            expires = now + timedelta(seconds=self.timings.lease_s)
            await self._update_pair(
                conn,
                tid,
                attempt,
                [TaskState.DISPATCHED.value],
                {"status": TaskState.RUNNING.value, "updated_at": now},
                {"acked_at": now, "lease_expires_at": expires},
                batch,
            )
            return self._status(row, TaskState.RUNNING.value, expires, moved=True)

        return Transition("ack", tid, attempt, session.host_id, run)

    async def renew(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """Extend the lease of a dispatched/running attempt (now + lease_s), same
        attempt and device; reports ``cancel_requested``. Expired, replaced or
        foreign lease: ``Conflict`` (or ``Gone`` when terminal) and nothing changes.
        In ``dispatched`` the deadline stays the ack deadline (see module doc)."""
        result = (
            await self.renew_many(
                [
                    Renewal(
                        session=session, task_id=task_id, attempt=attempt, lease_token=lease_token
                    )
                ]
            )
        )[0]
        if isinstance(result, Exception):
            raise result
        return result

    async def renew_many(self, renewals: Sequence[Renewal]) -> list[LeaseStatus | Exception]:
        """Many renewals at once; each entry gets its own outcome (an error for
        one never rolls back the others).

        The usual batch takes two statements in autocommit on the driver's
        connection (``_renew_unlocked``): an unlocked read that every renewal
        fences itself against, and one conditional write of the running leases
        it accepted. A renewal the read cannot decide (no such row) or whose row
        changed before the write runs again in a locked transaction
        (``_renew_locked``), which gives its precise answer."""
        if isinstance(renewals, str | bytes) or not isinstance(renewals, Sequence):
            raise Invalid("renewals must be a sequence of Renewal", field="renewals")
        checked: list[str | Exception] = []
        for r in renewals:
            try:
                if not isinstance(r, Renewal):
                    raise Invalid("renewals must be a sequence of Renewal", field="renewals")
                checked.append(
                    self._check_lease_args(r.session, r.task_id, r.attempt, r.lease_token)
                )
            except RepositoryError as exc:
                checked.append(exc)
        out: list[LeaseStatus | Exception | None] = [
            c if isinstance(c, Exception) else None for c in checked
        ]
        todo = [i for i, c in enumerate(checked) if isinstance(c, str)]
        if todo:
            await self._renew_unlocked(renewals, checked, todo, out)
        rest = [i for i in todo if out[i] is None]
        if rest:
            try:
                again = await self._renew_locked(
                    [renewals[i] for i in rest], [checked[i] for i in rest]
                )
            except Unavailable as exc:
                again = [exc] * len(rest)
            for i, o in zip(rest, again, strict=True):
                out[i] = o
        return [o if o is not None else RuntimeError("renewal without outcome") for o in out]

    async def _renew_unlocked(
        self,
        renewals: Sequence[Renewal],
        checked: Sequence[str | Exception],
        todo: Sequence[int],
        out: list[LeaseStatus | Exception | None],
    ) -> None:
        """Decide what the unlocked read can (see ``renew_many``), in ``out``.

        The read is a committed state: a refusal fenced against it is that
        renewal's answer, and so is a dispatched lease's unchanged deadline (no
        write). A running lease is extended by the write only if its rows are
        still as read: the attempt open, bound to the session generation read
        and not expired, the task running at that attempt (both rows locked, in
        task id order, as every batch locks them), and the host's session that
        generation and not revoked."""

        # What the read decided, kept when the write's fate is unknown.
        before_write: dict[int, LeaseStatus | Exception] = {}

        async def run(conn: Any, now: datetime) -> dict[int, LeaseStatus | Exception]:
            before_write.clear()
            rows = {
                (r["task_id"], r["a_number"], r["k_host_id"]): r
                for r in await conn.fetch(
                    _RENEW_READ_SQL,
                    [checked[i] for i in todo],
                    [renewals[i].attempt for i in todo],
                    [renewals[i].session.host_id for i in todo],
                )
            }
            decided: dict[int, LeaseStatus | Exception] = {}
            extend: dict[tuple[str, int], tuple[int, list[tuple[int, Any]]]] = {}
            for i in todo:
                r, tid = renewals[i], checked[i]
                assert isinstance(tid, str)
                row = rows.get((tid, r.attempt, r.session.host_id))
                if row is None:
                    continue  # the locked path decides (a wrong attempt or task)
                try:
                    deadline = self._fence_renewal(row, r, now)
                    if row["status"] == TaskState.RUNNING.value:
                        # Answered once written (the same lease twice: both).
                        extend.setdefault((tid, r.attempt), (r.session.generation, []))[1].append(
                            (i, row)
                        )
                    else:
                        decided[i] = self._status(row, row["status"], deadline)
                except RepositoryError as exc:
                    decided[i] = exc
            if not extend:
                return decided
            keys = sorted(extend)
            new_expiry = now + timedelta(seconds=self.timings.lease_s)
            before_write.update(decided)
            written = await self._extend_unlocked(
                conn, keys, [extend[k][0] for k in keys], now, new_expiry
            )
            for k in written:
                for i, row in extend[k][1]:
                    decided[i] = self._status(row, TaskState.RUNNING.value, new_expiry)
            return decided

        try:
            decided = await self._raw("renew", run)
        except Unavailable as exc:
            # Nothing is decided without the read; a refusal it gave stands; the
            # write's fate is unknown.
            decided = {i: before_write.get(i, exc) for i in todo}
        for i, o in decided.items():
            out[i] = o

    def _fence_renewal(self, row: Any, r: Renewal, now: datetime) -> datetime:
        """Fence a renewal against its rows (session, token, owner, attempt,
        state, deadline): its lease's current deadline, or the refusal raised."""
        if not _session_ok(r.session, row["host_generation"], row["host_revoked_at"]):
            raise _unauthorized(r.session)
        self._fence_lease(row, r.session, r.attempt, r.lease_token)
        deadline = self._deadline(row)
        if not deadline > now:
            raise Conflict("the lease has expired", reason="lease_expired", task_id=row["task_id"])
        return deadline

    async def _extend_unlocked(
        self,
        conn: Any,
        keys: Sequence[tuple[str, int]],
        generations: Sequence[int],
        now: datetime,
        new_expiry: datetime,
    ) -> list[tuple[str, int]]:
        """``_RENEW_WRITE_SQL``: the (task, attempt) leases it extended."""
        rows = await conn.fetch(
            _RENEW_WRITE_SQL,
            [k[0] for k in keys],
            [k[1] for k in keys],
            list(generations),
            now,
            new_expiry,
        )
        return [(r["task_id"], r["number"]) for r in rows]

    async def _renew_locked(
        self, renewals: Sequence[Renewal], checked: Sequence[str | Exception]
    ) -> list[LeaseStatus | Exception]:
        """Renewals in one locked transaction (``renew_many``'s slow path)."""

        async def run(conn: AsyncConnection, now: datetime) -> list[LeaseStatus | Exception]:
            keys = [
                (t, r.attempt, r.session.host_id)
                for t, r in zip(checked, renewals, strict=True)
                if isinstance(t, str)
            ]
            rows = await self._load_fenced_many(conn, sorted(set(keys)), lease_only=True)
            new_expiry = now + timedelta(seconds=self.timings.lease_s)
            out: list[LeaseStatus | Exception | None] = []
            extend: set[tuple[str, int]] = set()
            missing: list[int] = []
            for tid, r in zip(checked, renewals, strict=True):
                if isinstance(tid, Exception):
                    out.append(tid)
                    continue
                row = rows.get((tid, r.attempt, r.session.host_id))
                if row is None:
                    missing.append(len(out))
                    out.append(None)  # decided below (rare: a wrong attempt or task)
                    continue
                try:
                    deadline = self._fence_renewal(row, r, now)
                    if row["status"] == TaskState.RUNNING.value:
                        extend.add((tid, r.attempt))
                        deadline = new_expiry
                    out.append(self._status(row, row["status"], deadline))
                except RepositoryError as exc:
                    out.append(exc)
            if missing:
                await self._renewals_without_row(conn, renewals, checked, missing, out)
            if extend:
                ex = sorted(extend)
                await conn.execute(
                    _prebuilt("extend_leases", _extend_leases_stmt),
                    {
                        "r_task_id": [k[0] for k in ex],
                        "r_number": [k[1] for k in ex],
                        "p_exp": new_expiry,
                    },
                )
            return [o if o is not None else RuntimeError("renewal without outcome") for o in out]

        return await self._tx("renew", run, driver=True)

    async def check_holds(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """Read only: whether the session's host holds this lease now, fenced
        exactly as a renewal is (session, token, owner, attempt, state,
        deadline) and with the renewal's errors, but extending nothing. For the
        side channels that must take data only for a lease held now."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)
        r = Renewal(session=session, task_id=tid, attempt=attempt, lease_token=lease_token)

        async def run(conn: Any, now: datetime) -> LeaseStatus | None:
            rows = await conn.fetch(_RENEW_READ_SQL, [tid], [attempt], [session.host_id])
            if not rows:
                return None
            deadline = self._fence_renewal(rows[0], r, now)
            return self._status(rows[0], rows[0]["status"], deadline)

        status = await self._raw("check_holds", run)
        if status is not None:
            return status
        out: list[LeaseStatus | Exception | None] = [None]

        async def refusal(conn: AsyncConnection, now: datetime) -> None:
            await self._renewals_without_row(conn, [r], [tid], [0], out)

        await self._tx("check_holds", refusal)
        raise out[0] if isinstance(out[0], Exception) else Conflict("no such attempt")

    async def _renewals_without_row(
        self,
        conn: AsyncConnection,
        renewals: Sequence[Renewal],
        checked: Sequence[str | Exception],
        missing: Sequence[int],
        out: list[LeaseStatus | Exception | None],
    ) -> None:
        """Outcomes of renewals whose (task, attempt) has no row: ``Unauthorized``
        for a stale session, else ``NotFound`` (no such task) or ``Conflict``
        (no such attempt)."""
        host_ids = {renewals[i].session.host_id for i in missing}
        host_rows = {
            h.host_id: h
            for h in await conn.execute(
                sa.select(hosts.c.host_id, hosts.c.session_generation, hosts.c.revoked_at).where(
                    hosts.c.host_id == sa.any_(_arr(sorted(host_ids), sa.Text))
                )
            )
        }
        tids = sorted({str(checked[i]) for i in missing})
        known = {
            str(x)
            for x in (
                await conn.execute(
                    sa.select(tasks.c.id).where(tasks.c.id == sa.any_(_arr(tids, UUIDT)))
                )
            ).scalars()
        }
        for i in missing:
            r, tid = renewals[i], str(checked[i])
            h = host_rows.get(r.session.host_id)
            if h is None or not _session_ok(r.session, h.session_generation, h.revoked_at):
                out[i] = _unauthorized(r.session)
            elif tid not in known:
                out[i] = NotFound("no such task", task_id=tid)
            else:
                out[i] = Conflict("no such attempt", reason="unknown_attempt", task_id=tid)

    async def _load_many(
        self, conn: AsyncConnection, keys: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], RowMapping]:
        """Lock tasks and their referenced attempts for a batch, in task id order."""
        if not keys:
            return {}
        u = _unnest(
            "k",
            task_id=(UUIDT, [k[0] for k in keys]),
            number=(sa.Integer, [k[1] for k in keys]),
        )
        rows = (
            (
                await conn.execute(
                    sa.select(*_FENCE_COLUMNS)
                    .select_from(
                        u.join(
                            attempts,
                            sa.and_(
                                attempts.c.task_id == u.c.task_id,
                                attempts.c.number == u.c.number,
                            ),
                        ).join(tasks, tasks.c.id == attempts.c.task_id)
                    )
                    .order_by(tasks.c.id)
                    .with_for_update(of=[tasks, attempts])
                )
            )
            .mappings()
            .all()
        )
        return {(r["task_id"], r["a_number"]): r for r in rows}

    async def progress(
        self, session: Session, task_id: str, attempt: int, lease_token: str, seq: int
    ) -> LeaseStatus:
        """A progress report: counts as a renewal; ``progress_seq`` only grows (an
        older or equal seq is accepted as a renewal but does not move it back)."""
        result: LeaseStatus = await self.run_one(
            self.progress_op(session, task_id, attempt, lease_token, seq)
        )
        return result

    def progress_op(
        self, session: Session, task_id: str, attempt: int, lease_token: str, seq: int
    ) -> Transition:
        """``progress`` as a :class:`Transition`."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)
        _check_int(seq, "seq", 0, 2**63 - 1)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> LeaseStatus:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            self._fence_lease(row, session, attempt, lease_token)
            deadline = self._deadline(row)
            if not deadline > now:
                raise Conflict("the lease has expired", reason="lease_expired", task_id=tid)
            if seq > row["progress_seq"]:
                await conn.execute(tasks.update().where(tasks.c.id == tid).values(progress_seq=seq))
            if row["status"] == TaskState.RUNNING.value:
                deadline = now + timedelta(seconds=self.timings.lease_s)
                await conn.execute(
                    attempts.update()
                    .where(attempts.c.task_id == tid, attempts.c.number == attempt)
                    .values(lease_expires_at=deadline)
                )
            return self._status(row, row["status"], deadline)

        return Transition("progress", tid, attempt, session.host_id, run)

    # --- results -----------------------------------------------------------------
    async def report_result(
        self,
        session: Session,
        task_id: str,
        attempt: int,
        lease_token: str,
        *,
        outcome: Outcome,
        retryable: bool = False,
        reason: str = "",
        result: dict[str, Any] | None = None,
        fingerprint: str,
    ) -> ResultRecord:
        """Terminal report from the active lease: done / failed / cancelled; a
        retryable failure with attempts left goes to retrying (eligible_at = now +
        backoff). Releases the reservation. Replay with the same attempt and
        fingerprint returns the recorded outcome (``replayed=True``); a different
        fingerprint or a stale attempt is ``Conflict``."""
        record: ResultRecord = await self.run_one(
            self.report_result_op(
                session,
                task_id,
                attempt,
                lease_token,
                outcome=outcome,
                retryable=retryable,
                reason=reason,
                result=result,
                fingerprint=fingerprint,
            )
        )
        return record

    def report_result_op(
        self,
        session: Session,
        task_id: str,
        attempt: int,
        lease_token: str,
        *,
        outcome: Outcome,
        retryable: bool = False,
        reason: str = "",
        result: dict[str, Any] | None = None,
        fingerprint: str,
    ) -> Transition:
        """``report_result`` as a :class:`Transition`."""
        tid = self._check_lease_args(session, task_id, attempt, lease_token)
        try:
            out = Outcome(outcome)
        except ValueError:
            raise Invalid("outcome must be done, failed or cancelled", field="outcome") from None
        if not isinstance(retryable, bool):
            raise Invalid("retryable must be a boolean", field="retryable")
        _check_str(reason, "reason", max_len=4096, empty=True)
        res = None if result is None else _check_json_dict(result, "result")
        _check_str(fingerprint, "fingerprint", max_len=256)

        async def run(conn: AsyncConnection, now: datetime, batch: _Batch | None) -> ResultRecord:
            pre = batch.row(tid, attempt, session.host_id) if batch is not None else None
            row = await self._load(conn, session, tid, attempt, pre)
            if not matches(lease_token, row["a_token_hash"]):
                raise Conflict("lease token does not match", reason="wrong_lease", task_id=tid)
            if row["a_host_id"] != session.host_id:
                raise Forbidden("the attempt belongs to another host", task_id=tid)
            if row["result_attempt"] == attempt:
                return self._replay(row, fingerprint)
            self._fence_lease(row, session, attempt, lease_token)
            if not self._deadline(row) > now:
                raise Conflict("the lease has expired", reason="lease_expired", task_id=tid)
            return await self._record_result(
                conn, row, now, out, retryable, reason, res, fingerprint, batch
            )

        return Transition("report_result", tid, attempt, session.host_id, run)

    @staticmethod
    def _replay(row: RowMapping, fingerprint: str) -> ResultRecord:
        stored = row["result_fingerprint"] or ""
        if not secrets_equal(stored.encode(), fingerprint.encode()):
            raise Conflict(
                "a different result was recorded for this attempt",
                reason="fingerprint_mismatch",
                task_id=row["task_id"],
            )
        status = TaskState(row["status"])
        if status in TERMINAL_STATES and row["attempt"] == row["a_number"]:
            state, retry_at = status, None
        elif row["backoff_base_s"] <= 0:
            state, retry_at = TaskState.QUEUED, None
        else:
            state, retry_at = TaskState.RETRYING, row["eligible_at"]
        return ResultRecord(
            task_id=row["task_id"],
            attempt=row["a_number"],
            state=state,
            outcome=_OUTCOME_OF_END.get(row["a_end_reason"] or "", Outcome.FAILED),
            fingerprint=stored,
            replayed=True,
            retry_at=retry_at,
        )

    async def _record_result(
        self,
        conn: AsyncConnection,
        row: RowMapping,
        now: datetime,
        outcome: Outcome,
        retryable: bool,
        reason: str,
        result: dict[str, Any] | None,
        fingerprint: str,
        batch: _Batch | None = None,
    ) -> ResultRecord:
        tid = row["task_id"]
        eligible_at: datetime | None = None
        terminal_reason: str | None
        if outcome is Outcome.DONE:
            state, end, terminal_reason = TaskState.DONE, EndReason.DONE, reason or "done"
        elif outcome is Outcome.CANCELLED:
            state, end, terminal_reason = TaskState.CANCELLED, EndReason.CANCELLED, "cancelled"
        elif not retryable:
            state, end, terminal_reason = TaskState.FAILED, EndReason.FAILED, reason or "failed"
        else:
            end = EndReason.RETRYABLE_FAILURE
            state, eligible_at, terminal_reason = _after_failure(row, now, reason or "failed")
        values: dict[str, Any] = {
            "status": state.value,
            "result": result,
            "result_fingerprint": fingerprint,
            "result_attempt": row["attempt"],
            "terminal_reason": terminal_reason,
            "updated_at": now,
        }
        if eligible_at is not None:
            values["eligible_at"] = eligible_at
        if state in TERMINAL_STATES:
            values["finished_at"] = now
        await self._update_pair(
            conn,
            tid,
            row["attempt"],
            _LEASED,
            values,
            {"ended_at": now, "end_reason": end.value},
            batch,
        )
        # The device is free again, and the host said so by reporting: a "busy" it
        # reported while the attempt ran turns idle in the same statement, so the
        # next assignment need not wait for the host's next heartbeat. (An expiry
        # makes it busy, see _apply_endings: a host that went silent keeps its
        # devices out of use until it reports again or is no longer live.)
        if batch is not None:
            batch.free.append(tid)
        else:
            await self._release_devices(conn, now, [tid])
        return ResultRecord(
            task_id=tid,
            attempt=row["attempt"],
            state=state,
            outcome=outcome,
            fingerprint=fingerprint,
            replayed=False,
            retry_at=eligible_at if state is TaskState.RETRYING else None,
        )

    # --- cancellation ----------------------------------------------------------------
    async def request_cancel(self, task_id: str, user: User) -> CancelRecord:
        """Authorized (owner, project admin, platform admin; else ``Forbidden`` and
        nothing written). queued/retrying -> cancelled at once; in flight -> durable
        intent on the task and its current attempt; repeated requests return the
        first intent; terminal tasks return their state unchanged."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> CancelRecord:
            row = (
                await conn.execute(
                    sa.select(
                        tasks.c.status,
                        tasks.c.attempt,
                        tasks.c.owner,
                        tasks.c.project,
                        tasks.c.cancel_requested_at,
                        tasks.c.cancel_requested_by,
                    )
                    .where(tasks.c.id == tid)
                    .with_for_update()
                )
            ).first()
            if row is None:
                raise NotFound("no such task", task_id=tid)
            if not await self._may_access(conn, user, row.owner, row.project):
                raise Forbidden("not allowed to cancel this task", task_id=tid)
            status = TaskState(row.status)
            if row.cancel_requested_at is not None or status in TERMINAL_STATES:
                return CancelRecord(
                    task_id=tid,
                    state=status,
                    requested_at=row.cancel_requested_at or now,
                    requested_by=row.cancel_requested_by or user.name,
                    completed=status in TERMINAL_STATES,
                )
            intent = {"cancel_requested_at": now, "cancel_requested_by": user.name}
            if status in WAITING_STATES:
                await conn.execute(
                    tasks.update()
                    .where(tasks.c.id == tid, tasks.c.status == status.value)
                    .values(
                        status=TaskState.CANCELLED.value,
                        terminal_reason="cancelled",
                        finished_at=now,
                        updated_at=now,
                        **intent,
                    )
                )
                return CancelRecord(
                    task_id=tid,
                    state=TaskState.CANCELLED,
                    requested_at=now,
                    requested_by=user.name,
                    completed=True,
                )
            await self._update_pair(
                conn,
                tid,
                row.attempt,
                [status.value],
                {**intent, "updated_at": now},
                {"cancel_requested_at": now},
            )
            return CancelRecord(
                task_id=tid,
                state=status,
                requested_at=now,
                requested_by=user.name,
                completed=False,
            )

        return await self._tx("request_cancel", run)

    # --- expiry ------------------------------------------------------------------------
    async def expire_due(self, *, limit: int = 500) -> list[Expired]:
        """Attempts whose claim, ack or lease deadline passed: retrying with capped
        exponential backoff (queued at once if base is 0), failed ``lease_expired``
        at the limit, cancelled when a cancel is pending. Reservation released,
        attempt kept with its end reason."""
        _check_int(limit, "limit", 1, 100_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[Expired]:
            due = sa.or_(
                sa.and_(
                    tasks.c.status == TaskState.ASSIGNED.value, attempts.c.claim_deadline <= now
                ),
                sa.and_(tasks.c.status.in_(_LEASED), attempts.c.lease_expires_at <= now),
            )
            # Locking the attempt too makes the deadline recheck see a renewal that
            # committed after our snapshot.
            rows = (
                (
                    await conn.execute(
                        sa.select(*_FENCE_COLUMNS)
                        .select_from(
                            tasks.join(
                                attempts,
                                sa.and_(
                                    attempts.c.task_id == tasks.c.id,
                                    attempts.c.number == tasks.c.attempt,
                                ),
                            )
                        )
                        .where(due)
                        .order_by(tasks.c.id)
                        .limit(limit)
                        .with_for_update(of=[tasks, attempts], skip_locked=True)
                    )
                )
                .mappings()
                .all()
            )
            endings = [
                self._ending(r, now, _EXPIRY_REASON[r["status"]], "lease_expired") for r in rows
            ]
            await self._apply_endings(conn, now, endings, hold_devices=True)
            if endings:
                log.info("attempts.expired", count=len(endings))
            return [e.expired() for e in endings]

        return await self._tx("expire_due", run)

    @staticmethod
    def _ending(row: RowMapping, now: datetime, reason: EndReason, terminal_reason: str) -> _Ending:
        state, eligible_at, term = _after_failure(row, now, terminal_reason)
        return _Ending(
            task_id=row["task_id"],
            attempt=row["attempt"],
            host_id=row["a_host_id"],
            device_id=row["a_device_id"],
            old_state=row["status"],
            reason=reason,
            new_state=state,
            eligible_at=eligible_at,
            terminal_reason=term,
        )

    async def _apply_endings(
        self,
        conn: AsyncConnection,
        now: datetime,
        endings: Sequence[_Ending],
        *,
        reconcile_outcome: str | None = None,
        hold_devices: bool = False,
    ) -> None:
        """End a batch of locked active attempts: task state (compare-and-set on the
        old state and attempt), attempt end, reservation release: three statements.
        ``hold_devices`` (expiries): see below."""
        if not endings:
            return
        TS = sa.DateTime(timezone=True)
        r = _unnest(
            "r",
            id=(UUIDT, [e.task_id for e in endings]),
            old_status=(sa.Text, [e.old_state for e in endings]),
            number=(sa.Integer, [e.attempt for e in endings]),
            status=(sa.Text, [e.new_state.value for e in endings]),
            eligible_at=(TS, [e.eligible_at for e in endings]),
            terminal_reason=(sa.Text, [e.terminal_reason for e in endings]),
            finished_at=(TS, [now if e.new_state in TERMINAL_STATES else None for e in endings]),
            end_reason=(sa.Text, [e.reason.value for e in endings]),
        )
        values: dict[str, Any] = {
            "status": r.c.status,
            "eligible_at": sa.func.coalesce(r.c.eligible_at, tasks.c.eligible_at),
            "terminal_reason": r.c.terminal_reason,
            "finished_at": r.c.finished_at,
            "updated_at": now,
        }
        if reconcile_outcome is not None:
            values["reconcile_outcome"] = reconcile_outcome
            values["reconciled_at"] = now
        updated = await conn.execute(
            tasks.update()
            .where(
                tasks.c.id == r.c.id,
                tasks.c.status == r.c.old_status,
                tasks.c.attempt == r.c.number,
            )
            .values(**values)
        )
        if updated.rowcount != len(endings):
            raise Conflict("tasks changed underneath", reason="cas_failed")
        await conn.execute(
            attempts.update()
            .where(
                attempts.c.task_id == r.c.id,
                attempts.c.number == r.c.number,
                attempts.c.ended_at.is_(None),
            )
            .values(ended_at=now, end_reason=r.c.end_reason)
        )
        await conn.execute(
            device_reservations.delete().where(
                device_reservations.c.task_id == sa.any_(_arr([e.task_id for e in endings], UUIDT))
            )
        )
        # An expiry: a host that claimed the device and then fell silent may
        # still be running on it, so the device stays out of use, as "busy", until
        # its host reports it again (its next heartbeat). Hosts do not report their
        # own leases' busy/idle flips; the reservation covered it until now. (A
        # reconcile is the host's own report that it no longer holds the attempt.)
        held = sorted({(e.host_id, e.device_id) for e in endings if e.old_state in _LEASED})
        if hold_devices and held:
            await conn.execute(
                _prebuilt("hold_devices", _hold_devices_stmt),
                {
                    "r_host_id": [h for h, _ in held],
                    "r_device_id": [d for _, d in held],
                    "now": now,
                },
            )

    async def next_deadline(self) -> datetime | None:
        """The earliest claim/ack/lease deadline of any active attempt, or the
        earliest ``eligible_at`` of a retrying task, or None."""

        async def run(conn: AsyncConnection, now: datetime) -> datetime | None:
            deadline = sa.case(
                (tasks.c.status == TaskState.ASSIGNED.value, attempts.c.claim_deadline),
                else_=attempts.c.lease_expires_at,
            )
            active = (
                sa.select(sa.func.min(deadline))
                .select_from(
                    tasks.join(
                        attempts,
                        sa.and_(
                            attempts.c.task_id == tasks.c.id, attempts.c.number == tasks.c.attempt
                        ),
                    )
                )
                .where(tasks.c.status.in_(_ACTIVE))
                .scalar_subquery()
            )
            retry = (
                sa.select(sa.func.min(tasks.c.eligible_at))
                .where(tasks.c.status == TaskState.RETRYING.value)
                .scalar_subquery()
            )
            value = (await conn.execute(sa.select(sa.func.least(active, retry)))).scalar()
            return value

        return await self._tx("next_deadline", run)

    async def active_attempts(self, host_id: str | None = None) -> list[Assignment]:
        """Every active attempt (for rebuilding Lease actors after a restart)."""
        conds: list[sa.ColumnElement[bool]] = [tasks.c.status.in_(_ACTIVE)]
        if host_id is not None:
            _check_host_id(host_id)
            conds.append(attempts.c.host_id == host_id)
        return await self._tx(
            "active_attempts", lambda conn, now: self._assignments(conn, *conds), autocommit=True
        )

    # --- hosts -----------------------------------------------------------------
    async def add_host(self, host_id: str) -> str:
        """Create a host; returns its raw credential once (only the hash stored).
        ``Conflict`` if it exists (unless revoked: then re-issued, and every older
        session generation stays dead)."""
        _check_host_id(host_id)
        credential = new_token()

        async def run(conn: AsyncConnection, now: datetime) -> str:
            ins = pg_insert(hosts).values(
                host_id=host_id, credential_hash=hash_secret(credential), created_at=now
            )
            stmt = ins.on_conflict_do_update(
                index_elements=[hosts.c.host_id],
                set_={
                    "credential_hash": ins.excluded.credential_hash,
                    "revoked_at": None,
                    "last_seen": None,
                    "session_generation": hosts.c.session_generation + 1,
                },
                where=hosts.c.revoked_at.is_not(None),
            ).returning(hosts.c.host_id)
            if (await conn.execute(stmt)).first() is None:
                raise Conflict("host exists", reason="exists", host_id=host_id)
            return credential

        return await self._tx("add_host", run)

    async def revoke_host(self, host_id: str) -> list[Expired]:
        """Revoke the credential and every session; active attempts of the host end
        (retry policy, end reason ``host_revoked``) and their reservations are
        released. Revoking a revoked host changes nothing and returns []."""
        _check_host_id(host_id)

        async def run(conn: AsyncConnection, now: datetime) -> list[Expired]:
            host = (
                await conn.execute(
                    sa.select(hosts.c.revoked_at)
                    .where(hosts.c.host_id == host_id)
                    .with_for_update()
                )
            ).first()
            if host is None:
                raise NotFound("no such host", host_id=host_id)
            if host.revoked_at is not None:
                return []
            await conn.execute(
                hosts.update().where(hosts.c.host_id == host_id).values(revoked_at=now)
            )
            rows = await self._lock_active_of_host(conn, host_id, _ACTIVE)
            endings = [self._ending(r, now, EndReason.HOST_REVOKED, "host_revoked") for r in rows]
            await self._apply_endings(conn, now, endings)
            log.info("host.revoked", host_id=host_id, ended=len(endings))
            return [e.expired() for e in endings]

        return await self._tx("revoke_host", run)

    async def _lock_active_of_host(
        self, conn: AsyncConnection, host_id: str, states: Sequence[str]
    ) -> Sequence[RowMapping]:
        return (
            (
                await conn.execute(
                    sa.select(*_FENCE_COLUMNS)
                    .select_from(
                        tasks.join(
                            attempts,
                            sa.and_(
                                attempts.c.task_id == tasks.c.id,
                                attempts.c.number == tasks.c.attempt,
                            ),
                        )
                    )
                    .where(attempts.c.host_id == host_id, tasks.c.status.in_(states))
                    .order_by(tasks.c.id)
                    .with_for_update(of=[tasks, attempts])
                )
            )
            .mappings()
            .all()
        )

    async def register_session(self, host_id: str, credential: str) -> Session:
        """Check the credential (constant time) and start generation n+1; every older
        generation is dead. ``Unauthorized`` for unknown host, wrong credential or
        revoked host (same message for all three)."""
        if not isinstance(host_id, str) or not isinstance(credential, str):
            raise Unauthorized("invalid host credentials")

        async def run(conn: AsyncConnection, now: datetime) -> Session:
            row = (
                await conn.execute(
                    sa.select(hosts.c.credential_hash, hosts.c.revoked_at)
                    .where(hosts.c.host_id == host_id)
                    .with_for_update()
                )
            ).first()
            ok = matches(credential, row.credential_hash if row else _DUMMY_HASH)
            if row is None or not ok or row.revoked_at is not None:
                raise Unauthorized("invalid host credentials")
            generation = (
                await conn.execute(
                    hosts.update()
                    .where(hosts.c.host_id == host_id)
                    .values(
                        session_generation=hosts.c.session_generation + 1,
                        session_started_at=now,
                        last_seen=now,
                    )
                    .returning(hosts.c.session_generation)
                )
            ).scalar_one()
            log.info("host.registered", host_id=host_id, generation=generation)
            return Session(host_id=host_id, generation=generation)

        return await self._tx("register_session", run)

    async def host_credential_hash(self, host_id: str) -> bytes | None:
        """The stored SHA-256 of the host's credential (None if unknown or revoked),
        read only: what a register proof is opened with (``transport.server``)."""
        if not isinstance(host_id, str):
            raise Invalid("host_id must be a string", field="host_id")

        async def run(conn: AsyncConnection, now: datetime) -> bytes | None:
            row = (
                await conn.execute(
                    sa.select(hosts.c.credential_hash, hosts.c.revoked_at).where(
                        hosts.c.host_id == host_id
                    )
                )
            ).first()
            if row is None or row.revoked_at is not None:
                return None
            return bytes(row.credential_hash)

        return await self._tx("host_credential_hash", run)

    async def current_generation(self, host_id: str) -> int | None:
        """The host's current session generation (None if unknown, revoked or never
        registered)."""
        if not isinstance(host_id, str):
            raise Invalid("host_id must be a string", field="host_id")

        async def run(conn: AsyncConnection, now: datetime) -> int | None:
            row = (
                await conn.execute(_prebuilt("host_row", _host_row_stmt), {"host_id": host_id})
            ).first()
            if row is None or row.revoked_at is not None or row.session_generation <= 0:
                return None
            return int(row.session_generation)

        return await self._tx("current_generation", run, autocommit=True, driver=True)

    async def heartbeat(
        self,
        session: Session,
        devices: Sequence[DeviceSnapshot],
        advert: HostAdvert | None = None,
    ) -> None:
        """Refresh last_seen and replace only this host's device records; with
        ``advert``, store what the host serves (see ``persistence.matching``)."""
        _check_session(session)
        snapshot = _check_devices(devices)
        try:
            advertised = None if advert is None else advert_params(session.host_id, advert)
        except ValueError as exc:
            raise Invalid(str(exc), field="workflows") from None

        async def run(conn: AsyncConnection, now: datetime) -> None:
            seen = (
                await conn.execute(
                    _prebuilt("host_seen", _host_seen_stmt),
                    {
                        "p_host_id": session.host_id,
                        "p_generation": session.generation,
                        "p_now": now,
                    },
                )
            ).first()
            if seen is None:
                raise _unauthorized(session)
            if advertised is not None:
                await conn.execute(_prebuilt("host_advert", advert_stmt), advertised)
            await self._replace_devices(conn, now, session.host_id, snapshot)

        await self._tx("heartbeat", run, driver=True)

    async def _replace_devices(
        self, conn: AsyncConnection, now: datetime, host_id: str, snapshot: list[DeviceSnapshot]
    ) -> None:
        # Device order, as every statement that locks several device rows uses.
        snapshot = sorted(snapshot, key=lambda d: d.device_id)
        ids = [d.device_id for d in snapshot]
        await conn.execute(
            _prebuilt("devices_gone", _devices_gone_stmt), {"p_host_id": host_id, "p_ids": ids}
        )
        if not snapshot:
            return
        # Unchanged rows are not rewritten: updated_at is the time of the last change.
        await conn.execute(
            _prebuilt("devices_upsert", _devices_upsert_stmt),
            {
                "p_host_id": host_id,
                "p_now": now,
                "r_device_id": ids,
                "r_state": [d.state for d in snapshot],
                "r_capabilities": [json.dumps(d.capabilities) for d in snapshot],
            },
        )

    async def reconcile(self, session: Session, entries: Sequence[JournalEntry]) -> ReconcileReport:
        """Confirm and rebind (to this generation) matching active attempts; verdict
        'discard' for stale/unknown/foreign/wrong-lease/terminal entries; active
        attempts of this host that the host did not report: cancel or retry policy,
        end reason ``reconcile_lost``. Records the outcome on each task.

        Only dispatched/running attempts can be lost (an assigned one was never
        claimed, so the host cannot have journaled it). A confirmed running attempt
        gets a fresh lease; a reported attempt whose deadline already passed is
        discarded (reason ``expired``) and ends as an expiry. Discarded entries
        write nothing."""
        _check_session(session)
        if isinstance(entries, str | bytes) or not isinstance(entries, Sequence):
            raise Invalid("entries must be a sequence of JournalEntry", field="entries")
        for e in entries:
            if not isinstance(e, JournalEntry):
                raise Invalid("entries must be a sequence of JournalEntry", field="entries")
            if isinstance(e.attempt, bool) or not isinstance(e.attempt, int):
                raise Invalid("attempt must be an integer", field="entries.attempt")
            if not isinstance(e.lease_token, str) or not isinstance(e.task_id, str):
                raise Invalid("entries must carry strings", field="entries")

        async def run(conn: AsyncConnection, now: datetime) -> ReconcileReport:
            refreshed = (
                await conn.execute(
                    hosts.update()
                    .where(
                        hosts.c.host_id == session.host_id,
                        hosts.c.session_generation == session.generation,
                        hosts.c.session_generation > 0,
                        hosts.c.revoked_at.is_(None),
                    )
                    .values(last_seen=now)
                    .returning(hosts.c.host_id)
                )
            ).first()
            if refreshed is None:
                raise _unauthorized(session)
            keys: list[tuple[str, int]] = []
            parsed: list[tuple[JournalEntry, str | None]] = []
            for e in entries:
                try:
                    tid: str | None = str(uuid.UUID(e.task_id))
                except ValueError:
                    tid = None
                if tid is not None and 1 <= e.attempt <= MAX_INT32:
                    keys.append((tid, e.attempt))
                else:
                    tid = None
                parsed.append((e, tid))
            active = await self._lock_active_of_host(conn, session.host_id, _LEASED)
            rows = await self._load_many(conn, sorted(set(keys)))
            lease_expiry = now + timedelta(seconds=self.timings.lease_s)
            verdicts: list[ReconcileVerdict] = []
            confirmed: dict[str, tuple[int, str]] = {}
            expired_rows: dict[str, RowMapping] = {}
            for e, tid in parsed:
                row = rows.get((tid, e.attempt)) if tid is not None else None
                reason = self._reconcile_reason(row, session, e, now)
                if reason == "expired" and row is not None:
                    expired_rows[row["task_id"]] = row
                if reason != "confirmed" or row is None:
                    verdicts.append(
                        ReconcileVerdict(
                            task_id=e.task_id, attempt=e.attempt, verdict="discard", reason=reason
                        )
                    )
                    continue
                expires = lease_expiry
                if row["status"] == TaskState.DISPATCHED.value:
                    expires = row["a_ack_deadline"]
                confirmed[row["task_id"]] = (e.attempt, row["status"])
                verdicts.append(
                    ReconcileVerdict(
                        task_id=e.task_id,
                        attempt=e.attempt,
                        verdict="confirmed",
                        reason="confirmed",
                        state=TaskState(row["status"]),
                        cancel_requested=row["cancel_requested_at"] is not None,
                        lease_expires_at=expires,
                    )
                )
            if confirmed:
                ids = sorted(confirmed)
                r = _unnest(
                    "r",
                    id=(UUIDT, ids),
                    number=(sa.Integer, [confirmed[i][0] for i in ids]),
                )
                await conn.execute(
                    attempts.update()
                    .where(attempts.c.task_id == r.c.id, attempts.c.number == r.c.number)
                    .values(
                        session_generation=session.generation,
                        lease_expires_at=sa.case(
                            (attempts.c.acked_at.is_(None), attempts.c.lease_expires_at),
                            else_=lease_expiry,
                        ),
                    )
                )
                await conn.execute(
                    tasks.update()
                    .where(tasks.c.id == sa.any_(_arr(ids, UUIDT)))
                    .values(reconcile_outcome="confirmed", reconciled_at=now)
                )
            lost = [
                self._ending(r, now, EndReason.RECONCILE_LOST, "reconcile_lost")
                for r in active
                if r["task_id"] not in confirmed and r["task_id"] not in expired_rows
            ]
            await self._apply_endings(conn, now, lost, reconcile_outcome="lost")
            late = [
                self._ending(r, now, _EXPIRY_REASON[r["status"]], "lease_expired")
                for r in expired_rows.values()
            ]
            await self._apply_endings(conn, now, late, reconcile_outcome="expired")
            log.info(
                "host.reconciled",
                host_id=session.host_id,
                generation=session.generation,
                confirmed=len(confirmed),
                discarded=len(verdicts) - len(confirmed),
                lost=len(lost) + len(late),
            )
            return ReconcileReport(
                generation=session.generation,
                verdicts=verdicts,
                lost=[x.expired() for x in (*lost, *late)],
            )

        return await self._tx("reconcile", run)

    @staticmethod
    def _reconcile_reason(
        row: RowMapping | None, session: Session, entry: JournalEntry, now: datetime
    ) -> str:
        if row is None:
            return "unknown"
        if row["a_host_id"] != session.host_id:
            return "foreign"
        if row["attempt"] != entry.attempt:
            return "stale_attempt"
        if not matches(entry.lease_token, row["a_token_hash"]):
            return "wrong_lease"
        if row["status"] in TERMINAL_STATES:
            return "terminal"
        if row["status"] not in _LEASED:
            return "not_active"
        if not Repository._deadline(row) > now:
            return "expired"
        return "confirmed"

    # --- users and projections -----------------------------------------------------
    async def add_user(self, name: str, *, platform_admin: bool = False) -> str:
        """Returns the raw user token once. ``Conflict`` if the name is taken."""
        _check_str(name, "name", max_len=128)
        if not isinstance(platform_admin, bool):
            raise Invalid("platform_admin must be a boolean", field="platform_admin")
        token = new_token()

        async def run(conn: AsyncConnection, now: datetime) -> str:
            inserted = (
                await conn.execute(
                    pg_insert(users)
                    .values(
                        name=name,
                        token_hash=hash_secret(token),
                        platform_admin=platform_admin,
                        created_at=now,
                    )
                    .on_conflict_do_nothing()
                    .returning(users.c.name)
                )
            ).first()
            if inserted is None:
                raise Conflict("user exists", reason="exists", name=name)
            return token

        return await self._tx("add_user", run)

    async def add_project(self, name: str, *, owner: str, admins: Sequence[str] = ()) -> None:
        """``Conflict`` if it exists; ``NotFound(field='owner'|'admins')`` for an
        unknown user."""
        _check_str(name, "name", max_len=128)
        _check_str(owner, "owner", max_len=128)
        if isinstance(admins, str) or not all(isinstance(a, str) for a in admins):
            raise Invalid("admins must be a sequence of user names", field="admins")
        admin_set = set(admins)

        async def run(conn: AsyncConnection, now: datetime) -> None:
            await self._require_names(conn, users, {owner}, "owner")
            await self._require_names(conn, users, admin_set, "admins")
            inserted = (
                await conn.execute(
                    pg_insert(projects)
                    .values(name=name, owner=owner, created_at=now)
                    .on_conflict_do_nothing()
                    .returning(projects.c.name)
                )
            ).first()
            if inserted is None:
                raise Conflict("project exists", reason="exists", name=name)
            if admin_set:
                await conn.execute(
                    project_admins.insert(),
                    [{"project": name, "user_name": a} for a in sorted(admin_set)],
                )

        await self._tx("add_project", run)

    async def authenticate_user(self, token: str) -> User:
        """``Unauthorized`` for an unknown token. The stored value is the SHA-256 of a
        256-bit random token, so looking it up by hash leaks nothing useful."""
        if not isinstance(token, str) or not token:
            raise Unauthorized("invalid user token")

        async def run(raw: Any, now: datetime) -> User:
            row = await raw.fetchrow(_USER_BY_TOKEN_SQL, hash_secret(token))
            if row is None:
                raise Unauthorized("invalid user token")
            return User(name=row["name"], platform_admin=row["platform_admin"])

        # Every user request starts here: one statement on the driver's
        # connection (no BEGIN/COMMIT, no SQLAlchemy execution: 28 against 174 us
        # of CPU per lookup).
        return await self._raw("authenticate_user", run)

    async def check_submit_role(self, user: User, project: str) -> None:
        """Submitting into a project needs a role on it (owner, project admin or
        platform admin): ``NotFound`` for an unknown project, ``Forbidden``
        without a role. One read; the submit itself re-checks the project."""
        if not isinstance(project, str) or not project:
            raise Invalid("project must be a non-empty string", field="project")

        async def run(raw: Any, now: datetime) -> Any:
            return await raw.fetchrow(_PROJECT_ROLE_SQL, project, user.name)

        # One statement on the driver's connection, as ``authenticate_user``.
        row = await self._raw("check_submit_role", run)
        if row is None:
            raise NotFound(f"no project {project!r}", field="project")
        if user.platform_admin or row["owner"] == user.name or row["is_admin"]:
            return
        raise Forbidden(f"you have no role on project {project!r}", field="project")

    @staticmethod
    def _visible(user: User) -> sa.ColumnElement[bool]:
        if user.platform_admin:
            return sa.true()
        return sa.or_(
            tasks.c.owner == user.name,
            tasks.c.project.in_(sa.select(projects.c.name).where(projects.c.owner == user.name)),
            tasks.c.project.in_(
                sa.select(project_admins.c.project).where(project_admins.c.user_name == user.name)
            ),
        )

    async def _may_access(
        self, conn: AsyncConnection, user: User, owner: str, project: str
    ) -> bool:
        if user.platform_admin or owner == user.name:
            return True
        role = (
            await conn.execute(
                sa.select(sa.literal(1))
                .select_from(projects)
                .where(
                    projects.c.name == project,
                    sa.or_(
                        projects.c.owner == user.name,
                        sa.exists().where(
                            project_admins.c.project == project,
                            project_admins.c.user_name == user.name,
                        ),
                    ),
                )
            )
        ).first()
        return role is not None

    async def _authorize_task(self, conn: AsyncConnection, task_id: str, user: User) -> RowMapping:
        row = (await conn.execute(sa.select(tasks).where(tasks.c.id == task_id))).mappings().first()
        if row is None:
            raise NotFound("no such task", task_id=task_id)
        if not await self._may_access(conn, user, row["owner"], row["project"]):
            raise Forbidden("not allowed to read this task", task_id=task_id)
        return row

    @staticmethod
    def _task_summary(row: RowMapping) -> dict[str, Any]:
        """The safe projection of a task row: no token hash, no session, no
        credential ever (the columns are picked here, one by one)."""
        return {
            "id": row["id"],
            "state": row["status"],
            "kind": row["kind"],
            "goal": row["goal"],
            "workflow": row["workflow"],
            "project": row["project"],
            "owner": row["owner"],
            "priority": row["priority"],
            "attempt": row["attempt"],
            "max_attempts": row["max_attempts"],
            "retry_at": (
                _iso(row["eligible_at"]) if row["status"] == TaskState.RETRYING.value else None
            ),
            "cancel": {
                "requested": row["cancel_requested_at"] is not None,
                "by": row["cancel_requested_by"],
                "at": _iso(row["cancel_requested_at"]),
            },
            "result": row["result"],
            "terminal_reason": row["terminal_reason"],
            "reconcile": {
                "outcome": row["reconcile_outcome"],
                "at": _iso(row["reconciled_at"]),
            },
            "created_at": _iso(row["created_at"]),
            "updated_at": _iso(row["updated_at"]),
            "finished_at": _iso(row["finished_at"]),
        }

    async def task_view(self, task_id: str, user: User) -> dict[str, Any]:
        """The safe projection of one task with its attempts (see ops JSON in the
        README). ``NotFound`` when missing, ``Forbidden`` without a role."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> dict[str, Any]:
            row = await self._authorize_task(conn, tid, user)
            view = self._task_summary(row)
            view["request_id"] = row["request_id"]
            history = (
                await conn.execute(
                    sa.select(
                        attempts.c.number,
                        attempts.c.host_id,
                        attempts.c.device_id,
                        attempts.c.lease_id,
                        attempts.c.assigned_at,
                        attempts.c.claimed_at,
                        attempts.c.acked_at,
                        attempts.c.lease_expires_at,
                        attempts.c.ended_at,
                        attempts.c.end_reason,
                    )
                    .where(attempts.c.task_id == tid)
                    .order_by(attempts.c.number)
                )
            ).all()
            view["attempts"] = [
                {
                    "number": a.number,
                    "host_id": a.host_id,
                    "device_id": a.device_id,
                    "lease_id": a.lease_id,
                    "assigned_at": _iso(a.assigned_at),
                    "claimed_at": _iso(a.claimed_at),
                    "acked_at": _iso(a.acked_at),
                    "started_at": _iso(a.claimed_at),
                    "lease_expires_at": _iso(a.lease_expires_at),
                    "ended_at": _iso(a.ended_at),
                    "end_reason": a.end_reason,
                }
                for a in history
            ]
            return view

        return await self._tx("task_view", run)

    async def readable_task_ids(self, user: User, task_ids: Sequence[str]) -> set[str]:
        """Which of ``task_ids`` the user may read (one read-only query; the same
        rule as ``list_tasks``). Ids that are not UUIDs are simply not readable."""
        _check_user(user)
        wanted: set[str] = set()
        for task_id in task_ids:
            try:
                wanted.add(str(uuid.UUID(str(task_id))))
            except ValueError:
                continue
        if not wanted:
            return set()
        if user.platform_admin:
            return wanted

        async def run(conn: AsyncConnection, now: datetime) -> set[str]:
            rows = await conn.execute(
                sa.select(tasks.c.id).where(tasks.c.id.in_(sorted(wanted)), self._visible(user))
            )
            return {str(r[0]) for r in rows}

        return await self._tx("readable_task_ids", run)

    async def list_tasks(
        self,
        user: User,
        *,
        states: Sequence[str] = (),
        host_id: str | None = None,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """Tasks the user may see, newest first; ``states`` filters by state and
        ``host_id`` by the host of the current attempt."""
        _check_user(user)
        if isinstance(states, str):
            states = [states]
        try:
            wanted = [TaskState(s).value for s in states]
        except ValueError:
            raise Invalid("unknown task state", field="states") from None
        if host_id is not None and not isinstance(host_id, str):
            raise Invalid("host_id must be a string", field="host_id")
        _check_int(limit, "limit", 1, 10_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            stmt = sa.select(tasks).where(self._visible(user))
            if wanted:
                stmt = stmt.where(tasks.c.status.in_(wanted))
            if host_id is not None:
                stmt = stmt.where(
                    sa.exists().where(
                        attempts.c.task_id == tasks.c.id,
                        attempts.c.number == tasks.c.attempt,
                        attempts.c.host_id == host_id,
                    )
                )
            rows = (
                (await conn.execute(stmt.order_by(tasks.c.seq.desc()).limit(limit)))
                .mappings()
                .all()
            )
            return [self._task_summary(r) for r in rows]

        return await self._tx("list_tasks", run)

    async def list_hosts(self) -> list[dict[str, Any]]:
        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            count = (
                sa.select(sa.func.count())
                .where(devices.c.host_id == hosts.c.host_id)
                .scalar_subquery()
            )
            rows = (
                await conn.execute(
                    sa.select(
                        hosts.c.host_id,
                        hosts.c.last_seen,
                        hosts.c.session_generation,
                        hosts.c.revoked_at,
                        hosts.c.workflows,
                        hosts.c.goal_runner,
                        _live_host(now, self.timings.liveness_s).label("live"),
                        count.label("devices"),
                    ).order_by(hosts.c.host_id)
                )
            ).all()
            return [
                {
                    "host_id": r.host_id,
                    "live": bool(r.live),
                    "last_seen": _iso(r.last_seen),
                    "session_generation": r.session_generation,
                    "revoked": r.revoked_at is not None,
                    "devices": r.devices,
                    "workflows": r.workflows,
                    "goal_runner": r.goal_runner,
                }
                for r in rows
            ]

        return await self._tx("list_hosts", run)

    async def list_devices(self) -> list[dict[str, Any]]:
        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            rows = (
                await conn.execute(
                    sa.select(
                        devices.c.host_id,
                        devices.c.device_id,
                        devices.c.state,
                        devices.c.capabilities,
                        device_reservations.c.task_id,
                    )
                    .outerjoin(
                        device_reservations,
                        sa.and_(
                            device_reservations.c.host_id == devices.c.host_id,
                            device_reservations.c.device_id == devices.c.device_id,
                        ),
                    )
                    .order_by(devices.c.host_id, devices.c.device_id)
                )
            ).all()
            return [
                {
                    "host_id": r.host_id,
                    "device_id": r.device_id,
                    "state": r.state,
                    "capabilities": r.capabilities,
                    "task_id": r.task_id,
                }
                for r in rows
            ]

        return await self._tx("list_devices", run)

    # --- logs and artifacts (their own channels; never on the job path) -------------
    async def _own_attempt(
        self, conn: AsyncConnection, session: Session, task_id: str, attempt: int
    ) -> None:
        await self._check_session_row(conn, session)
        row = (
            await conn.execute(
                sa.select(attempts.c.host_id).where(
                    attempts.c.task_id == task_id, attempts.c.number == attempt
                )
            )
        ).first()
        if row is None:
            exists = (
                await conn.execute(sa.select(tasks.c.id).where(tasks.c.id == task_id))
            ).first()
            if exists is None:
                raise NotFound("no such task", task_id=task_id)
            raise NotFound("no such attempt", task_id=task_id, attempt=attempt)
        if row.host_id != session.host_id:
            raise Forbidden("the attempt belongs to another host", task_id=task_id)

    async def append_logs(
        self, session: Session, task_id: str, attempt: int, first_seq: int, lines: Sequence[str]
    ) -> int:
        """Store log lines of an attempt the host owns (any state: logs may trail the
        result). Duplicate (task, attempt, seq) lines are ignored (retries are safe).
        Returns the number of new lines. ``Forbidden`` for another host's attempt."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_int(first_seq, "first_seq", 0, 2**62)
        if isinstance(lines, str) or not isinstance(lines, Sequence) or len(lines) > 10_000:
            raise Invalid("lines must be a sequence of at most 10000 strings", field="lines")
        for line in lines:
            _check_str(line, "lines", max_len=65536, empty=True)

        async def run(conn: AsyncConnection, now: datetime) -> int:
            # Fenced even for an empty batch: a revoked or foreign host gets its error.
            await self._own_attempt(conn, session, tid, attempt)
            if not lines:
                return 0
            seqs = list(range(first_seq, first_seq + len(lines)))
            r = _unnest("r", seq=(sa.BigInteger, seqs), line=(sa.Text, list(lines)))
            inserted = await conn.execute(
                pg_insert(log_lines)
                .from_select(
                    ["task_id", "attempt", "seq", "ts", "line"],
                    sa.select(
                        sa.cast(sa.literal(tid), UUIDT),
                        sa.literal(attempt, sa.Integer),
                        r.c.seq,
                        sa.literal(now, sa.DateTime(timezone=True)),
                        r.c.line,
                    ),
                )
                .on_conflict_do_nothing()
                .returning(log_lines.c.id)
            )
            return len(inserted.all())

        return await self._tx("append_logs", run)

    async def read_logs(
        self, task_id: str, user: User, *, after_id: int = 0, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Lines in order (id, attempt, seq, ts, line), authorized like task_view."""
        tid = _check_task_id(task_id)
        _check_user(user)
        _check_int(after_id, "after_id", 0, 2**63 - 1)
        _check_int(limit, "limit", 1, 100_000)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            await self._authorize_task(conn, tid, user)
            rows = (
                await conn.execute(
                    sa.select(
                        log_lines.c.id,
                        log_lines.c.attempt,
                        log_lines.c.seq,
                        log_lines.c.ts,
                        log_lines.c.line,
                    )
                    .where(log_lines.c.task_id == tid, log_lines.c.id > after_id)
                    .order_by(log_lines.c.id)
                    .limit(limit)
                )
            ).all()
            return [
                {"id": r.id, "attempt": r.attempt, "seq": r.seq, "ts": _iso(r.ts), "line": r.line}
                for r in rows
            ]

        return await self._tx("read_logs", run)

    async def record_artifact(
        self,
        session: Session,
        task_id: str,
        attempt: int,
        *,
        name: str,
        size: int,
        sha256: str,
        object_name: str,
    ) -> None:
        """Record an uploaded artifact of an attempt the host owns. Recording the same
        (name, size, sha256) again is a no-op; a different one under the same name is
        ``Conflict``."""
        _check_session(session)
        tid = _check_task_id(task_id)
        _check_int(attempt, "attempt", 1, MAX_INT32)
        _check_str(name, "name", max_len=255)
        _check_int(size, "size", 0, 2**62)
        if not isinstance(sha256, str) or not SHA256_RE.match(sha256):
            raise Invalid("sha256 must be 64 lowercase hex digits", field="sha256")
        _check_str(object_name, "object_name", max_len=1024)

        async def run(conn: AsyncConnection, now: datetime) -> None:
            await self._own_attempt(conn, session, tid, attempt)
            inserted = (
                await conn.execute(
                    pg_insert(artifacts)
                    .values(
                        task_id=tid,
                        attempt=attempt,
                        name=name,
                        size=size,
                        sha256=sha256,
                        object_name=object_name,
                        created_at=now,
                    )
                    .on_conflict_do_nothing()
                    .returning(artifacts.c.name)
                )
            ).first()
            if inserted is not None:
                return
            existing = (
                await conn.execute(
                    sa.select(artifacts.c.size, artifacts.c.sha256).where(
                        artifacts.c.task_id == tid,
                        artifacts.c.attempt == attempt,
                        artifacts.c.name == name,
                    )
                )
            ).first()
            if existing is None or (existing.size, existing.sha256) != (size, sha256):
                raise Conflict("a different artifact has this name", reason="exists", name=name)

        await self._tx("record_artifact", run)

    async def list_artifacts(self, task_id: str, user: User) -> list[dict[str, Any]]:
        """[{attempt, name, size, sha256, object_name, created_at}], authorized like
        task_view. ``object_name`` is the control plane's object-store key."""
        tid = _check_task_id(task_id)
        _check_user(user)

        async def run(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
            await self._authorize_task(conn, tid, user)
            rows = (
                await conn.execute(
                    sa.select(
                        artifacts.c.attempt,
                        artifacts.c.name,
                        artifacts.c.size,
                        artifacts.c.sha256,
                        artifacts.c.object_name,
                        artifacts.c.created_at,
                    )
                    .where(artifacts.c.task_id == tid)
                    .order_by(artifacts.c.attempt, artifacts.c.name)
                )
            ).all()
            return [
                {
                    "attempt": r.attempt,
                    "name": r.name,
                    "size": r.size,
                    "sha256": r.sha256,
                    "object_name": r.object_name,
                    "created_at": _iso(r.created_at),
                }
                for r in rows
            ]

        return await self._tx("list_artifacts", run)


# --- statements built once (see ``_prebuilt``) --------------------------------------


def _assignment(r: Any) -> Assignment:
    return Assignment(
        task_id=r.id,
        attempt=r.number,
        host_id=r.host_id,
        device_id=r.device_id,
        lease_id=r.lease_id,
        claim_deadline=r.claim_deadline,
        project=r.project,
    )


def _load_stmt() -> Any:
    return (
        sa.select(
            *_FENCE_COLUMNS,
            hosts.c.session_generation.label("host_generation"),
            hosts.c.revoked_at.label("host_revoked_at"),
        )
        .select_from(
            tasks.join(
                attempts,
                sa.and_(
                    attempts.c.task_id == tasks.c.id,
                    attempts.c.number == sa.bindparam("attempt", type_=sa.Integer),
                ),
            ).outerjoin(hosts, hosts.c.host_id == sa.bindparam("host_id", type_=sa.Text))
        )
        .where(tasks.c.id == sa.bindparam("task_id", type_=UUIDT))
        .with_for_update(of=[tasks, attempts])
    )


def _load_many_stmt(lock: bool = True, lease_only: bool = False) -> Any:
    u = _unnest_params("k", task_id=UUIDT, number=sa.Integer, host_id=sa.Text)
    stmt = (
        sa.select(
            *(_LEASE_FENCE_COLUMNS if lease_only else _FENCE_COLUMNS),
            u.c.host_id.label("k_host_id"),
            hosts.c.session_generation.label("host_generation"),
            hosts.c.revoked_at.label("host_revoked_at"),
        )
        .select_from(
            u.join(
                attempts,
                sa.and_(attempts.c.task_id == u.c.task_id, attempts.c.number == u.c.number),
            )
            .join(tasks, tasks.c.id == attempts.c.task_id)
            .outerjoin(hosts, hosts.c.host_id == u.c.host_id)
        )
        .order_by(tasks.c.id)
    )
    return stmt.with_for_update(of=[tasks, attempts]) if lock else stmt


def _set_values(table: sa.Table, prefix: str, keys: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    return {
        k: sa.null() if is_none else sa.bindparam(f"{prefix}{k}", type_=table.c[k].type)
        for k, is_none in keys
    }


def _update_pair_stmt(
    from_states: tuple[str, ...],
    task_keys: tuple[tuple[str, bool], ...],
    attempt_keys: tuple[tuple[str, bool], ...],
) -> Any:
    attempt = sa.bindparam("p_attempt", type_=sa.Integer)
    t = (
        tasks.update()
        .where(
            tasks.c.id == sa.bindparam("p_task_id", type_=UUIDT),
            sa.or_(*[tasks.c.status == s for s in from_states]),
            tasks.c.attempt == attempt,
        )
        .values(_set_values(tasks, "t_", task_keys))
        .returning(tasks.c.id)
        .cte("t")
    )
    return (
        attempts.update()
        .where(
            attempts.c.task_id == t.c.id,
            attempts.c.number == attempt,
            attempts.c.ended_at.is_(None),
        )
        .values(_set_values(attempts, "a_", attempt_keys))
        .returning(attempts.c.number)
    )


def _update_pairs_cte(
    n: int,
    from_states: tuple[str, ...],
    task_keys: tuple[tuple[str, bool], ...],
    attempt_keys: tuple[tuple[str, bool], ...],
) -> tuple[Any, Any]:
    """``_update_pair_stmt`` for many rows of one shape, as the CTEs ``t<n>``
    (tasks written) and ``a<n>`` (their attempts written). The values come as
    arrays (``v<n>_task_id``, ``v<n>_attempt``, ``v<n>_generation``: the
    attempt's session generation as read, ``v<n>_t_<col>``, ``v<n>_a_<col>``;
    JSON columns as JSON text). A pair is written only if the attempt is still
    open and bound to that generation and the task still in one of
    ``from_states`` at that attempt, both rows locked (in task id order) before
    either is written."""

    def item_type(table: sa.Table, k: str) -> Any:
        typ = table.c[k].type
        return sa.Text if isinstance(typ, sa.JSON) else typ

    cols: dict[str, Any] = {"task_id": UUIDT, "attempt": sa.Integer, "generation": sa.BigInteger}
    cols.update({f"t_{k}": item_type(tasks, k) for k, is_none in task_keys if not is_none})
    cols.update({f"a_{k}": item_type(attempts, k) for k, is_none in attempt_keys if not is_none})
    v = _unnest_params(f"v{n}", **cols)

    def value(source: Any, table: sa.Table, prefix: str, k: str, is_none: bool) -> Any:
        """The new value of ``table.k``: SQL NULL, or the array element in
        ``source`` (JSON text cast back to JSON)."""
        if is_none:
            return sa.null()
        col, typ = source.c[f"{prefix}{k}"], table.c[k].type
        return sa.cast(col, typ) if isinstance(typ, sa.JSON) else col

    carried = [c for c in cols if c.startswith(("t_", "a_"))]
    locked = (
        sa.select(v.c.task_id, v.c.attempt, *[v.c[c] for c in carried])
        .select_from(
            v.join(
                attempts,
                sa.and_(attempts.c.task_id == v.c.task_id, attempts.c.number == v.c.attempt),
            ).join(tasks, tasks.c.id == v.c.task_id)
        )
        .where(
            attempts.c.ended_at.is_(None),
            attempts.c.session_generation.is_not_distinct_from(v.c.generation),
            sa.or_(*[tasks.c.status == s for s in from_states]),
            tasks.c.attempt == v.c.attempt,
        )
        # Task and attempt rows locked in task id order, as every batch locks them.
        .order_by(tasks.c.id)
        .with_for_update(of=[tasks, attempts])
        .cte(f"l{n}")
    )
    a_cols = [c for c in carried if c.startswith("a_")]
    t = (
        tasks.update()
        .where(
            tasks.c.id == locked.c.task_id,
            sa.or_(*[tasks.c.status == s for s in from_states]),
            tasks.c.attempt == locked.c.attempt,
        )
        .values({k: value(locked, tasks, "t_", k, null) for k, null in task_keys})
        # The attempt's values ride along, so the statement names the arrays once.
        .returning(tasks.c.id, locked.c.attempt, *[locked.c[c] for c in a_cols])
        .cte(f"t{n}")
    )
    a = (
        attempts.update()
        .where(
            attempts.c.task_id == t.c.id,
            attempts.c.number == t.c.attempt,
            attempts.c.ended_at.is_(None),
        )
        .values({k: value(t, attempts, "a_", k, null) for k, null in attempt_keys})
        .returning(attempts.c.task_id)
        .cte(f"a{n}")
    )
    return t, a


def _write_batch_stmt(shapes: tuple[Any, ...], release: bool) -> Any:
    """A batch's writes as one statement: per shape, the multi-row
    compare-and-set (``_update_pairs_cte``); with ``release``, the device release
    of ``_release_devices_stmt`` (``task_ids``, ``now``) for those of them
    written. Returns the id of each task written. Every data-modifying CTE runs
    whether or not the outer query reads it; they touch disjoint rows (each task
    at most once, reservations and devices apart from tasks and attempts).

    A task row written without its attempt row cannot happen (both rows are
    locked and checked first); should it, the statement fails (a text that
    is not a number cast to one) and writes nothing, rather than leave a pair
    half-written in autocommit."""
    pairs = [_update_pairs_cte(n, *shape) for n, shape in enumerate(shapes)]
    written = sa.union_all(*[sa.select(a.c.task_id) for _, a in pairs]).cte("written")
    tasks_written = sa.union_all(*[sa.select(t.c.id) for t, _ in pairs]).subquery()
    n_tasks = sa.select(sa.func.count()).select_from(tasks_written).scalar_subquery()
    n_pairs = sa.select(sa.func.count()).select_from(written).scalar_subquery()
    guard = sa.cast(
        sa.case(
            (n_tasks == n_pairs, sa.literal_column("'0'")),
            else_=sa.literal_column("'half-written compare-and-set: '") + sa.cast(n_tasks, sa.Text),
        ),
        sa.Integer,
    ).label("guard")
    # One row at least, so that the guard is evaluated when nothing was written.
    checked = sa.select(guard).cte("checked")
    out = sa.select(written.c.task_id, checked.c.guard).select_from(
        checked.outerjoin(written, sa.true())
    )
    if release:
        freed = (
            device_reservations.delete()
            .where(
                device_reservations.c.task_id == sa.any_(_arr_param("task_ids", UUIDT)),
                device_reservations.c.task_id.in_(sa.select(written.c.task_id)),
            )
            .returning(device_reservations.c.host_id, device_reservations.c.device_id)
            .cte("freed")
        )
        released = _set_device_state_stmt(freed, "busy", "idle").returning(devices.c.device_id)
        out = out.add_cte(released.cte("released"))
    return out


def _set_device_state_stmt(named: Any, from_state: str, to_state: str) -> Any:
    """The devices ``named`` (host_id, device_id columns) that are ``from_state``
    turn ``to_state``, rows locked in (host, device) order, as every statement
    that locks several device rows does (heartbeats, result batches)."""
    locked = (
        sa.select(devices.c.host_id, devices.c.device_id)
        .join(
            named,
            sa.and_(devices.c.host_id == named.c.host_id, devices.c.device_id == named.c.device_id),
        )
        .where(devices.c.state == from_state)
        .order_by(devices.c.host_id, devices.c.device_id)
        .with_for_update(of=devices)
        .cte("locked")
    )
    return (
        devices.update()
        .where(
            devices.c.host_id == locked.c.host_id,
            devices.c.device_id == locked.c.device_id,
            devices.c.state == from_state,
        )
        .values(state=to_state, updated_at=sa.bindparam("now", type_=devices.c.updated_at.type))
    )


def _hold_devices_stmt() -> Any:
    """Expired attempts' idle devices turn busy (see ``_apply_endings``)."""
    named = _unnest_params("r", host_id=sa.Text, device_id=sa.Text)
    return _set_device_state_stmt(named, "idle", "busy")


def _release_devices_stmt() -> Any:
    """Delete the reservations of ``task_ids``; their reported-busy devices turn idle."""
    freed = (
        device_reservations.delete()
        .where(device_reservations.c.task_id == sa.any_(_arr_param("task_ids", UUIDT)))
        .returning(device_reservations.c.host_id, device_reservations.c.device_id)
        .cte("freed")
    )
    return _set_device_state_stmt(freed, "busy", "idle")


def _pending_stmt(on_devices: bool) -> Any:
    conds = [
        tasks.c.status == TaskState.ASSIGNED.value,
        attempts.c.host_id == sa.bindparam("host_id", type_=sa.Text),
        attempts.c.claim_deadline > sa.bindparam("now", type_=attempts.c.claim_deadline.type),
    ]
    if on_devices:
        conds.append(attempts.c.device_id == sa.any_(_arr_param("device_ids", sa.Text)))
    return _assignments_select(*conds).limit(sa.bindparam("lim", type_=sa.Integer))


def _pending_params(host_id: str, device_ids: Sequence[str], limit: int | None) -> dict[str, Any]:
    """Checked parameters of ``_pending_stmt`` (``device_ids`` only when given)."""
    if isinstance(device_ids, str) or not all(isinstance(d, str) for d in device_ids):
        raise Invalid("device_ids must be a sequence of strings", field="device_ids")
    if limit is not None:
        _check_int(limit, "limit", 1, 100_000)
    params: dict[str, Any] = {"host_id": host_id, "lim": limit}
    if device_ids:
        params["device_ids"] = list(device_ids)
    return params


def _session_pending_stmt(on_devices: bool) -> Any:
    """The host's session row with its pending assignments (``_pending_stmt``)
    beside it: one row with NULL assignment columns when none is pending, no row
    for an unknown host."""
    p = _pending_stmt(on_devices).lateral("p")
    return (
        sa.select(
            hosts.c.session_generation,
            hosts.c.revoked_at,
            p.c.id,
            p.c.project,
            p.c.number,
            p.c.host_id.label("host_id"),
            p.c.device_id,
            p.c.lease_id,
            p.c.claim_deadline,
        )
        .select_from(hosts.outerjoin(p, sa.true()))
        .where(hosts.c.host_id == sa.bindparam("host_id", type_=sa.Text))
        .order_by(p.c.claim_deadline)
    )


def _assignments_select(*conds: sa.ColumnElement[bool]) -> Any:
    """Current attempts with their task, oldest assignment first."""
    return (
        sa.select(
            tasks.c.id,
            tasks.c.project,
            attempts.c.number,
            attempts.c.host_id,
            attempts.c.device_id,
            attempts.c.lease_id,
            attempts.c.claim_deadline,
        )
        .join(
            attempts,
            sa.and_(attempts.c.task_id == tasks.c.id, attempts.c.number == tasks.c.attempt),
        )
        .where(*conds)
        .order_by(attempts.c.assigned_at, tasks.c.seq)
    )


def _host_row_stmt() -> Any:
    return sa.select(hosts.c.session_generation, hosts.c.revoked_at).where(
        hosts.c.host_id == sa.bindparam("host_id", type_=sa.Text)
    )


def _host_seen_stmt() -> Any:
    return (
        hosts.update()
        .where(
            hosts.c.host_id == sa.bindparam("p_host_id", type_=sa.Text),
            hosts.c.session_generation == sa.bindparam("p_generation", type_=sa.Integer),
            hosts.c.session_generation > 0,
            hosts.c.revoked_at.is_(None),
        )
        .values(last_seen=sa.bindparam("p_now", type_=hosts.c.last_seen.type))
        .returning(hosts.c.host_id)
    )


def _devices_gone_stmt() -> Any:
    return devices.delete().where(
        devices.c.host_id == sa.bindparam("p_host_id", type_=sa.Text),
        devices.c.device_id != sa.all_(_arr_param("p_ids", sa.Text)),
    )


def _devices_upsert_stmt() -> Any:
    r = _unnest_params("r", device_id=sa.Text, state=sa.Text, capabilities=sa.Text)
    stmt = pg_insert(devices).from_select(
        ["host_id", "device_id", "state", "capabilities", "updated_at"],
        sa.select(
            sa.bindparam("p_host_id", type_=sa.Text),
            r.c.device_id,
            r.c.state,
            sa.cast(r.c.capabilities, devices.c.capabilities.type),
            sa.bindparam("p_now", type_=devices.c.updated_at.type),
        ),
    )
    return stmt.on_conflict_do_update(
        index_elements=[devices.c.host_id, devices.c.device_id],
        set_={
            "state": stmt.excluded.state,
            "capabilities": stmt.excluded.capabilities,
            "updated_at": stmt.excluded.updated_at,
        },
        where=sa.or_(
            devices.c.state != stmt.excluded.state,
            devices.c.capabilities != stmt.excluded.capabilities,
        ),
    )


def _free_devices_sub(*, caps_text: bool = False) -> Any:
    """Idle devices of live hosts without a reservation (params ``live_after``);
    with ``caps_text`` the capabilities come as JSON text (see ``_FreeDevice``)."""
    reserved = sa.exists().where(
        device_reservations.c.host_id == devices.c.host_id,
        device_reservations.c.device_id == devices.c.device_id,
    )
    caps: Any = devices.c.capabilities
    if caps_text:
        caps = sa.cast(devices.c.capabilities, sa.Text).label("caps")
    return (
        sa.select(devices.c.host_id, devices.c.device_id, caps, hosts.c.workflows)
        .join(hosts, hosts.c.host_id == devices.c.host_id)
        .where(
            devices.c.state == "idle",
            hosts.c.revoked_at.is_(None),
            hosts.c.session_generation > 0,
            hosts.c.last_seen > sa.bindparam("live_after", type_=hosts.c.last_seen.type),
            ~reserved,
        )
    )


#: The user of a token hash (``authenticate_user``, on the driver's connection).
_USER_BY_TOKEN_SQL = "SELECT name, platform_admin FROM users WHERE token_hash = $1"

#: The submitting user's role on a project ($1 the project, $2 the user).
_PROJECT_ROLE_SQL = """
SELECT p.owner,
       EXISTS (SELECT 1 FROM project_admins a
               WHERE a.project = p.name AND a.user_name = $2) AS is_admin
FROM projects p
WHERE p.name = $1
"""

#: ``_renew_unlocked``'s read: each renewal's task, attempt and host rows (the
#: columns of ``_LEASE_FENCE_COLUMNS``), unlocked. Hand-written SQL: it runs on
#: the driver's connection, as asyncpg's own prepared statement.
_RENEW_READ_SQL = """
SELECT t.id::text AS task_id, t.status, t.attempt, t.cancel_requested_at,
       a.number AS a_number, a.host_id AS a_host_id, a.lease_token_hash AS a_token_hash,
       a.session_generation AS a_generation, a.ack_deadline AS a_ack_deadline,
       a.lease_expires_at AS a_lease_expires_at,
       k.host_id AS k_host_id, h.session_generation AS host_generation,
       h.revoked_at AS host_revoked_at
FROM unnest($1::uuid[], $2::integer[], $3::text[]) AS k (task_id, number, host_id)
JOIN attempts a ON a.task_id = k.task_id AND a.number = k.number
JOIN tasks t ON t.id = a.task_id
LEFT JOIN hosts h ON h.host_id = k.host_id
"""

#: ``_renew_unlocked``'s write: the leases ($1 task ids, $2 attempt numbers, $3
#: session generations as read) extended to $5, each only if still as read at
#: $4: attempt open, bound to that generation, not expired; task running at
#: that attempt (task and attempt rows locked in task id order, as every batch
#: locks them); the host's session that generation and not revoked.
_RENEW_WRITE_SQL = """
WITH l AS (
    SELECT a.task_id, a.number
    FROM unnest($1::uuid[], $2::integer[], $3::integer[]) AS v (task_id, number, generation)
    JOIN attempts a ON a.task_id = v.task_id AND a.number = v.number
    JOIN tasks t ON t.id = v.task_id
    JOIN hosts h ON h.host_id = a.host_id
    WHERE a.ended_at IS NULL
      AND a.session_generation = v.generation
      AND a.lease_expires_at > $4
      AND t.status = 'running'
      AND t.attempt = v.number
      AND h.session_generation = v.generation
      AND h.revoked_at IS NULL
    ORDER BY t.id
    FOR UPDATE OF t, a
)
UPDATE attempts a SET lease_expires_at = $5
FROM l
WHERE a.task_id = l.task_id AND a.number = l.number
RETURNING a.task_id::text AS task_id, a.number
"""


def _extend_leases_stmt() -> Any:
    r = _unnest_params("r", task_id=UUIDT, number=sa.Integer)
    return (
        attempts.update()
        .where(
            attempts.c.task_id == r.c.task_id,
            attempts.c.number == r.c.number,
            attempts.c.ended_at.is_(None),
        )
        .values(lease_expires_at=sa.bindparam("p_exp", type_=attempts.c.lease_expires_at.type))
    )


def _free_if_waiting_stmt() -> Any:
    """``_free_devices_stmt``, empty at once when no task is waiting (eligible
    now): PostgreSQL evaluates the uncorrelated EXISTS first, with the partial
    index on waiting tasks, and then skips reading the devices."""
    waiting = sa.exists().where(
        sa.text("tasks.status IN ('queued', 'retrying')"),
        tasks.c.eligible_at <= sa.bindparam("now", type_=tasks.c.eligible_at.type),
    )
    return (
        _free_devices_sub(caps_text=True)
        .where(waiting)
        .order_by(devices.c.host_id, devices.c.device_id)
    )


def _free_devices_stmt() -> Any:
    """The free devices for matching in Python, capabilities as JSON text decoded
    once per distinct text (``_FreeDevice.load``): a fleet's devices share a few
    capability sets, and decoding every row's JSONB was most of an assignment's
    CPU with thousands of free devices."""
    return _free_devices_sub(caps_text=True).order_by(devices.c.host_id, devices.c.device_id)


@dataclass(frozen=True, slots=True)
class _FreeDevice:
    host_id: str
    device_id: str
    capabilities: dict[str, Any]
    workflows: list[str] | None = None

    @staticmethod
    def load(rows: Sequence[Any]) -> list[_FreeDevice]:
        decoded: dict[str, dict[str, Any]] = {}
        out = []
        for r in rows:
            caps = decoded.get(r.caps)
            if caps is None:
                caps = decoded[r.caps] = json.loads(r.caps) if r.caps else {}
            out.append(_FreeDevice(r.host_id, r.device_id, caps, r.workflows))
        return out


def _rank_candidates_stmt() -> Any:
    """The first ``scan`` waiting tasks that match some free device, fair across
    projects (round-robin by project, priority then FIFO within one), as ids in
    rank order; nothing locked.

    Only the first few waiting tasks of each project can rank within the first
    n: a short scan of ix_tasks_waiting_project per project (the literal state
    list lets PostgreSQL use the partial index), each scanned task checked
    against the free devices, instead of ranking every waiting task on each
    assignment. The slack (``scan`` = 2n + excluded) covers tasks this
    transaction already holds and those other assigners have locked."""
    now = sa.bindparam("now", type_=tasks.c.eligible_at.type)
    # The distinct capability sets of the free devices, computed once for the
    # statement: each scanned task is checked against those few sets. Checked
    # against the free devices themselves, each task's EXISTS walked the
    # reserved devices (an anti-join probe each) before finding a free one: with
    # 10,000 devices mostly reserved, one ranking ran for seconds.
    free_caps = (
        _free_devices_sub()
        .with_only_columns(devices.c.capabilities, hosts.c.workflows)
        .distinct()
        .cte("free_caps")
        .prefix_with("MATERIALIZED")
    )
    top = (
        sa.select(tasks.c.id, tasks.c.priority, tasks.c.seq)
        .where(
            tasks.c.project == projects.c.name,
            sa.text("tasks.status IN ('queued', 'retrying')"),
            tasks.c.eligible_at <= now,
            sa.exists().where(
                free_caps.c.capabilities.contains(tasks.c.selector),
                serves_workflow(tasks.c.workflow, free_caps.c.workflows),
            ),
        )
        .order_by(tasks.c.priority.desc(), tasks.c.seq)
        .limit(sa.bindparam("scan", type_=sa.Integer))
        .lateral("top")
    )
    rn = (
        sa.func.row_number()
        .over(partition_by=projects.c.name, order_by=(top.c.priority.desc(), top.c.seq))
        .label("rn")
    )
    ranked = (
        sa.select(top.c.id, top.c.priority, top.c.seq, rn)
        .select_from(projects.join(top, sa.true()))
        .subquery("ranked")
    )
    # No overall limit: every project's first ``scan`` stay candidates, so that
    # concurrent assigners skipping each other's locked tasks still find enough.
    return sa.select(ranked.c.id).order_by(ranked.c.rn, ranked.c.priority.desc(), ranked.c.seq)


def _lock_candidates_stmt() -> Any:
    """The first ``n`` of the ranked tasks ``ids`` that are still waiting, locked
    (SKIP LOCKED: a task another assigner holds drops out). The WHERE is
    rechecked on the locked row, so a task another assigner took meanwhile drops
    out too."""
    ids = _arr_param("ids", UUIDT)
    return (
        sa.select(
            tasks.c.id,
            tasks.c.status,
            tasks.c.attempt,
            tasks.c.selector,
            tasks.c.project,
            tasks.c.workflow,
        )
        .where(
            tasks.c.id == sa.any_(ids),
            sa.or_(*[tasks.c.status == w for w in _WAITING]),
            tasks.c.eligible_at <= sa.bindparam("now", type_=tasks.c.eligible_at.type),
        )
        # In rank order, locking rows one by one until n are held (the limit is
        # above the row locking: skipped rows do not count, the rest stay free).
        .order_by(sa.func.array_position(ids, tasks.c.id))
        .limit(sa.bindparam("n", type_=sa.Integer))
        .with_for_update(of=tasks, skip_locked=True)
    )


def _reserve_and_bind_stmt() -> Any:
    """Reserve devices for tasks (ON CONFLICT DO NOTHING), insert an attempt for
    each reservation made (lease id drawn by PostgreSQL), and move those tasks to
    assigned, in one statement. Returns one row per reservation made: task id,
    lease id, and ``bound``, the number of tasks moved (equal to the row count
    unless a locked task changed, which would be a bug)."""
    r = _unnest_params("r", host_id=sa.Text, device_id=sa.Text, task_id=UUIDT, attempt=sa.Integer)
    now = sa.bindparam("p_now", type_=device_reservations.c.reserved_at.type)
    reserved = (
        pg_insert(device_reservations)
        .from_select(
            ["host_id", "device_id", "task_id", "attempt", "reserved_at"],
            sa.select(r.c.host_id, r.c.device_id, r.c.task_id, r.c.attempt, now),
        )
        .on_conflict_do_nothing()
        .returning(
            device_reservations.c.host_id,
            device_reservations.c.device_id,
            device_reservations.c.task_id,
            device_reservations.c.attempt,
        )
        .cte("reserved")
    )
    inserted = (
        attempts.insert()
        .from_select(
            [
                "task_id",
                "number",
                "host_id",
                "device_id",
                "lease_id",
                "assigned_at",
                "claim_deadline",
            ],
            sa.select(
                reserved.c.task_id,
                reserved.c.attempt,
                reserved.c.host_id,
                reserved.c.device_id,
                sa.func.gen_random_uuid(),
                now,
                sa.bindparam("p_deadline", type_=attempts.c.claim_deadline.type),
            ),
        )
        .returning(attempts.c.task_id, attempts.c.lease_id)
        .cte("inserted")
    )
    bound = (
        tasks.update()
        .where(
            tasks.c.id == reserved.c.task_id,
            sa.or_(*[tasks.c.status == w for w in _WAITING]),
            tasks.c.attempt == reserved.c.attempt - 1,
        )
        .values(
            status=TaskState.ASSIGNED.value,
            attempt=reserved.c.attempt,
            progress_seq=0,
            updated_at=now,
        )
        .returning(tasks.c.id)
        .cte("bound")
    )
    n_bound = sa.select(sa.func.count()).select_from(bound).scalar_subquery().label("bound")
    return sa.select(inserted.c.task_id, inserted.c.lease_id, n_bound)
