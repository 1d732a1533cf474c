"""The host agent: outbound-only execution of leased attempts on local devices.

One asyncio process per host. It makes outbound NATS connections only (through
:class:`transport.client.HostClient`, one connection per channel) and never
listens on anything.

Lifecycle::

    connect -> register -> reconcile the journal -> heartbeat -> claim work
                  ^                                                  |
                  +-- NATS reconnect, or a request answered ---------+
                      "unauthorized" (session superseded)

Session. Every registration opens a new session generation and kills the
previous one. After *every* registration the agent reconciles its journal before
any other job request goes out: the control plane confirms (and rebinds to the
new generation) the attempts it still considers this host's, and says "discard"
for the others. Confirmed attempts that this process is not running (a restart)
are resumed: a finished one is reported again with the fingerprint stored in the
journal, an unfinished one is run again from the start on its device. Every
such resume is counted in the journal entry (committed before the runner
starts); an entry already resumed ``max_resumes`` times is not run again but
reported as a retryable failure ("agent died N times running this attempt"),
so a task that kills its agent cannot crash-loop a promptly restarted agent:
the control plane retries it elsewhere or fails it after its max attempts. Requests
wait while the session is being re-established; a request refused with
``unauthorized`` triggers one re-registration (coalesced across all callers by a
session epoch) and is retried on the new session. Reconnecting agents wait a
random jitter (``resync_jitter_s``) before registering, so that a NATS restart
does not make every host register in the same instant.

Work. Each idle device is covered by exactly one outstanding long-poll claim
(the idle devices split between up to ``claim_polls`` of them),
listing the idle device ids it covers; a claim returns at most one assignment,
for one of its devices, so the agent never holds more assignments than idle
devices, and devices run their attempts in parallel. Errors back off
exponentially with jitter; a claim that comes back empty faster than
``min_poll_interval_s`` is paced, so an idle agent never spins.

An attempt: journal ``add`` (committed, fsynced) -> ack -> run the runner while
renewing the lease every third of the lease period -> journal
``record_result`` (fingerprint) -> report, repeated with the same fingerprint
while the control plane does not answer -> journal ``remove``.

- A renewal reporting ``cancel_requested`` sets ``ctx.cancelled``; the runner
  returns ``cancelled`` (or is cancelled outright after ``cancel_timeout_s``)
  and ``cancelled`` is reported.
- A renewal or ack refused for the attempt (conflict, gone, forbidden, not
  found, or unauthorized even on a fresh session), or a reconciliation verdict
  ``discard``, means the lease is lost: the runner is stopped, nothing more is
  reported for that attempt and its journal entry is dropped.
- A result answered with an error other than ``unavailable``/``internal`` is
  stale (the lease expired meanwhile, another attempt exists): dropped.
- An ack not answered by the attempt's ack deadline (from the claim; a
  partition) is given up locally: no retry after the deadline, the runner is
  never started, ``ack_given_up`` is logged, and the journal entry is *kept*
  for the next reconciliation to settle (the control plane has expired the
  attempt, unless the ack got through just in time: then it is confirmed and
  resumed). With a session up, the first ack is always sent and waited for in
  full, so an agent whose clock runs ahead of the control plane's still gets
  its acks through; retries and waits for a session stop at the deadline.

Logs and artifacts leave through bounded in-memory queues shipped by their own
tasks on the LOGS and ARTIFACTS connections. A full queue drops its *oldest*
entries and counts them (``stats``); enqueueing never blocks a runner or the job
loop.

Shutdown (SIGTERM via the CLI, or :meth:`Agent.stop`): claiming stops at once
(outstanding long-polls are abandoned), running attempts get ``grace_s`` to
finish and report. Attempts still running after that are *handed back*: the
runner is stopped and the attempt is reported as a retryable failure
(``reason="handed back: agent shutting down"``), so the control plane applies
the task's retry policy at once instead of waiting for the lease to expire. We
chose this over reporting ``cancelled``: a cancelled task is terminal, and an
operator restarting an agent must not cancel users' work. If the user had
requested a cancel, ``cancelled`` is reported as usual. A report that cannot be
delivered before the end of the shutdown stays in the journal and is
reconciled by the next start.

Broker refusal: a NATS server that refuses the host's authorization on a
(re)connect ("Authorization Violation": on a secured broker the auth callout
refuses a revoked or unknown host) makes the agent stop with
:class:`BrokerRefused` once the refusals have lasted ``broker_refused_s``
without a successful connect in between (a callout briefly unavailable, as
while the control plane restarts, is refused the same way and must not stop
the agent). Plain connection errors are retried forever.

Test hook: ``FLEETLEASE_AGENT_FAILPOINTS`` (comma-separated names of
:data:`FAILPOINTS`) makes the agent SIGKILL itself at that point, so crash
tests need no timing.

Secrets: the host credential, the session key and lease tokens are never
logged; :class:`AgentConfig` and journal records hide them from ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

import structlog
from nats.errors import AuthorizationError as NatsAuthorizationError
from nats.errors import Error as NatsError

from fleetlease.hostagent.devices import DeviceManager, UnknownDevice
from fleetlease.hostagent.execution import end_orphan_groups
from fleetlease.hostagent.journal import (
    EntryState,
    Journal,
    JournalError,
    JournalRecord,
    JournalThread,
)
from fleetlease.hostagent.runners import RunContext, RunnerFactory, RunOutcome, guard, load_runners
from fleetlease.hostagent.runners.base import GuardedRunner
from fleetlease.persistence.model import Outcome, TaskKind
from fleetlease.transport import wire
from fleetlease.transport.broker_auth import host_connect_options
from fleetlease.transport.client import HostClient
from fleetlease.transport.subjects import validate_token
from fleetlease.transport.wire import RemoteError

__all__ = [
    "AGENT_VERSION",
    "FAILPOINTS",
    "FAILPOINTS_ENV",
    "HANDBACK_REASON",
    "Agent",
    "AgentConfig",
    "AgentError",
    "AgentStats",
    "Backoff",
    "BrokerRefused",
    "DropOldestQueue",
    "RegistrationRefused",
    "parse_failpoints",
]

log = structlog.get_logger("fleetlease.agent")

T = TypeVar("T")
Q = TypeVar("Q")

AGENT_VERSION = "fleetlease-agent/0.1.0"

FAILPOINTS_ENV = "FLEETLEASE_AGENT_FAILPOINTS"
#: Points where a test can make the agent kill itself (SIGKILL).
FAILPOINT_AFTER_JOURNAL_ADD = "after_journal_add"
FAILPOINT_AFTER_ACK = "after_ack"
FAILPOINT_AFTER_RESULT_RECORDED = "after_result_recorded"
FAILPOINT_AFTER_RESULT_REPORTED = "after_result_reported"
FAILPOINTS: frozenset[str] = frozenset(
    {
        FAILPOINT_AFTER_JOURNAL_ADD,
        FAILPOINT_AFTER_ACK,
        FAILPOINT_AFTER_RESULT_RECORDED,
        FAILPOINT_AFTER_RESULT_REPORTED,
    }
)

HANDBACK_REASON = "handed back: agent shutting down"

#: Error codes after which a request is worth repeating unchanged.
_TRANSIENT_CODES = frozenset({"unavailable", "internal"})
#: Codes with which the control plane refuses the credential at registration.
_REFUSED_CODES = frozenset({"unauthorized", "forbidden", "bad_request", "not_found"})
#: How many times one request is retried on a fresh session after "unauthorized".
_MAX_SESSION_RETRIES = 3

_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_REASON = 1000
_MAX_PROGRESS = 1000
_LOG_LINE_MAX_BYTES = wire.MAX_LOG_LINE_BYTES
_LOG_BATCH_BYTES = 256 * 1024
_SIDE_CHANNEL_ATTEMPTS = 5
#: Side-channel refusals that a later retry may get past (staging quotas).
_SIDE_RETRY_CODES = frozenset({"busy", "quota"})


# -- errors -----------------------------------------------------------------------------


class AgentError(Exception):
    """The agent cannot continue."""

    code = "internal"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "agent error").strip()
        super().__init__(self.message)


class RegistrationRefused(AgentError):
    """The control plane refused this host's credential."""

    def __init__(self, host_id: str, code: str, detail: str) -> None:
        self.host_id = host_id
        self.remote_code = code
        super().__init__(
            f"registration of host {host_id!r} refused by the control plane ({code}: {detail}); "
            "check --host-id and --token-file (the credential must be the one issued for "
            "this host by `fleetlease host add`)"
        )
        # Exit code mapping of the CLI: unauthorized/forbidden -> 3.
        self.code = "forbidden" if code == "forbidden" else "unauthorized"


class BrokerRefused(AgentError):
    """The NATS server keeps refusing this host's authorization."""

    code = "unauthorized"

    def __init__(self, host_id: str, detail: str, refused_for_s: float) -> None:
        self.host_id = host_id
        self.refused_for_s = refused_for_s
        super().__init__(
            f"the NATS server refuses host {host_id!r} ({detail.strip()}, for "
            f"{refused_for_s:.0f}s): the host was revoked or is unknown to the control "
            "plane, or --token-file is not its credential"
        )


def is_authorization_refusal(exc: BaseException) -> bool:
    """Whether a nats-py error means the server refused the connect's
    authorization (not a network error)."""
    if isinstance(exc, NatsAuthorizationError):
        return True
    return isinstance(exc, NatsError) and "authorization violation" in str(exc).lower()


class _Aborted(Exception):
    """An attempt's wait was cut short because its lease was lost."""


# -- configuration ----------------------------------------------------------------------


def parse_failpoints(text: str | None) -> frozenset[str]:
    """Failpoint names from ``FLEETLEASE_AGENT_FAILPOINTS``; ValueError for an
    unknown one."""
    names = frozenset(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = names - FAILPOINTS
    if unknown:
        raise ValueError(
            f"{FAILPOINTS_ENV}: unknown failpoint(s) {sorted(unknown)}, known: {sorted(FAILPOINTS)}"
        )
    return names


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything the agent needs besides its devices. Times are seconds."""

    host_id: str
    credential: str = field(repr=False)
    nats_url: str
    state_dir: Path
    prefix: str = "fleetlease"
    #: Runner names (entry points of ``fleetlease.runners``) per task kind.
    goal_runner: str = "sim-goal"
    workflow_runner: str = "sim-workflow"
    #: The workflows this host advertises; None: any (a runner that takes every name).
    workflows: tuple[str, ...] | None = None
    #: Long-poll duration of one claim (the control plane caps it at 60 s).
    claim_wait_s: float = 20.0
    #: An empty claim answered faster than this is paced (no busy loop).
    min_poll_interval_s: float = 1.0
    #: The idle devices are split between up to this many claims outstanding at
    #: once (more when freed devices trickle in: each new claim covers the idle
    #: devices no claim covers, at most a ``claim_polls``-th of all of them), so
    #: the claims of several tasks reaching one host together run side by side
    #: instead of one after another.
    claim_polls: int = 4
    request_timeout_s: float = 10.0
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 15.0
    #: Random delay before re-registering after a reconnect (spreads a herd).
    resync_jitter_s: float = 2.0
    #: Override of the heartbeat period given by the control plane.
    heartbeat_s: float | None = None
    #: SIGTERM: time running attempts get to finish before being handed back.
    grace_s: float = 10.0
    #: Time a runner may ignore ``ctx.cancelled`` before it is cancelled outright.
    cancel_timeout_s: float = 5.0
    #: Shutdown: time to deliver the reports of handed-back attempts.
    handback_timeout_s: float = 5.0
    #: Shutdown: time to flush queued logs and artifacts.
    flush_timeout_s: float = 2.0
    #: Before reporting a result, time to ship the attempt's queued artifacts
    #: (the control plane takes them only while the lease is held).
    artifact_flush_s: float = 60.0
    log_queue_lines: int = 10_000
    artifact_queue_items: int = 32
    artifact_queue_bytes: int = 64 * 1024 * 1024
    #: A journal entry resumed this many times after agent restarts is not run
    #: again: it is reported as a retryable failure (a poison attempt).
    max_resumes: int = 2
    #: Exit (``BrokerRefused``) once the NATS server has refused the host's
    #: authorization for this long with no successful connect in between.
    broker_refused_s: float = 15.0
    failpoints: frozenset[str] = frozenset()
    connect_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_token(self.host_id, "host_id")
        if not isinstance(self.credential, str) or _HEX64.fullmatch(self.credential) is None:
            # Never echo the value: it is a secret, even when malformed.
            raise ValueError("credential must be 64 lowercase hex characters")
        if not self.nats_url:
            raise ValueError("nats_url must be non-empty")
        if not self.goal_runner or not self.workflow_runner:
            raise ValueError("goal_runner and workflow_runner must be non-empty")
        _positive("claim_wait_s", self.claim_wait_s)
        if isinstance(self.claim_polls, bool) or not isinstance(self.claim_polls, int):
            raise ValueError(f"claim_polls must be an integer, got {self.claim_polls!r}")
        if self.claim_polls < 1:
            raise ValueError(f"claim_polls must be >= 1, got {self.claim_polls}")
        if self.claim_wait_s > wire.MAX_WAIT_S:
            raise ValueError(f"claim_wait_s must be <= {wire.MAX_WAIT_S}, got {self.claim_wait_s}")
        for name in (
            "request_timeout_s",
            "backoff_base_s",
            "backoff_cap_s",
            "cancel_timeout_s",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "min_poll_interval_s",
            "resync_jitter_s",
            "grace_s",
            "handback_timeout_s",
            "flush_timeout_s",
            "artifact_flush_s",
            "broker_refused_s",
        ):
            _non_negative(name, getattr(self, name))
        if self.heartbeat_s is not None:
            _positive("heartbeat_s", self.heartbeat_s)
        if (
            isinstance(self.max_resumes, bool)
            or not isinstance(self.max_resumes, int)
            or self.max_resumes < 0
        ):
            raise ValueError(f"max_resumes must be an int >= 0, got {self.max_resumes!r}")
        for name in ("log_queue_lines", "artifact_queue_items", "artifact_queue_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        unknown = set(self.failpoints) - FAILPOINTS
        if unknown:
            raise ValueError(f"failpoints: unknown {sorted(unknown)}")


# -- building blocks --------------------------------------------------------------------


class Backoff:
    """Capped exponential backoff with jitter: the n-th consecutive failure waits
    a random time in ``[c/2, c]`` with ``c = min(cap, base * 2**n)``. Never zero,
    so a failing loop cannot spin; the jitter spreads many agents apart."""

    def __init__(self, base_s: float, cap_s: float, *, rng: random.Random | None = None) -> None:
        _positive("base_s", base_s)
        _positive("cap_s", cap_s)
        if cap_s < base_s:
            raise ValueError(f"cap_s must be >= base_s, got {cap_s} < {base_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()
        self.failures = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap_s, self.base_s * 2 ** min(self.failures, 62))
        self.failures += 1
        return float(ceiling / 2 + self._rng.random() * ceiling / 2)

    def reset(self) -> None:
        self.failures = 0


class DropOldestQueue(Generic[Q]):
    """A bounded FIFO that never blocks its producer: putting into a full queue
    drops the *oldest* items (counted in ``dropped``). Bounded by item count and,
    with ``cost``, by the total cost of its items (e.g. bytes). An item costing
    more than ``max_cost`` on its own is dropped at once.

    Loop-affine: use it from one event loop thread (the agent forwards calls
    made on other threads with ``call_soon_threadsafe``)."""

    def __init__(
        self,
        max_items: int,
        *,
        cost: Callable[[Q], int] | None = None,
        max_cost: int | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        if (cost is None) != (max_cost is None):
            raise ValueError("cost and max_cost go together")
        self.max_items = max_items
        self._cost = cost
        self.max_cost = max_cost
        self._items: deque[Q] = deque()
        self._total = 0
        self._nonempty = asyncio.Event()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def total_cost(self) -> int:
        return self._total

    def put(self, item: Q) -> int:
        """Append ``item``; returns how many items were dropped to make room."""
        cost = self._cost(item) if self._cost is not None else 0
        if self.max_cost is not None and cost > self.max_cost:
            self.dropped += 1
            return 1
        self._items.append(item)
        self._total += cost
        dropped = 0
        while len(self._items) > self.max_items or (
            self.max_cost is not None and self._total > self.max_cost
        ):
            self._drop_left()
            dropped += 1
        self.dropped += dropped
        self._nonempty.set()
        return dropped

    def _drop_left(self) -> Q:
        item = self._items.popleft()
        if self._cost is not None:
            self._total -= self._cost(item)
        if not self._items:
            self._nonempty.clear()
        return item

    def popleft(self) -> Q:
        """Remove and return the oldest item (IndexError when empty)."""
        return self._drop_left()

    def peek(self) -> Q:
        return self._items[0]

    def __iter__(self) -> Iterator[Q]:
        return iter(self._items)

    async def wait(self) -> None:
        """Return once the queue is not empty."""
        while not self._items:
            self._nonempty.clear()
            await self._nonempty.wait()

    def pop_batch(self, key: Callable[[Q], Hashable], *, max_items: int) -> list[Q]:
        """Pop the longest run (at most ``max_items``) of leading items sharing
        the first item's ``key``."""
        if not self._items:
            return []
        first = key(self._items[0])
        batch: list[Q] = []
        while self._items and len(batch) < max_items and key(self._items[0]) == first:
            batch.append(self._drop_left())
        return batch


@dataclass
class AgentStats:
    """Counters, for tests and ``agent_stopped``."""

    registrations: int = 0
    heartbeats_sent: int = 0
    assignments: int = 0
    results_reported: int = 0
    results_rejected: int = 0
    leases_lost: int = 0
    acks_given_up: int = 0
    handed_back: int = 0
    #: Assignments that arrived for a device whose last attempt was still
    #: reporting its result, and waited for that report's answer.
    handovers_waited: int = 0
    log_lines_sent: int = 0
    logs_dropped: int = 0
    artifacts_sent: int = 0
    artifacts_dropped: int = 0


@dataclass(frozen=True)
class _LogLine:
    task_id: str
    attempt: int
    seq: int
    line: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.attempt)


@dataclass(frozen=True)
class _ArtifactItem:
    task_id: str
    attempt: int
    lease_token: str = field(repr=False)
    name: str
    data: bytes = field(repr=False)


def _truncate_utf8(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode("utf-8", "ignore")


@dataclass(eq=False)
class _Attempt:
    """One attempt this process holds (running, reporting, or being resumed)."""

    record: JournalRecord
    ack_deadline: float | None = None
    #: Set on cancel request or handback: the runner's ``ctx.cancelled``.
    cancel_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the lease is lost: stop and report nothing further.
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: str = ""
    cancel_requested: bool = False
    handback: bool = False
    reporting: bool = False
    #: The journal entry may go: reported, or known stale.
    entry_done: bool = False
    #: Set when a resumed attempt cannot run here (its device is gone, or it was
    #: resumed too often: it kills the agent).
    unrunnable: str | None = None
    #: Taken over from the journal after a restart (not claimed by this process).
    resumed: bool = False
    holds_device: bool = False
    log_seq: int = 0
    progress_seq: int = 0
    progress_message: str | None = None
    task: asyncio.Task[None] | None = None
    renewer: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.record.key

    def lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()


# -- the agent --------------------------------------------------------------------------


class Agent:
    """The host agent. ``await agent.run()`` until :meth:`stop` (or a fatal error:
    ``RegistrationRefused`` when the credential is refused)."""

    def __init__(
        self,
        config: AgentConfig,
        devices: DeviceManager,
        *,
        runners: Mapping[str, RunnerFactory] | None = None,
        journal: Journal | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.devices = devices
        available = dict(runners) if runners is not None else load_runners()
        self._runners: dict[TaskKind, GuardedRunner] = {}
        for kind, name in (
            (TaskKind.GOAL, config.goal_runner),
            (TaskKind.WORKFLOW, config.workflow_runner),
        ):
            factory = available.get(name)
            if factory is None:
                raise ValueError(
                    f"{kind.value} runner {name!r} not found; available: {sorted(available)}"
                )
            self._runners[kind] = guard(factory())
        self._journal = journal
        self._owns_journal = journal is None
        self._rng = rng or random.Random()
        self.stats = AgentStats()
        self.client: HostClient | None = None

        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._held: set[str] = set()
        #: Held devices whose attempt is reporting its result: claimed for
        #: already, so that the next assignment waits for no round trip.
        self._releasing: set[str] = set()
        #: A releasing device -> the next assignment's wait for it: the finished
        #: attempt passes the device on (still held, still busy) instead of
        #: freeing it.
        self._handover: dict[str, asyncio.Future[None]] = {}
        #: Claimable devices (idle, or releasing) covered by an outstanding
        #: claim -> that claim's number.
        self._covered: dict[str, int] = {}
        #: The claims sent and not answered yet: number -> the devices each
        #: lists. No device is listed by two of them.
        self._claims: dict[int, tuple[str, ...]] = {}
        self._poll_numbers = itertools.count(1)
        self._polls: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._epoch = 0
        self._resync_task: asyncio.Task[None] | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._claim_backoff = Backoff(config.backoff_base_s, config.backoff_cap_s, rng=self._rng)
        self._logs: DropOldestQueue[_LogLine] = DropOldestQueue(config.log_queue_lines)
        self._artifacts: DropOldestQueue[_ArtifactItem] = DropOldestQueue(
            config.artifact_queue_items,
            cost=lambda a: len(a.data),
            max_cost=config.artifact_queue_bytes,
        )
        self._shipping_logs = 0
        self._shipping_artifacts = 0
        self._shipping_artifact: tuple[str, int] | None = None
        #: Set each time an artifact has been shipped (or given up).
        self._artifact_shipped = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        # Created lazily in run(): asyncio primitives bind to the running loop.
        self._ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._fatal_event = asyncio.Event()
        self._fatal: BaseException | None = None
        self._wake = asyncio.Event()
        self._devices_changed = asyncio.Event()
        #: Set while the agent itself flips a device for one of its leases.
        self._lease_flip = False
        self._journal_lock = asyncio.Lock()
        #: Every journal call after the journal is open, in order, off the loop.
        self._journal_calls = JournalThread(f"fleetlease-journal-{config.host_id}")
        self._started = asyncio.Event()
        #: Loop time of the first of the current run of authorization refusals.
        self._refused_since: float | None = None

    # --- public -----------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        """Whether a session is established and reconciled."""
        return self._ready.is_set()

    @property
    def started(self) -> asyncio.Event:
        """Set once the first registration and reconciliation are done."""
        return self._started

    @property
    def generation(self) -> int | None:
        return self.client.generation if self.client is not None else None

    @property
    def running_attempts(self) -> list[tuple[str, int]]:
        return sorted(self._attempts)

    def stop(self) -> None:
        """Ask the agent to shut down (stop claiming, finish or hand back running
        attempts within ``grace_s``). Safe from any thread and from a signal
        handler installed with ``loop.add_signal_handler``."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self._set_stopping()
        else:
            loop.call_soon_threadsafe(self._set_stopping)

    def _set_stopping(self) -> None:
        self._stopping.set()
        # The claim dispatcher waits for _wake alone (one event: no waiter tasks).
        self._wake.set()

    async def run(self) -> None:
        """Run until stopped. Raises ``RegistrationRefused`` if the control plane
        refuses the credential (at start or at any later registration), and
        ``BrokerRefused`` if the NATS server keeps refusing the host's
        authorization."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        cfg = self.config
        log.info(
            "agent_starting",
            host_id=cfg.host_id,
            prefix=cfg.prefix,
            devices=len(self.devices.snapshot()),
            goal_runner=cfg.goal_runner,
            workflow_runner=cfg.workflow_runner,
        )
        if self._journal is None:
            self._journal = await asyncio.to_thread(Journal.in_state_dir, cfg.state_dir)
        unsubscribe = self.devices.on_change(self._on_devices_changed_threadsafe)
        try:
            await self.devices_refresh()
            if not await self._until_stopped(self._connect()) or self.client is None:
                return  # stopped before the first connection
            if not await self._until_stopped(self._resync("start", jitter=False)):
                return  # stopped while the control plane was unreachable
            self._started.set()
            self._spawn(self._heartbeat_loop(), "heartbeat")
            self._spawn(self._ship_logs(), "log_shipper")
            self._spawn(self._ship_artifacts(), "artifact_shipper")
            self._dispatcher = self._spawn(self._claim_dispatcher(), "claim_dispatcher")
            stop_wait = asyncio.ensure_future(self._stopping.wait())
            fatal_wait = asyncio.ensure_future(self._fatal_event.wait())
            try:
                await asyncio.wait({stop_wait, fatal_wait}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
                fatal_wait.cancel()
            if self._fatal is not None:
                raise self._fatal
            await self._shutdown()
        finally:
            unsubscribe()
            await self._teardown()

    async def _until_stopped(self, coro: Awaitable[None]) -> bool:
        """Run ``coro`` unless a stop comes first (then cancel it, return False)."""
        work = asyncio.ensure_future(coro)
        stop_wait = asyncio.ensure_future(self._stopping.wait())
        fatal_wait = asyncio.ensure_future(self._fatal_event.wait())
        try:
            await asyncio.wait({work, stop_wait, fatal_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            fatal_wait.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            if self._fatal is not None:
                raise self._fatal
            return False
        work.result()  # raises what it raised
        return True

    async def devices_refresh(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.devices.refresh)

    # --- plumbing -----------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._background.discard(t)
            if t.cancelled():
                return
            exc = t.exception()
            if exc is not None:
                self._set_fatal(exc, where=name)

        task.add_done_callback(done)
        return task

    def _set_fatal(self, exc: BaseException, *, where: str) -> None:
        if self._fatal is None:
            self._fatal = exc
            if not isinstance(exc, RegistrationRefused | BrokerRefused):
                log.error(
                    "agent_task_crashed",
                    task=where,
                    error_type=type(exc).__name__,
                    error=str(exc)[:500],
                    exc_info=exc,
                )
        self._fatal_event.set()

    def _on_devices_changed_threadsafe(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._on_devices_changed()
        else:
            loop.call_soon_threadsafe(self._on_devices_changed)

    def _on_devices_changed(self) -> None:
        if not self._lease_flip:
            self._devices_changed.set()
        self._wake.set()

    def _mark(self, device_id: str, *, busy: bool) -> None:
        """Mark a device busy (idle) as one of this agent's leases starts (ends).

        No heartbeat is sent for these flips: the control plane knows them from its
        device reservations (a result frees the device), and the periodic heartbeat
        carries the state anyway. Only changes from outside (a device attached,
        detached, gone offline) are sent at once. Without this the agent sent two
        heartbeats per task, two of its five requests."""
        self._lease_flip = True
        try:
            if busy:
                self.devices.mark_busy(device_id)
            else:
                self.devices.mark_idle(device_id)
        finally:
            self._lease_flip = False

    def _in_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the agent's loop thread (now if already there)."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            fn()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(fn)

    async def _sleep(self, delay: float, *events: asyncio.Event) -> bool:
        """Sleep ``delay`` seconds; returns True early if any event is set."""
        for e in events:
            if e.is_set():
                return True
        if not events:
            await asyncio.sleep(delay)
            return False
        if len(events) == 1:
            # The common case (a renewal loop, a backoff): wait in this task,
            # no waiter task to create and cancel.
            try:
                async with asyncio.timeout(max(delay, 0.0)):
                    await events[0].wait()
            except TimeoutError:
                return events[0].is_set()
            return True
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=max(delay, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waiters:
                w.cancel()
        return bool(done)

    def _failpoint(self, name: str, **fields: Any) -> None:
        if name in self.config.failpoints:
            log.warning("agent_failpoint_kill", failpoint=name, **fields)
            os.kill(os.getpid(), signal.SIGKILL)

    def _journal_or_fail(self) -> Journal:
        if self._journal is None:
            raise AgentError("journal is not open")
        return self._journal

    def _client_or_fail(self) -> HostClient:
        if self.client is None:
            raise AgentError("not connected")
        return self.client

    # --- connection and session -------------------------------------------------------------
    async def _connect(self) -> None:
        cfg = self.config
        backoff = Backoff(cfg.backoff_base_s, cfg.backoff_cap_s, rng=self._rng)
        while not self._stopping.is_set():
            client = HostClient(
                nats_url=cfg.nats_url,
                host_id=cfg.host_id,
                credential=cfg.credential,
                prefix=cfg.prefix,
                timeout_s=cfg.request_timeout_s,
                on_reconnect=self._on_nats_reconnect,
                # Secured identity (issue 11); harmless on an open server.
                connect_options={
                    **host_connect_options(cfg.host_id, cfg.credential),
                    "error_cb": self._on_nats_error,
                    **cfg.connect_options,
                },
            )
            client.advertised_workflows = None if cfg.workflows is None else list(cfg.workflows)
            client.advertised_goal_runner = cfg.goal_runner
            try:
                await client.connect()
            except asyncio.CancelledError:
                # A stop, or a refusal made fatal: nats-py retries a refused or
                # unreachable server inside connect() and never returns.
                await client.close()
                raise
            except (OSError, TimeoutError, NatsError) as exc:
                await client.close()
                delay = backoff.next_delay()
                log.warning(
                    "nats_connect_failed",
                    host_id=cfg.host_id,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await self._sleep(delay, self._stopping)
                continue
            self.client = client
            self._refused_since = None
            return

    async def _on_nats_reconnect(self) -> None:
        self._refused_since = None
        self._request_resync("nats_reconnected", self._epoch)

    async def _on_nats_error(self, exc: Exception) -> None:
        """nats-py's error callback of every connection (it replaces the
        client's, which only logs): counts authorization refusals."""
        text = str(exc) or type(exc).__name__
        if not is_authorization_refusal(exc):
            log.warning("nats_error", host_id=self.config.host_id, error=text)
            return
        loop = asyncio.get_running_loop()
        if self._refused_since is None:
            self._refused_since = loop.time()
        refused_for = loop.time() - self._refused_since
        limit = self.config.broker_refused_s
        if refused_for < limit:
            log.warning(
                "nats_authorization_refused",
                host_id=self.config.host_id,
                error=text,
                refused_for_s=round(refused_for, 1),
                exit_after_s=limit,
            )
            return
        if self._fatal is None:
            log.error(
                "broker_refused",
                host_id=self.config.host_id,
                error=text,
                refused_for_s=round(refused_for, 1),
            )
        self._set_fatal(BrokerRefused(self.config.host_id, text, refused_for), where="nats")

    def _request_resync(self, reason: str, epoch: int) -> None:
        """Re-register (once, however many callers ask) unless the session of
        ``epoch`` has already been replaced."""
        if self._fatal is not None or epoch != self._epoch or not self._started.is_set():
            # Before the first session is up, the initial registration retries.
            return
        if self._resync_task is not None and not self._resync_task.done():
            return
        self._ready.clear()
        log.info("session_resync", host_id=self.config.host_id, reason=reason)
        self._resync_task = self._spawn(self._resync(reason, jitter=True), "resync")

    async def _resync(self, reason: str, *, jitter: bool) -> None:
        """Register, reconcile, heartbeat; then mark the session ready."""
        cfg = self.config
        client = self._client_or_fail()
        self._ready.clear()
        if jitter and cfg.resync_jitter_s > 0:
            await asyncio.sleep(self._rng.random() * cfg.resync_jitter_s)
        backoff = Backoff(cfg.backoff_base_s, cfg.backoff_cap_s, rng=self._rng)
        while True:
            try:
                ok = await client.register(AGENT_VERSION)
            except RemoteError as exc:
                if exc.code in _REFUSED_CODES:
                    log.error(
                        "registration_refused",
                        host_id=cfg.host_id,
                        code=exc.code,
                        error=exc.message,
                    )
                    raise RegistrationRefused(cfg.host_id, exc.code, exc.message) from None
                delay = backoff.next_delay()
                log.warning(
                    "registration_failed",
                    host_id=cfg.host_id,
                    code=exc.code,
                    error=exc.message,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            self._epoch += 1
            self.stats.registrations += 1
            log.info(
                "agent_registered",
                host_id=cfg.host_id,
                generation=ok.generation,
                lease_s=ok.lease_s,
                heartbeat_s=ok.heartbeat_s,
                reason=reason,
            )
            try:
                await self._reconcile(client)
                await self._first_heartbeat(client)
            except RemoteError as exc:
                delay = backoff.next_delay()
                log.warning(
                    "reconcile_failed",
                    host_id=cfg.host_id,
                    code=exc.code,
                    error=exc.message,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            break
        self._devices_changed.clear()
        self._ready.set()
        self._wake.set()

    async def _first_heartbeat(self, client: HostClient) -> None:
        """The snapshot right after registering; only a dead session matters here
        (the heartbeat loop repeats it anyway)."""
        try:
            await client.heartbeat(self._snapshot())
        except RemoteError as exc:
            if exc.code == "unauthorized":
                raise
            log.warning(
                "heartbeat_failed", host_id=self.config.host_id, code=exc.code, error=exc.message
            )

    def record_process_group(
        self, task_id: str, attempt: int, pgid: int, start: int | None
    ) -> None:
        """A runner started a process group for an attempt: journal it (see
        ``hostagent.execution``). Called on the event loop."""
        journal = self._journal
        if journal is None:
            return

        async def record() -> None:
            try:
                await self._journal_calls.call(journal.add_group, task_id, attempt, pgid, start)
            except JournalError as exc:
                log.warning("process_group_not_journaled", task_id=task_id, attempt=attempt,
                            pgid=pgid, error=exc.message)  # fmt: skip

        self._spawn(record(), "record_group")

    async def _reconcile(self, client: HostClient) -> None:
        journal = self._journal_or_fail()
        async with self._journal_lock:
            entries = await self._journal_calls.call(journal.entries)
            await end_orphan_groups(
                [e for e in entries if e.key not in self._attempts],
                self._journal_calls,
                journal,
                grace_s=self.config.cancel_timeout_s,
            )
            result = await client.reconcile(
                [
                    wire.ReconcileEntry(
                        task_id=e.task_id, attempt=e.attempt, lease_token=e.lease_token
                    )
                    for e in entries
                ]
            )
        verdicts = {(v.task_id, v.attempt): v for v in result.verdicts}
        confirmed = discarded = resumed = 0
        for entry in entries:
            verdict = verdicts.get(entry.key)
            att = self._attempts.get(entry.key)
            if verdict is None or verdict.verdict != "confirmed":
                discarded += 1
                reason = verdict.reason if verdict is not None else "no verdict"
                log.info(
                    "journal_entry_discarded",
                    task_id=entry.task_id,
                    attempt=entry.attempt,
                    reason=reason,
                )
                if att is not None:
                    self._lease_lost(att, f"reconcile: {reason or 'discard'}")
                else:
                    await self._journal_calls.call(journal.remove, entry.task_id, entry.attempt)
                continue
            confirmed += 1
            if att is not None:
                if verdict.cancel_requested:
                    self._request_cancel(att)
                continue
            resumed += 1
            self._resume(entry, cancel_requested=verdict.cancel_requested)
        log.info(
            "reconcile_done",
            host_id=self.config.host_id,
            generation=result.generation,
            entries=len(entries),
            confirmed=confirmed,
            discarded=discarded,
            resumed=resumed,
        )

    def _resume(self, entry: JournalRecord, *, cancel_requested: bool) -> None:
        att = _Attempt(record=entry, resumed=True)
        try:
            self._mark(entry.device_id, busy=True)
            att.holds_device = True
            self._held.add(entry.device_id)
        except UnknownDevice:
            if entry.state is not EntryState.FINISHED:
                # Cannot run it here any more: say so; the retry policy acts.
                att.unrunnable = f"device {entry.device_id!r} is no longer attached"
        self._attempts[entry.key] = att
        log.info(
            "attempt_resumed",
            task_id=entry.task_id,
            attempt=entry.attempt,
            device_id=entry.device_id,
            state=str(entry.state),
            resumes=entry.resumes,
        )
        if cancel_requested:
            self._request_cancel(att)
        att.task = asyncio.ensure_future(self._execute(att))

    async def _wait_ready(self, *aborts: asyncio.Event | None) -> None:
        if self._ready.is_set():
            return
        stops = [a for a in aborts if a is not None]
        while not self._ready.is_set():
            await self._sleep(3600.0, self._ready, *stops)
            if any(a.is_set() for a in stops):
                raise _Aborted()

    async def _call(
        self,
        fn: Callable[[HostClient], Awaitable[T]],
        *,
        abort: asyncio.Event | None = None,
        timeout_s: float | None = None,
        give_up: asyncio.Event | None = None,
    ) -> T:
        """A signed request on the current session. On ``unauthorized`` the session
        is re-established (once for everyone) and the request repeated, at most
        ``_MAX_SESSION_RETRIES`` times; a local timeout becomes ``unavailable``.
        ``abort`` and ``give_up`` end a wait for the session (``_Aborted``); a
        request already sent runs to its reply or timeout."""
        client = self._client_or_fail()
        tries = 0
        while True:
            await self._wait_ready(abort, give_up)
            epoch = self._epoch
            try:
                if timeout_s is None:
                    return await fn(client)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the
                # request in a task of its own, a task per request for nothing.
                try:
                    async with asyncio.timeout(timeout_s):
                        return await fn(client)
                except TimeoutError:
                    raise RemoteError("unavailable", "no reply within the timeout") from None
            except RemoteError as exc:
                if exc.code != "unauthorized" or tries >= _MAX_SESSION_RETRIES:
                    raise
                tries += 1
                log.info("session_invalid", host_id=self.config.host_id, error=exc.message)
                self._request_resync("unauthorized", epoch)

    # --- heartbeat ----------------------------------------------------------------------
    def _snapshot(self) -> list[wire.Device]:
        # While stopping, every device is reported offline so that the control
        # plane assigns nothing more to this host.
        return [
            wire.Device(
                device_id=d.device_id,
                state="offline" if self._stopping.is_set() else d.state,
                capabilities=dict(d.capabilities),
            )
            for d in self.devices.snapshot()
        ]

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._wait_ready()
            client = self._client_or_fail()
            period = self.config.heartbeat_s or client.heartbeat_s or 5.0
            changed = await self._sleep(period, self._devices_changed)
            if not changed:
                # Pick up attached/detached devices (adb); a change sets the
                # event again through the callback and is sent next round.
                await self.devices_refresh()
            self._devices_changed.clear()
            await self._send_heartbeat()

    async def _send_heartbeat(self) -> None:
        try:
            await self._call(
                lambda c: c.heartbeat(self._snapshot()), timeout_s=self.config.request_timeout_s
            )
            self.stats.heartbeats_sent += 1
        except RemoteError as exc:
            log.warning(
                "heartbeat_failed", host_id=self.config.host_id, code=exc.code, error=exc.message
            )

    # --- claiming ---------------------------------------------------------------------------
    async def _claim_dispatcher(self) -> None:
        """Keep every idle device covered by one outstanding claim."""
        try:
            while not self._stopping.is_set():
                await self._wait_ready()
                self._wake.clear()
                devices_now = self.devices.snapshot()
                idle = {d.device_id for d in devices_now if d.state == "idle"}
                # A device whose attempt is reporting its result is claimed for
                # now: the control plane frees and assigns it again at the
                # result's commit, and a claim parked for it takes the new
                # assignment at once, not after the report's answer, the
                # journal clean-up and a new claim's round trip.
                claimable = (idle - self._held) | (self._releasing - self._handover.keys())
                uncovered = sorted(claimable - self._covered.keys())
                size = max(1, -(-len(devices_now) // self.config.claim_polls))
                for i in range(0, len(uncovered), size):
                    devices = uncovered[i : i + size]
                    number = next(self._poll_numbers)
                    self._covered.update(dict.fromkeys(devices, number))
                    self._claims[number] = tuple(devices)
                    poll = asyncio.ensure_future(self._poll(devices, number))
                    self._polls.add(poll)
                    poll.add_done_callback(self._polls.discard)
                await self._sleep(3600.0, self._wake)  # a stop sets it too
        finally:
            for poll in list(self._polls):
                poll.cancel()
            if self._polls:
                await asyncio.gather(*self._polls, return_exceptions=True)

    def _uncover(self, devices: Iterable[str], number: int) -> None:
        """Those of ``devices`` still covered by claim ``number`` are not any more
        (a newer claim may cover some of them already: they stay its own)."""
        freed = False
        for d in devices:
            if self._covered.get(d) == number:
                del self._covered[d]
                freed = True
        if freed:
            self._wake.set()

    async def _poll(self, devices: list[str], number: int) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            try:
                try:
                    assignment = await self._call(lambda c: c.claim(cfg.claim_wait_s, devices))
                finally:
                    self._claims.pop(number, None)  # answered, refused or cut short
            except RemoteError as exc:
                delay = self._claim_backoff.next_delay()
                log.warning(
                    "claim_failed",
                    host_id=cfg.host_id,
                    code=exc.code,
                    error=exc.message,
                    retry_in_s=round(delay, 3),
                )
                await self._sleep(delay, self._stopping)
                return
            self._claim_backoff.reset()
            if assignment is None:
                remaining = cfg.min_poll_interval_s - (loop.time() - started)
                if remaining > 0:
                    await self._sleep(remaining, self._stopping)
                return
            # The claim's other devices may be claimed for again at once, not
            # after this assignment's journal write: several tasks reaching one
            # host together no longer wait for each other's. (``_accept`` marks
            # the assigned device held before it first yields.)
            self._uncover(devices, number)
            await self._accept(assignment, devices)
        finally:
            self._uncover(devices, number)

    async def _accept(self, a: wire.Assignment, devices: list[str]) -> None:
        fields = {"task_id": a.task_id, "attempt": a.attempt, "device_id": a.device_id}
        handed = False
        if (
            a.device_id in devices
            and a.device_id in self._releasing
            and a.device_id not in self._handover
            and (a.task_id, a.attempt) not in self._attempts
        ):
            # The device's last attempt is still reporting: the control plane
            # assigned it again, so it has that result; wait for the report's
            # answer, then take the device over from it.
            await self._take_over(a.device_id)
            handed = True
        elif (
            a.device_id not in devices
            or a.device_id in self._held
            or (a.task_id, a.attempt) in self._attempts
        ):
            # Not ours to run: leave it unacked; the ack deadline returns it.
            log.warning("assignment_declined", reason="unexpected device", **fields)
            return
        try:
            self._mark(a.device_id, busy=True)
        except UnknownDevice:
            if handed:
                self._held.discard(a.device_id)
                self._wake.set()
            log.warning("assignment_declined", reason="unknown device", **fields)
            return
        self._held.add(a.device_id)
        record = JournalRecord(
            task_id=a.task_id,
            attempt=a.attempt,
            lease_id=a.lease_id,
            lease_token=a.lease_token,
            device_id=a.device_id,
            kind=a.kind,
            goal=a.goal,
            workflow=a.workflow,
            payload=dict(a.payload),
            lease_s=a.lease_s if a.lease_s > 0 else 30.0,
            created_at=datetime.now(UTC),
        )
        journal = self._journal_or_fail()
        try:
            async with self._journal_lock:
                await self._journal_calls.call(journal.add, record)
        except JournalError as exc:
            # Without a durable entry there is no ack: the attempt returns to the
            # control plane at its ack deadline.
            log.error("journal_write_failed", error=exc.message, **fields)
            self._held.discard(a.device_id)
            self._mark(a.device_id, busy=False)
            return
        self.stats.assignments += 1
        log.info(
            "assignment_received",
            kind=str(a.kind),
            lease_id=a.lease_id,
            lease_s=a.lease_s,
            **fields,
        )
        self._failpoint(FAILPOINT_AFTER_JOURNAL_ADD, **fields)
        att = _Attempt(record=record, ack_deadline=a.ack_deadline, holds_device=True)
        self._attempts[record.key] = att
        att.task = asyncio.ensure_future(self._execute(att))

    async def _take_over(self, device_id: str) -> None:
        """Wait until the attempt reporting on ``device_id`` passes the device on
        (held and busy). Cancelled (the agent stops), it leaves the device to be
        freed as usual, or frees it if it was passed on already."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._handover[device_id] = fut
        self.stats.handovers_waited += 1
        try:
            await fut
        except asyncio.CancelledError:
            if self._handover.get(device_id) is fut:
                del self._handover[device_id]
            elif fut.done() and not fut.cancelled():
                with contextlib.suppress(UnknownDevice):
                    self._free(device_id)  # passed on to nobody now
            raise

    def _free(self, device_id: str) -> None:
        """The held ``device_id`` is free again (idle, claimable)."""
        self._held.discard(device_id)
        self._mark(device_id, busy=False)
        self._wake.set()

    # --- one attempt ------------------------------------------------------------------------
    def _request_cancel(self, att: _Attempt) -> None:
        if not att.cancel_requested:
            att.cancel_requested = True
            log.info("cancel_requested", task_id=att.record.task_id, attempt=att.record.attempt)
            att.cancel_event.set()

    def _lease_lost(self, att: _Attempt, reason: str) -> None:
        """The lease is gone: stop the runner; the journal entry may go."""
        if self._stop_attempt(att, reason, "lease_lost"):
            att.entry_done = True
            self.stats.leases_lost += 1

    def _stop_attempt(self, att: _Attempt, reason: str, event: str) -> bool:
        """Mark the attempt lost and wake its runner (once): False if it already was."""
        if att.lost.is_set():
            return False
        att.lose(reason)
        log.warning(
            event,
            task_id=att.record.task_id,
            attempt=att.record.attempt,
            device_id=att.record.device_id,
            reason=reason,
        )
        att.cancel_event.set()
        return True

    async def _execute(self, att: _Attempt) -> None:
        rec = att.record
        journal = self._journal_or_fail()
        try:
            if att.unrunnable is None and att.resumed and rec.state is not EntryState.FINISHED:
                att.unrunnable = await self._count_resume(att)
            if att.unrunnable is not None:
                await self._record(att, RunOutcome.failed(att.unrunnable, retryable=True))
            elif rec.state is not EntryState.FINISHED:
                if rec.state is EntryState.ACCEPTED:
                    if not await self._ack(att):
                        return
                    await self._journal_calls.call(journal.mark_running, rec.task_id, rec.attempt)
                outcome = await self._run(att)
                if outcome is None:
                    return
                await self._record(att, outcome)
            if att.holds_device:
                self._releasing.add(rec.device_id)
                self._wake.set()
            await self._report(att)
        except _Aborted:
            pass
        except Exception as exc:
            # A local failure (journal write, a bug): unless the attempt is
            # already settled, its journal entry stays for the next start to
            # reconcile; the device is freed either way.
            log.error(
                "attempt_crashed",
                task_id=rec.task_id,
                attempt=rec.attempt,
                error_type=type(exc).__name__,
                error=str(exc)[:500],
                exc_info=exc,
            )
        finally:
            if att.renewer is not None:
                att.renewer.cancel()
            if att.entry_done:
                with contextlib.suppress(JournalError):
                    await self._journal_calls.call(journal.remove, rec.task_id, rec.attempt)
            self._attempts.pop(rec.key, None)
            if att.holds_device:
                self._releasing.discard(rec.device_id)
                successor = self._handover.pop(rec.device_id, None)
                if successor is not None and not successor.done():
                    successor.set_result(None)  # held and busy, by the next attempt
                else:
                    self._held.discard(rec.device_id)
                    self._mark(rec.device_id, busy=False)
            self._wake.set()

    async def _count_resume(self, att: _Attempt) -> str | None:
        """Before running a resumed attempt again: count the resume durably, or
        give the attempt up (the reason to report) when it has been resumed
        ``max_resumes`` times already, each time dying with the agent."""
        rec = att.record
        if rec.resumes >= self.config.max_resumes:
            deaths = rec.resumes + 1
            reason = f"agent died {deaths} time{'s' if deaths != 1 else ''} running this attempt"
            log.warning(
                "attempt_given_up",
                task_id=rec.task_id,
                attempt=rec.attempt,
                device_id=rec.device_id,
                resumes=rec.resumes,
                reason=reason,
            )
            return reason
        journal = self._journal_or_fail()
        count = await self._journal_calls.call(journal.begin_resume, rec.task_id, rec.attempt)
        log.info("attempt_resume_counted", task_id=rec.task_id, attempt=rec.attempt, resumes=count)
        return None

    async def _ack(self, att: _Attempt) -> bool:
        rec = att.record
        # Set at the claim's ack deadline (wall clock, like the control plane's):
        # past it the control plane refuses the ack anyway, so stop retrying.
        overdue = asyncio.Event()
        timer: asyncio.TimerHandle | None = None
        if att.ack_deadline is not None:
            timer = asyncio.get_running_loop().call_later(
                max(att.ack_deadline - time.time(), 0.0), overdue.set
            )
        try:
            reply = await self._ack_until_answered(att, overdue)
        finally:
            if timer is not None:
                timer.cancel()
        if reply is None:
            return False
        log.info(
            "attempt_acked",
            task_id=rec.task_id,
            attempt=rec.attempt,
            state=str(reply.state),
            cancel_requested=reply.cancel_requested,
        )
        self._failpoint(FAILPOINT_AFTER_ACK, task_id=rec.task_id, attempt=rec.attempt)
        if reply.cancel_requested:
            self._request_cancel(att)
        return True

    async def _ack_until_answered(
        self, att: _Attempt, overdue: asyncio.Event
    ) -> wire.LeaseReply | None:
        """The ack's reply; None if the lease is lost or the ack is given up.
        Once the session is up the first ack is always sent and waited for in
        full (a clock running ahead of the control plane's must not lose every
        ack); no retry, nor a wait for a session, goes on past ``overdue``."""
        rec = att.record
        backoff = Backoff(self.config.backoff_base_s, self.config.backoff_cap_s, rng=self._rng)
        sent = False
        while not att.lost.is_set():
            if sent and overdue.is_set():
                self._ack_given_up(att, "ack unanswered at the ack deadline")
                return None
            try:
                return await self._call(
                    lambda c: c.ack(rec.task_id, rec.attempt, rec.lease_token),
                    abort=att.lost,
                    timeout_s=self.config.request_timeout_s,
                    give_up=overdue,
                )
            except _Aborted:
                if att.lost.is_set():
                    raise
                self._ack_given_up(att, "no session to ack on by the ack deadline")
                return None
            except RemoteError as exc:
                sent = True
                if exc.code not in _TRANSIENT_CODES:
                    self._lease_lost(att, f"ack refused: {exc.code}")
                    return None
                if overdue.is_set():
                    continue  # given up at the top of the loop
                delay = backoff.next_delay()
                log.warning(
                    "ack_failed",
                    task_id=rec.task_id,
                    attempt=rec.attempt,
                    code=exc.code,
                    retry_in_s=round(delay, 3),
                )
                await self._sleep(delay, att.lost, overdue)
        return None

    def _ack_given_up(self, att: _Attempt, reason: str) -> None:
        """Stop trying to ack: the runner never starts. Unlike a lost lease the
        journal entry stays, for the next reconciliation to settle (discarded
        if the control plane expired the attempt, resumed if an ack got through
        just in time)."""
        if self._stop_attempt(att, reason, "ack_given_up"):
            self.stats.acks_given_up += 1

    def _context(self, att: _Attempt) -> RunContext:
        rec = att.record

        def log_line(line: str) -> None:
            self._in_loop(lambda: self._enqueue_log(att, str(line)))

        def artifact(name: str, data: bytes) -> None:
            item = _ArtifactItem(rec.task_id, rec.attempt, rec.lease_token, str(name), bytes(data))
            self._in_loop(lambda: self._enqueue_artifact(item))

        def progress(message: str) -> None:
            def apply() -> None:
                att.progress_message = str(message)[:_MAX_PROGRESS]

            self._in_loop(apply)

        return RunContext(
            task_id=rec.task_id,
            attempt=rec.attempt,
            device_id=rec.device_id,
            kind=rec.kind,
            goal=rec.goal,
            workflow=rec.workflow,
            payload=rec.payload,
            log=log_line,
            artifact=artifact,
            progress=progress,
            cancelled=att.cancel_event,
        )

    async def _run(self, att: _Attempt) -> RunOutcome | None:
        """Run the runner while renewing; None if the lease was lost."""
        rec = att.record
        runner = self._runners[rec.kind]
        log.info(
            "attempt_started",
            task_id=rec.task_id,
            attempt=rec.attempt,
            device_id=rec.device_id,
            kind=str(rec.kind),
        )
        run_task: asyncio.Task[RunOutcome] = asyncio.ensure_future(runner.run(self._context(att)))
        att.renewer = renew_task = asyncio.ensure_future(self._renew_loop(att))
        loop = asyncio.get_running_loop()
        cancel_deadline: float | None = None
        try:
            while True:
                if att.lost.is_set():
                    run_task.cancel()
                    with contextlib.suppress(BaseException):
                        await run_task
                    return None
                if run_task.done():
                    break
                if att.cancel_event.is_set() and cancel_deadline is None:
                    cancel_deadline = loop.time() + self.config.cancel_timeout_s
                timeout = None if cancel_deadline is None else cancel_deadline - loop.time()
                if timeout is not None and timeout <= 0:
                    log.warning("runner_ignored_cancel", task_id=rec.task_id, attempt=rec.attempt)
                    run_task.cancel()
                    with contextlib.suppress(BaseException):
                        await run_task
                    outcome = RunOutcome.cancelled("runner did not stop in time")
                    return self._final_outcome(att, outcome)
                waiters: set[asyncio.Future[Any]] = {run_task}
                lost_wait = asyncio.ensure_future(att.lost.wait())
                waiters.add(lost_wait)
                cancel_wait = None
                if not att.cancel_event.is_set():
                    cancel_wait = asyncio.ensure_future(att.cancel_event.wait())
                    waiters.add(cancel_wait)
                try:
                    await asyncio.wait(
                        waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    lost_wait.cancel()
                    if cancel_wait is not None:
                        cancel_wait.cancel()
            outcome = run_task.result()
            return self._final_outcome(att, outcome)
        finally:
            if not run_task.done():
                run_task.cancel()
                with contextlib.suppress(BaseException):
                    await run_task
            # Otherwise the renewal loop keeps running while the result is reported.
            if att.lost.is_set():
                renew_task.cancel()

    def _final_outcome(self, att: _Attempt, outcome: RunOutcome) -> RunOutcome:
        if att.handback and not att.cancel_requested and outcome.outcome is Outcome.CANCELLED:
            return RunOutcome.failed(HANDBACK_REASON, retryable=True)
        return outcome

    async def _record(self, att: _Attempt, outcome: RunOutcome) -> None:
        rec = att.record
        journal = self._journal_or_fail()
        reason = outcome.reason[:_MAX_REASON]
        # Recorded and read back in one executor call (the stored entry holds
        # the first recorded result, should there have been one already).
        try:
            stored = await self._journal_calls.call(
                journal.finish,
                rec.task_id,
                rec.attempt,
                outcome.outcome,
                outcome.retryable,
                reason,
                outcome.result,
            )
        except ValueError:
            outcome = RunOutcome.failed("runner returned a result that is not JSON data")
            reason = outcome.reason
            stored = await self._journal_calls.call(
                journal.finish,
                rec.task_id,
                rec.attempt,
                outcome.outcome,
                outcome.retryable,
                reason,
                outcome.result,
            )
        att.record = stored
        att.reporting = True
        log.info(
            "result_recorded",
            task_id=rec.task_id,
            attempt=rec.attempt,
            outcome=str(stored.outcome),
            retryable=stored.retryable,
            fingerprint=stored.fingerprint,
        )
        self._failpoint(FAILPOINT_AFTER_RESULT_RECORDED, task_id=rec.task_id, attempt=rec.attempt)

    async def _report(self, att: _Attempt) -> None:
        """Report the recorded outcome until the control plane answers."""
        rec = att.record
        assert rec.outcome is not None and rec.fingerprint is not None
        outcome, fingerprint = rec.outcome, rec.fingerprint
        att.reporting = True
        backoff = Backoff(self.config.backoff_base_s, self.config.backoff_cap_s, rng=self._rng)
        try:
            await self._flush_artifacts(att)
            while not att.lost.is_set():
                try:
                    reply = await self._call(
                        lambda c: c.result(
                            rec.task_id,
                            rec.attempt,
                            rec.lease_token,
                            outcome=str(outcome),
                            retryable=rec.retryable,
                            reason=rec.reason,
                            result=rec.result,
                            fingerprint=fingerprint,
                        ),
                        abort=att.lost,
                        timeout_s=self.config.request_timeout_s,
                    )
                except RemoteError as exc:
                    if exc.code in _TRANSIENT_CODES:
                        delay = backoff.next_delay()
                        log.warning(
                            "result_report_retry",
                            task_id=rec.task_id,
                            attempt=rec.attempt,
                            code=exc.code,
                            retry_in_s=round(delay, 3),
                        )
                        await self._sleep(delay, att.lost)
                        continue
                    att.entry_done = True
                    self.stats.results_rejected += 1
                    log.warning(
                        "result_rejected",
                        task_id=rec.task_id,
                        attempt=rec.attempt,
                        code=exc.code,
                        error=exc.message,
                    )
                    return
                self._failpoint(
                    FAILPOINT_AFTER_RESULT_REPORTED, task_id=rec.task_id, attempt=rec.attempt
                )
                att.entry_done = True
                self.stats.results_reported += 1
                log.info(
                    "result_reported",
                    task_id=rec.task_id,
                    attempt=rec.attempt,
                    outcome=str(outcome),
                    state=str(reply.state),
                    replayed=reply.replayed,
                    fingerprint=fingerprint,
                )
                return
        finally:
            if att.renewer is not None:
                att.renewer.cancel()

    async def _renew_loop(self, att: _Attempt) -> None:
        rec = att.record
        interval = max(rec.lease_s / 3.0, 0.05)
        backoff = Backoff(
            min(self.config.backoff_base_s, interval),
            max(interval, self.config.backoff_base_s),
            rng=self._rng,
        )
        delay = interval
        loop = asyncio.get_running_loop()
        # The lease as far as this agent can vouch for it: lease_s after the last
        # answered renewal, counted from when it was sent (the control plane's
        # deadline is never earlier). Past it the lease is lost even when nobody
        # can say so (a partition): stop the runner rather than run on unleased.
        valid_until = loop.time() + rec.lease_s
        while True:
            if await self._sleep(delay, att.lost):
                return
            sent = loop.time()
            try:
                reply = await self._renew_once(att, timeout_s=max(interval, 1.0))
            except _Aborted:
                return
            except RemoteError as exc:
                if exc.code in _TRANSIENT_CODES:
                    if loop.time() >= valid_until and not att.reporting:
                        self._lease_lost(att, "lease expired locally: no renewal answered")
                        return
                    delay = min(backoff.next_delay(), interval)
                    log.warning(
                        "renew_failed",
                        task_id=rec.task_id,
                        attempt=rec.attempt,
                        code=exc.code,
                        retry_in_s=round(delay, 3),
                    )
                    continue
                if att.reporting:
                    # The result answer decides now (a renewal racing the result
                    # is refused once the result is applied).
                    return
                self._lease_lost(att, f"renewal refused: {exc.code}")
                return
            backoff.reset()
            delay = interval
            valid_until = sent + rec.lease_s
            if reply.cancel_requested and not att.reporting:
                self._request_cancel(att)

    async def _renew_once(self, att: _Attempt, *, timeout_s: float) -> wire.LeaseReply:
        """One renewal: a progress report when the runner said something new
        (it extends the lease too), else a plain renew."""
        rec = att.record
        message = att.progress_message
        if message is None:
            return await self._call(
                lambda c: c.renew(rec.task_id, rec.attempt, rec.lease_token),
                abort=att.lost,
                timeout_s=timeout_s,
            )
        seq = att.progress_seq + 1
        reply = await self._call(
            lambda c: c.progress(rec.task_id, rec.attempt, rec.lease_token, seq, message),
            abort=att.lost,
            timeout_s=timeout_s,
        )
        att.progress_seq = seq
        if att.progress_message is message:
            att.progress_message = None
        return reply

    # --- logs and artifacts -----------------------------------------------------------------
    def _enqueue_log(self, att: _Attempt, line: str) -> None:
        att.log_seq += 1
        item = _LogLine(
            att.record.task_id,
            att.record.attempt,
            att.log_seq,
            _truncate_utf8(line, _LOG_LINE_MAX_BYTES),
        )
        if self._logs.put(item):
            self.stats.logs_dropped = self._logs.dropped

    def _enqueue_artifact(self, item: _ArtifactItem) -> None:
        if self._artifacts.put(item):
            self.stats.artifacts_dropped = self._artifacts.dropped
            log.warning(
                "artifact_dropped",
                task_id=item.task_id,
                attempt=item.attempt,
                dropped_total=self._artifacts.dropped,
            )

    async def _side_send(
        self, what: str, fn: Callable[[HostClient], Awaitable[None]], **fields: Any
    ) -> bool:
        """Send one log batch or artifact, retrying transient failures a few times."""
        backoff = Backoff(self.config.backoff_base_s, self.config.backoff_cap_s, rng=self._rng)
        for _ in range(_SIDE_CHANNEL_ATTEMPTS):
            try:
                await self._call(fn)
                return True
            except RemoteError as exc:
                if exc.code not in _TRANSIENT_CODES and exc.code not in _SIDE_RETRY_CODES:
                    log.warning(f"{what}_rejected", code=exc.code, error=exc.message, **fields)
                    return False
                await asyncio.sleep(backoff.next_delay())
        log.warning(f"{what}_gave_up", **fields)
        return False

    async def _ship_logs(self) -> None:
        while True:
            await self._logs.wait()
            batch = self._pop_log_batch()
            if not batch:
                continue
            self._shipping_logs = len(batch)
            try:
                await self._send_log_batch(batch)
            finally:
                self._shipping_logs = 0

    async def _send_log_batch(self, batch: list[_LogLine]) -> None:
        first = batch[0]
        lines = [b.line for b in batch]
        sent = await self._side_send(
            "logs",
            lambda c: c.append_logs(first.task_id, first.attempt, first.seq, lines),
            task_id=first.task_id,
            attempt=first.attempt,
            lines=len(lines),
        )
        if sent:
            self.stats.log_lines_sent += len(lines)
        else:
            self._logs.dropped += len(lines)
            self.stats.logs_dropped = self._logs.dropped

    def _pop_log_batch(self) -> list[_LogLine]:
        """Leading lines of one attempt with consecutive seqs, within the size limits."""
        batch: list[_LogLine] = []
        size = 0
        while len(self._logs):
            head = self._logs.peek()
            if batch and (
                head.key != batch[0].key
                or head.seq != batch[-1].seq + 1
                or len(batch) >= wire.MAX_LOG_LINES
                or size + len(head.line) * 4 > _LOG_BATCH_BYTES
            ):
                break
            batch.append(self._logs.popleft())
            size += len(head.line.encode("utf-8", "replace")) + 8
        return batch

    async def _ship_artifacts(self) -> None:
        while True:
            await self._artifacts.wait()
            item = self._artifacts.popleft()
            self._shipping_artifacts = 1
            self._shipping_artifact = (item.task_id, item.attempt)
            try:
                await self._send_artifact(item)
            finally:
                self._shipping_artifacts = 0
                self._shipping_artifact = None
                self._artifact_shipped.set()

    def _artifacts_pending(self, key: tuple[str, int]) -> bool:
        return self._shipping_artifact == key or any(
            (i.task_id, i.attempt) == key for i in self._artifacts
        )

    async def _flush_artifacts(self, att: _Attempt) -> None:
        """Wait (up to ``artifact_flush_s``) until the attempt's queued artifacts
        are shipped: the control plane takes them only while the lease is held,
        and the result ends the lease. Not for a handed-back attempt: its report
        must go out within the shutdown's ``handback_timeout_s``."""
        if att.handback:
            return
        rec = att.record
        key = (rec.task_id, rec.attempt)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.artifact_flush_s
        while self._artifacts_pending(key) and not att.lost.is_set():
            left = deadline - loop.time()
            if left <= 0:
                log.warning("artifact_flush_timed_out", task_id=rec.task_id, attempt=rec.attempt)
                return
            self._artifact_shipped.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._artifact_shipped.wait(), min(left, 1.0))

    async def _send_artifact(self, item: _ArtifactItem) -> None:
        sent = await self._side_send(
            "artifact",
            lambda c: c.upload_artifact(
                item.task_id, item.attempt, item.lease_token, item.name, item.data
            ),
            task_id=item.task_id,
            attempt=item.attempt,
            name=item.name,
        )
        if sent:
            self.stats.artifacts_sent += 1
            log.info(
                "artifact_uploaded",
                task_id=item.task_id,
                attempt=item.attempt,
                name=item.name,
                size=len(item.data),
            )
        else:
            self._artifacts.dropped += 1
            self.stats.artifacts_dropped = self._artifacts.dropped

    # --- shutdown ---------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        cfg = self.config
        log.info("agent_stopping", host_id=cfg.host_id, running=len(self._attempts))
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        await self._cancel_polls()
        if self._ready.is_set():
            await self._send_heartbeat()  # every device offline from now on
        pending = [a.task for a in self._attempts.values() if a.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=cfg.grace_s)
        late = [a for a in self._attempts.values() if a.task is not None and not a.task.done()]
        for att in late:
            att.handback = True
            self.stats.handed_back += 1
            log.info(
                "attempt_handed_back",
                task_id=att.record.task_id,
                attempt=att.record.attempt,
                reporting=att.reporting,
            )
            att.cancel_event.set()
        tasks = [a.task for a in late if a.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=cfg.cancel_timeout_s + cfg.handback_timeout_s)
            for t in tasks:
                if not t.done():
                    # Its journal entry stays: the next start reconciles it.
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._flush(cfg.flush_timeout_s)

    async def _cancel_polls(self) -> None:
        for poll in list(self._polls):
            poll.cancel()
        if self._polls:
            await asyncio.gather(*list(self._polls), return_exceptions=True)

    async def _flush(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (
            len(self._logs)
            or len(self._artifacts)
            or self._shipping_logs
            or self._shipping_artifacts
        ) and loop.time() < deadline:
            if not self._ready.is_set():
                break
            await asyncio.sleep(0.02)

    async def _teardown(self) -> None:
        for att in list(self._attempts.values()):
            if att.task is not None and not att.task.done():
                att.task.cancel()
        tasks = [a.task for a in self._attempts.values() if a.task is not None]
        background = list(self._background)
        for t in background:
            t.cancel()
        await self._cancel_polls()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        await self._journal_calls.stop()
        if self._owns_journal and self._journal is not None:
            self._journal.close()
        log.info(
            "agent_stopped",
            host_id=self.config.host_id,
            results_reported=self.stats.results_reported,
            leases_lost=self.stats.leases_lost,
            handed_back=self.stats.handed_back,
            logs_dropped=self._logs.dropped,
            artifacts_dropped=self._artifacts.dropped,
        )


def load_credential(path: str | os.PathLike[str]) -> str:
    """The host credential from ``path`` (surrounding whitespace ignored).
    ValueError without echoing the content when it is not 64 hex characters."""
    text = Path(path).read_text(encoding="utf-8").strip().lower()
    if _HEX64.fullmatch(text) is None:
        raise ValueError(f"{path}: expected the 64 hex character host credential")
    return text
