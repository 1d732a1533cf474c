"""The metrics a process updates as things happen, and the calls that update them.

Every metric lives in ``REGISTRY`` (one per process, not prometheus_client's
global default, so nothing registered by a library leaks into the exposition).
The calls below are what the control plane's code makes where an event already
is: each is a counter increment or a histogram observation, a few hundred
nanoseconds, never I/O, and never raises into its caller.

Label values are bounded: task states, end reasons, error codes, principal
kinds, batch kinds and connection names come from closed sets in the code; no
task, host, user or request id is ever a label value. An unknown value (a newer
peer's error code) is counted as ``other``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from fleetlease.persistence.model import EndReason, TaskState
from fleetlease.transport.wire import ERROR_CODES

# One ``_created`` series per counter child doubles the series for nothing an
# operator asks of these counters.
disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

_STATES = frozenset(s.value for s in TaskState)
_REASONS = frozenset(r.value for r in EndReason)
_CODES = frozenset(ERROR_CODES)
_BATCH_KINDS = frozenset({"renew", "transition", "replay", "heartbeat", "pending_read"})
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

TRANSITIONS = Counter(
    "fleetlease_task_transitions_total",
    "Committed task transitions, by the state entered (as the control plane's "
    "events report them; a rebuilt Lease actor may repeat one).",
    ["state"],
    registry=REGISTRY,
)
COMMIT_SECONDS = Histogram(
    "fleetlease_commit_duration_seconds",
    "Time of one group-committed database write (a batch of renewals or of host transitions).",
    ["kind"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)
COMMIT_GROUP_SIZE = Histogram(
    "fleetlease_commit_group_size",
    "Items carried by one group commit.",
    ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)
ASSIGNMENT_SECONDS = Histogram(
    "fleetlease_assignment_latency_seconds",
    "From a task becoming queued (submitted, or retrying) to its assignment to a device, "
    "as seen by this process.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
DISPATCH_SECONDS = Histogram(
    "fleetlease_dispatch_latency_seconds",
    "From an assignment to its claim by the host (dispatched), as seen by this process.",
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
EXPIRIES = Counter(
    "fleetlease_lease_expiries_total",
    "Attempts ended by the Reaper, by reason (claim_expired, ack_expired, lease_expired).",
    ["reason"],
    registry=REGISTRY,
)
RETRIES = Counter(
    "fleetlease_task_retries_total",
    "Tasks sent back to retrying, by the reason their attempt ended "
    "(an expiry's reason, or 'failure': a retryable failure or an attempt lost at "
    "reconciliation).",
    ["reason"],
    registry=REGISTRY,
)
REQUEST_ERRORS = Counter(
    "fleetlease_nats_request_errors_total",
    "NATS requests answered with an error, by wire error code.",
    ["code"],
    registry=REGISTRY,
)
REFUSALS = Counter(
    "fleetlease_refusals_total",
    "Requests refused as unauthorized or forbidden, by the kind of principal "
    "(host, user, or unknown when the subject names neither).",
    ["principal_kind"],
    registry=REGISTRY,
)
SLOW_CONSUMERS = Counter(
    "fleetlease_nats_slow_consumers_total",
    "Messages nats-py dropped on a connection whose pending limit was full.",
    ["connection"],
    registry=REGISTRY,
)

LOOP_LAG_SECONDS = Histogram(
    "fleetlease_event_loop_lag_seconds",
    "How late the event loop ran a timer due now (probed every 0.1 s): the wait "
    "any request of this process has before its handler runs.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
    registry=REGISTRY,
)


# The children of the hot calls, bound once (``labels()`` takes a lock and hashes).
_TRANSITION_OF = {s: TRANSITIONS.labels(s) for s in (*_STATES, "other")}
_COMMIT_OF = {
    k: (COMMIT_SECONDS.labels(k), COMMIT_GROUP_SIZE.labels(k)) for k in (*_BATCH_KINDS, "other")
}


def _bounded(value: str, allowed: frozenset[str]) -> str:
    return value if value in allowed else "other"


def request_error(subject: str, code: str) -> None:
    """A request answered with an error (``transport/server.py``)."""
    try:
        code = _bounded(code, _CODES)
        REQUEST_ERRORS.labels(code).inc()
        if code in ("unauthorized", "forbidden"):
            REFUSALS.labels(principal_kind(subject)).inc()
    except Exception:  # metrics never break a request
        pass


def principal_kind(subject: str) -> str:
    """``host`` for ``<prefix>.host.…``, ``user`` for ``<prefix>.ops.…``."""
    parts = subject.split(".")
    if "host" in parts[:-1]:
        return "host"
    if "ops" in parts[:-1]:
        return "user"
    return "unknown"


def nats_error(connection: str, exc: BaseException) -> None:
    """nats-py's ``error_cb`` (``transport/server.py``): counts slow consumers."""
    try:
        from nats.errors import SlowConsumerError

        if isinstance(exc, SlowConsumerError):
            SLOW_CONSUMERS.labels(connection[:64]).inc()
    except Exception:
        pass


def group_committed(kind: str, size: int, started: float) -> None:
    """A group commit of ``size`` items, begun at ``time.perf_counter()`` ``started``."""
    try:
        seconds, sizes = _COMMIT_OF.get(kind) or _COMMIT_OF["other"]
        seconds.observe(time.perf_counter() - started)
        sizes.observe(size)
    except Exception:  # metrics never fail a commit
        pass


class _RetryReasons:
    """The Reaper's reasons for the retries it causes, kept until the retry's
    event arrives on the loop (the event itself carries no reason)."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._by_attempt: dict[tuple[str, int], str] = {}
        #: Set by the first ``EventMetrics``: until then nobody takes them out.
        self.enabled = False

    def put(self, task_id: str, attempt: int, reason: str) -> None:
        if not self.enabled:
            return
        if len(self._by_attempt) >= self.LIMIT:
            self._by_attempt.pop(next(iter(self._by_attempt)), None)
        self._by_attempt[(task_id, attempt)] = reason

    def pop(self, task_id: str, attempt: int) -> str:
        return self._by_attempt.pop((task_id, attempt), "failure")


RETRY_REASONS = _RetryReasons()


def expired(ended: Iterable[Any]) -> None:
    """Attempts the Reaper ended (``persistence.model.Expired``)."""
    try:
        for e in ended:
            reason = _bounded(str(e.reason), _REASONS)
            EXPIRIES.labels(reason).inc()
            if str(e.new_state) == TaskState.RETRYING:
                RETRY_REASONS.put(e.task_id, e.attempt, reason)
    except Exception:  # metrics never break the Reaper
        pass


class EventMetrics:
    """A ``ControlPlane.add_listener`` callback: transitions, retries and the
    assignment and dispatch latencies. It remembers, per task, when its last
    queued or assigned event arrived; the memory is bounded (``limit`` tasks,
    the oldest forgotten first) and a task leaves it at its next event."""

    def __init__(self, limit: int = 100_000, clock: Any = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self._since: dict[str, tuple[str, float]] = {}
        RETRY_REASONS.enabled = True

    def __call__(self, event: dict[str, Any]) -> None:
        state = event.get("state")
        task_id = event.get("task_id")
        if not isinstance(state, str) or not isinstance(task_id, str):
            return
        (_TRANSITION_OF.get(state) or _TRANSITION_OF["other"]).inc()
        now = self._clock()
        previous = self._since.pop(task_id, None)
        if state == TaskState.ASSIGNED:
            if previous is not None and previous[0] == TaskState.QUEUED:
                ASSIGNMENT_SECONDS.observe(max(now - previous[1], 0.0))
            self._remember(task_id, state, now)
        elif state == TaskState.DISPATCHED:
            if previous is not None and previous[0] == TaskState.ASSIGNED:
                DISPATCH_SECONDS.observe(max(now - previous[1], 0.0))
        elif state in (TaskState.QUEUED, TaskState.RETRYING):
            if state == TaskState.RETRYING:
                attempt = event.get("attempt")
                reason = RETRY_REASONS.pop(task_id, attempt if isinstance(attempt, int) else -1)
                RETRIES.labels(reason).inc()
            # A retrying task is queued again once its backoff passes: the
            # assignment latency of a retry includes its backoff.
            self._remember(task_id, TaskState.QUEUED, now)

    def _remember(self, task_id: str, state: str, at: float) -> None:
        if len(self._since) >= self.limit:
            self._since.pop(next(iter(self._since)), None)
        self._since[task_id] = (state, at)

    def __len__(self) -> int:
        return len(self._since)
