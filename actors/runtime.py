"""``ControlPlane``: the asyncio-side facade of the actor system, used by
``transport/server.py``.

Every method is a coroutine on the caller's event loop and never blocks it: the
facade talks to actors only with ``tell`` plus a :class:`~actors.bridge.Reply`
(completed by the actor with ``call_soon_threadsafe``), and every await has a
timeout (``ask_timeout_s``) after which the caller gets the retryable
``Unavailable``. A message for a dead actor is ``Unavailable`` too, never a hang.

Routing of host messages about a task (claim, ack, progress, result) and of a
user's cancel of an in-flight task: through the task's Lease actor, one at a
time. When there is none (restart, crash, or the task is
not active), the facade looks the task up among the host's active attempts in
the database: found, it starts a Lease actor from that row; not found, there is
nothing to serialise with, and the repository answers directly (its fencing
gives the typed error: unknown task ``NotFound``, stale attempt ``Conflict``,
terminal ``Gone``, or a replayed result with ``replayed=True``).

Decisions documented here:

* Renewals and cancel polls do not pass through the Lease actor: they go
  straight to the ``RenewBatcher`` on the loop (written through, committed
  before the reply, fenced by the repository like every message). A renewal
  changes nothing the actor keeps but the deadline in its cache, and two
  cross-thread hops per renewal would be most of its cost with thousands of
  actors. The actor is told (``Renewed``) when an answer does say something
  it must act on: a pending cancel.

* ``cancel_poll`` is a fenced renewal: it extends the lease exactly like
  ``renew`` and returns the current ``cancel_requested``. A host polling for a
  cancel is alive, and reading the intent under the same fencing as a renewal
  needs no extra repository verb.
* ``register``, ``heartbeat`` and ``reconcile`` are host-level, not about one
  task: they go to the repository directly; afterwards the facade tells the
  Lease actors of attempts a reconcile ended, and wakes the Scheduler.
* Task events (``add_listener``) are dispatched on the loop, never before the
  commit of the transition they report. They are notifications, not a log: a
  crash between a commit and its event loses that event, and a Lease actor
  rebuilt from the database (which does not say whether an attempt is assigned,
  dispatched or running) may repeat one. The database is the record.
* Threads: ``start()`` sets ``threading.stack_size(stack_size)`` (default
  256 KiB) for the whole process before starting any actor. An actor thread
  only runs handler code and waits for the loop, so a small stack is enough,
  and thousands of Lease actors then cost little memory. It is process-wide
  (Python has no per-thread setting), so other threads started later get the
  same size; pass ``stack_size=None`` to leave it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from pykka import ActorDeadError, ActorRef

from fleetlease.actors.base import LEASE_THREADS, Context, NotDelivered, Stats
from fleetlease.actors.bridge import Bridge, Reply
from fleetlease.actors.groupcommit import RenewBatcher, TransitionBatcher
from fleetlease.actors.lease import LeaseActor
from fleetlease.actors.messages import (
    Ack,
    Cancel,
    CancelPoll,
    Claim,
    Committed,
    Message,
    Progress,
    Renew,
    Renewed,
    ReportResult,
)
from fleetlease.actors.supervisor import Supervisor
from fleetlease.persistence.clock import Clock
from fleetlease.persistence.errors import (
    Conflict,
    Gone,
    Invalid,
    RepositoryError,
    Unavailable,
)
from fleetlease.persistence.model import (
    Assignment,
    CancelRecord,
    Claimed,
    DeviceSnapshot,
    HostAdvert,
    JournalEntry,
    LeaseStatus,
    LeaseTimings,
    Outcome,
    ReconcileReport,
    ResultRecord,
    Session,
    TaskSpec,
    TaskState,
    User,
)
from fleetlease.persistence.repository import Renewal, Repository

log = structlog.get_logger("fleetlease.runtime")

T = TypeVar("T")

DEFAULT_STACK_SIZE = 256 * 1024

#: How often a message the Lease actor never handled is re-sent to its replacement.
_REDELIVERIES = 3
#: How long an empty read of a host's pending assignments on some devices is
#: trusted (see ``ControlPlane.claim``).
_KNOWN_EMPTY_S = 1.0
#: Assignments kept per host that no long-poll was parked to take.
_UNHANDED_MAX = 1024
#: New assignments one long-poll holds at most (it claims one; the others are
#: its fallbacks if that claim loses a race). Past it they are kept for the
#: host's next polls: otherwise a host given a thousand assignments at once has
#: them spread over its few parked polls, and every claim sorts and hands back
#: hundreds of them.
_HINTS_PER_POLL = 2


class _InFlight:
    """See ``ControlPlane._request``."""

    __slots__ = ("_cp",)

    def __init__(self, cp: ControlPlane) -> None:
        self._cp = cp

    async def __aenter__(self) -> None:
        self._cp._enter_request()

    async def __aexit__(self, *exc: object) -> None:
        self._cp._exit_request()


class _Kept:
    """A host's assignments no long-poll was parked to take, in the order they
    were kept, indexed by device: taking a few costs a few, not the whole list
    (a thousand kept, every poll walked them all)."""

    __slots__ = ("by_device", "order")

    def __init__(self) -> None:
        self.order: dict[tuple[str, int], Assignment] = {}
        self.by_device: dict[str, dict[tuple[str, int], Assignment]] = {}

    def __len__(self) -> int:
        return len(self.order)

    def add(self, a: Assignment) -> None:
        key = (a.task_id, a.attempt)
        self.order[key] = a
        self.by_device.setdefault(a.device_id, {})[key] = a

    def take(self, wanted: frozenset[str] | None, limit: int) -> list[Assignment]:
        """At most ``limit`` that a poll for ``wanted`` (None: any device) may
        claim, removed: the first kept first, or, for a poll naming fewer
        devices than are kept, the earliest claim deadlines of its devices."""
        if limit <= 0 or not self.order:
            return []
        mine: list[Assignment] = []
        if wanted is not None and len(wanted) < len(self.order):
            for d in wanted:
                mine.extend(self.by_device.get(d, {}).values())
            mine.sort(key=lambda a: a.claim_deadline)
            del mine[limit:]
        else:
            for a in self.order.values():
                if wanted is None or a.device_id in wanted:
                    mine.append(a)
                    if len(mine) == limit:
                        break
        for a in mine:
            key = (a.task_id, a.attempt)
            del self.order[key]
            on_device = self.by_device[a.device_id]
            del on_device[key]
            if not on_device:
                del self.by_device[a.device_id]
        return mine


@dataclass(eq=False)
class _Waiter:
    """A parked long-poll: the devices it claims for (None: any device of the
    host), its session, and the new assignments ``wake_hosts`` handed to it to
    claim.

    While ``parked`` (waiting, nothing in hand), an assignment pass may take it
    as a claimer (``reserved``, see ``ControlPlane._assign_pass``): the poll
    then waits for the pass to settle that future, and answers with
    ``claimed`` if the pass claimed an assignment for it."""

    wanted: frozenset[str] | None
    session: Session
    hints: list[Assignment] = field(default_factory=list)
    parked: bool = False
    reserved: asyncio.Future[None] | None = None
    claimed: Claimed | None = None
    #: The poll stopped waiting for good (cancelled): nothing can answer it.
    gone: bool = False

    @property
    def generation(self) -> int:
        return self.session.generation

    def may_claim(self, device_id: str) -> bool:
        return self.wanted is None or device_id in self.wanted


class ControlPlane:
    """The facade. Construct, ``await start()``, serve, ``await stop()``."""

    def __init__(
        self,
        repo: Repository,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        clock: Clock | None = None,
        timings: LeaseTimings | None = None,
        scheduler_interval_s: float = 1.0,
        assign_batch: int = 64,
        ask_timeout_s: float = 30.0,
        db_timeout_s: float = 15.0,
        reaper_max_sleep_s: float = 5.0,
        group_commit: bool = True,
        stack_size: int | None = DEFAULT_STACK_SIZE,
    ) -> None:
        if not isinstance(repo, Repository):
            raise TypeError(f"repo must be a Repository, got {type(repo).__name__}")
        for name, value in (
            ("scheduler_interval_s", scheduler_interval_s),
            ("ask_timeout_s", ask_timeout_s),
            ("db_timeout_s", db_timeout_s),
            ("reaper_max_sleep_s", reaper_max_sleep_s),
        ):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if assign_batch < 1:
            raise ValueError(f"assign_batch must be >= 1, got {assign_batch!r}")
        if stack_size is not None and stack_size < 32 * 1024:
            raise ValueError(f"stack_size must be None or >= 32 KiB, got {stack_size!r}")
        self.repo = repo
        self.clock: Clock = clock or repo.clock
        self.timings = timings or repo.timings
        self.scheduler_interval_s = float(scheduler_interval_s)
        self.assign_batch = assign_batch
        self.ask_timeout_s = float(ask_timeout_s)
        self.db_timeout_s = float(db_timeout_s)
        self.reaper_max_sleep_s = float(reaper_max_sleep_s)
        self.group_commit = group_commit
        self.stack_size = stack_size
        self._loop = loop
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        #: Parked long-polls per host: the future that wakes each, and what it
        #: may claim and was handed.
        self._waiters: dict[str, dict[asyncio.Future[None], _Waiter]] = {}
        self._host_wakeups = 0
        #: Assignments a long-poll of this process is claiming right now.
        self._claiming: set[tuple[str, int]] = set()
        #: New assignments ``_hand`` found no parked long-poll for, per host: the
        #: next poll of the host claims them without a read.
        self._unhanded: dict[str, _Kept] = {}
        #: Per host: the session generation and, per device, until when (loop
        #: time) this process knows the device has no pending assignment that is
        #: not in ``_unhanded`` or in a poll's hands (an empty read, and every
        #: assignment since passed through ``_hand``).
        self._known_empty: dict[str, tuple[int, dict[str, float]]] = {}
        #: Bumped whenever something known is forgotten: a read that overlapped
        #: a forget does not mark anything known.
        self._forgets = 0
        self._inflight = 0
        self._in_flight = _InFlight(self)
        self._idle: asyncio.Event | None = None
        self._accepting = False
        self._started = False
        self._ticker: asyncio.Task[None] | None = None
        self._batcher: RenewBatcher | None = None
        self._tbatcher: TransitionBatcher | None = None
        self._ctx: Context | None = None
        self._sup: Supervisor | None = None
        self.stats = Stats()

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("ControlPlane is not started")
        return self._loop

    @property
    def supervisor(self) -> Supervisor:
        if self._sup is None:
            raise RuntimeError("ControlPlane is not started")
        return self._sup

    async def start(self) -> None:
        """Start the supervisor, Scheduler and Reaper, and a Lease actor for every
        active attempt in the database."""
        if self._started:
            raise RuntimeError("ControlPlane.start() called twice")
        running = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = running
        elif self._loop is not running:
            raise RuntimeError("start() must run on the ControlPlane's loop")
        if self.stack_size is not None:
            threading.stack_size(self.stack_size)
        bridge = Bridge(self._loop)
        self._batcher = RenewBatcher(self.repo) if self.group_commit else None
        self._tbatcher = TransitionBatcher(self.repo) if self.group_commit else None
        self._ctx = Context(
            repo=self.repo,
            bridge=bridge,
            clock=self.clock,
            db_timeout_s=self.db_timeout_s,
            assign_batch=self.assign_batch,
            reaper_max_sleep_s=self.reaper_max_sleep_s,
            reaper_idle_recheck_s=self.scheduler_interval_s,
            emit=self._emit_threadsafe,
            emit_on_loop=self._dispatch,
            wake_hosts=self._wake_hosts_threadsafe,
            renew=self._batcher.renew if self._batcher is not None else None,
            transition=self._tbatcher.run if self._tbatcher is not None else None,
            assign=self._assign_pass,
            stats=self.stats,
        )
        sup = Supervisor(self._ctx)
        self._sup = sup
        mark = sup.mark()
        actives = await self._bounded(self.repo.active_attempts())
        sup.start()
        sup.reconcile_leases(actives, mark, verify=False)
        self._idle = asyncio.Event()
        self._idle.set()
        self._accepting = True
        self._started = True
        self._ticker = self._loop.create_task(self._tick_loop())
        log.info("control_plane.started", active_attempts=len(actives))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Graceful: refuse new work, let in-flight requests finish (long-polls
        return None at once), then stop every actor after its queued messages."""
        if not self._started or self._sup is None:
            return
        self._accepting = False
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for waiters in self._waiters.values():
            for w in waiters:
                if not w.done():
                    w.set_result(None)
        if self._idle is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        refs = self._sup.shutdown()
        await self.loop.run_in_executor(None, Supervisor.stop_actors, refs, grace_s)
        for batcher in (self._batcher, self._tbatcher):
            if batcher is not None:
                await batcher.close()
        self._started = False
        log.info("control_plane.stopped")

    async def _tick_loop(self) -> None:
        sup = self.supervisor
        while True:
            await asyncio.sleep(self.scheduler_interval_s)
            try:
                sup.check()
                sup.wake_scheduler(force=True)
            except Exception as exc:  # the timer must survive anything
                log.error("control_plane.tick_failed", error=repr(exc))

    # --- introspection ----------------------------------------------------------------------
    @property
    def host_wakeups(self) -> int:
        """How many long-poll waiters were woken by a new assignment."""
        return self._host_wakeups

    @property
    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = dict(self.stats.snapshot())
        m["host_wakeups"] = self._host_wakeups
        m["lease_actors"] = self._sup.lease_count() if self._sup is not None else 0
        m["inflight"] = self._inflight
        m["lease_threads_started"] = LEASE_THREADS.started
        m["lease_actors_on_reused_threads"] = LEASE_THREADS.reused
        if self._batcher is not None:
            m["renew_batches"] = self._batcher.batches
            m["renewals_batched"] = self._batcher.renewals
        if self._tbatcher is not None:
            m["transition_batches"] = self._tbatcher.batches
            m["transitions_batched"] = self._tbatcher.items
        return m

    def lease_actor(self, task_id: str) -> ActorRef[LeaseActor] | None:
        return self.supervisor.lease_for(task_id)

    def poke_reaper(self) -> bool:
        """Make the Reaper run now (after advancing a ManualClock)."""
        return self.supervisor.poke_reaper()

    def wake_scheduler(self) -> None:
        self.supervisor.wake_scheduler()

    def add_listener(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """``callback(event)`` on the loop after each committed transition:
        ``{"task_id", "state", "attempt", "host_id", "at" (ISO 8601)}``."""
        self._listeners.append(callback)

    # --- host-facing -------------------------------------------------------------------------
    async def register(self, host_id: str, credential: str) -> Session:
        async with self._request():
            return await self._bounded(self.repo.register_session(host_id, credential))

    async def heartbeat(
        self,
        session: Session,
        devices: Sequence[DeviceSnapshot],
        advert: HostAdvert | None = None,
    ) -> None:
        async with self._request():
            await self._bounded(self.repo.heartbeat(session, devices, advert))
        self.supervisor.wake_scheduler()

    async def reconcile(self, session: Session, entries: Sequence[JournalEntry]) -> ReconcileReport:
        async with self._request():
            report: ReconcileReport = await self._bounded(self.repo.reconcile(session, entries))
        sup = self.supervisor
        for e in report.lost:
            sup.attempt_ended(e.task_id, e.attempt)
        if report.lost:
            self._dispatch(
                [self._event(e.task_id, e.new_state, e.attempt, e.host_id) for e in report.lost]
            )
            sup.wake_scheduler()
        return report

    async def claim(
        self, session: Session, *, wait_s: float, device_ids: Sequence[str] = ()
    ) -> Claimed | None:
        """Long-poll: an assignment of this host (on one of ``device_ids`` if
        given) claimed at once, or after the Scheduler signals a new one, or None
        after ``wait_s``. Never polls the database in a loop: it waits on a per-host
        future that the Scheduler's signal completes. A poll woken with new
        assignments (``wake_hosts``) claims them without reading the pending ones
        first; it reads only when none of them was left to claim.

        A fresh poll first takes the new assignments no poll was parked for when
        they were made (``_unhanded``). It skips the read when an empty read of
        its devices, for its session, is less than ``_KNOWN_EMPTY_S`` old: every
        assignment made since came through ``_hand`` (assignments of another
        process and a Scheduler rebuild wake the host by id, which forgets what
        was known). A poll that skipped the read parks no longer
        than that knowledge lasts, then reads: an assignment this process never
        heard of (its Scheduler crashed between commit and hand-off) waits at
        most that long."""
        _check_session(session)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
            raise Invalid("wait_s must be a number >= 0", field="wait_s")
        if isinstance(device_ids, str) or not all(isinstance(d, str) for d in device_ids):
            raise Invalid("device_ids must be a list of strings", field="device_ids")
        async with self._request():
            # Each look checks the session: the read in its statement, a claim in
            # its transaction (Unauthorized if superseded).
            loop = self.loop
            deadline = loop.time() + float(wait_s)
            host = session.host_id
            wanted = frozenset(device_ids) if device_ids else None
            # Assignments handed to this poll and not tried yet.
            hints: list[Assignment] = []
            claimed: Claimed | None = None
            try:
                while True:
                    # Register before looking, so a signal between the look and the
                    # wait is not lost.
                    woken: asyncio.Future[None] = loop.create_future()
                    waiter = _Waiter(wanted, session)
                    self._waiters.setdefault(host, {})[woken] = waiter
                    try:
                        hints.extend(
                            self._take_unhanded(host, wanted, _HINTS_PER_POLL - len(hints))
                        )
                        claimed = await self._claim_hinted(session, hints)
                        known_until = None
                        if claimed is None:
                            known_until = self._known_empty_until(session, wanted)
                            if known_until is None:
                                claimed = await self._claim_pending(session, device_ids)
                        if claimed is not None:
                            return claimed
                        remaining = deadline - loop.time()
                        if remaining <= 0 or not self._accepting:
                            return None
                        wait = remaining
                        if known_until is not None:
                            wait = min(remaining, known_until - loop.time())
                        timed_out = False
                        waiter.parked = True
                        try:
                            async with asyncio.timeout(max(wait, 0.0)):
                                await woken
                        except TimeoutError:
                            timed_out = True
                        finally:
                            waiter.parked = False
                        if waiter.reserved is not None:
                            # An assignment pass took this poll as a claimer:
                            # its answer may be a claim already committed.
                            await self._settled(waiter.reserved)
                        if waiter.claimed is not None:
                            claimed = waiter.claimed
                            return claimed
                        if timed_out:
                            if wait < remaining:
                                continue  # what was known expired: read now
                            return None
                        if not self._accepting:
                            return None
                    finally:
                        waiter.gone = True
                        waiters = self._waiters.get(host)
                        if waiters is not None:
                            waiters.pop(woken, None)
                            if not waiters:
                                del self._waiters[host]
                        hints.extend(waiter.hints)
            finally:
                # Those this poll did not try (it claimed another, its wait ended,
                # or a claim failed) go to another poll: no one else was woken.
                if self._accepting:
                    for a in hints:
                        if claimed is None or claimed.task_id != a.task_id:
                            self._hand(a)

    async def _settled(self, reserved: asyncio.Future[None]) -> None:
        try:
            async with asyncio.timeout(self.db_timeout_s + 1.0):
                await asyncio.shield(reserved)
        except TimeoutError:  # the pass settles it in a finally: not seen
            log.error("control_plane.claimer_not_settled")

    async def _assign_pass(self, limit: int) -> tuple[list[Assignment], frozenset[str]]:
        """One assignment pass, on the loop (``Context.assign``): the Scheduler's
        ``repo.assign``, with the long-polls parked now as claimers
        (``repo.assign_and_claim``). A new assignment that a poll parked for its
        device, with nothing in hand, may claim is claimed for that poll in the
        transaction that assigns: the poll answers with the lease at that
        commit, not after a hand-off to the poll, a hop to the Lease actor and a
        commit of its own. Its Lease actor is started and told the claim, and
        its ``assigned`` and ``dispatched`` events emitted, before the answer
        leaves; the Scheduler does the rest. Returns the assignments and the
        ids of the tasks claimed."""
        if not self._waiters or not self._accepting:
            return await self.repo.assign(limit=limit), frozenset()
        loop = self.loop
        chosen: dict[str, tuple[asyncio.Future[None], _Waiter]] = {}

        def waiting(host_id: str, device_id: str) -> _Waiter | None:
            best = self._claimer(host_id, device_id)
            return None if best is None else best[1]

        def claimer(a: Assignment) -> Session | None:
            # Asked in the assigning transaction, once per new assignment (again
            # if the transaction runs again).
            if a.task_id in chosen:
                return chosen[a.task_id][1].session
            best = self._claimer(a.host_id, a.device_id)
            if best is None:
                return None
            best[1].reserved = loop.create_future()
            chosen[a.task_id] = best
            return best[1].session

        try:
            batch, claims = await self.repo.assign_and_claim(
                limit=limit, claimer=claimer, waiting=waiting
            )
            if not claims:
                return batch, frozenset()
            by_task = {a.task_id: a for a in batch}
            sup = self.supervisor
            events: list[dict[str, Any]] = []
            for c in claims:
                woken, w = chosen[c.task_id]
                a = by_task[c.task_id]
                try:
                    ref: ActorRef[LeaseActor] | None = sup.ensure_lease(a)
                except Unavailable:
                    ref = None  # shutting down: the answer still goes out
                if w.gone:
                    # Cancelled while the pass ran (its connection closed): the
                    # lease is never acknowledged and expires at its ack deadline.
                    log.warning("control_plane.claim_at_assign_undelivered", task_id=c.task_id)
                else:
                    w.claimed = c
                    self._wake(woken)
                if ref is not None:
                    with contextlib.suppress(ActorDeadError):
                        ref.tell(Committed(kind="claim", outcome=c))
                events.append(self._event(a.task_id, "assigned", a.attempt, a.host_id))
                events.append(self._event(a.task_id, "dispatched", c.attempt, a.host_id))
            self.stats.incr("claims_at_assign", len(claims))
            # After the answers: the woken polls run first (the loop's ready
            # queue is in order), the events' listeners next.
            loop.call_soon(self._dispatch, events)
            return batch, frozenset(c.task_id for c in claims)
        finally:
            for _, w in chosen.values():
                reserved, w.reserved = w.reserved, None
                if reserved is not None and not reserved.done():
                    reserved.set_result(None)

    def _claimer(self, host_id: str, device_id: str) -> tuple[asyncio.Future[None], _Waiter] | None:
        """The long-poll an assignment pass may claim an assignment on this
        device for: parked for it, nothing in hand, not taken by the pass
        already; of the newest session."""
        best: tuple[asyncio.Future[None], _Waiter] | None = None
        for woken, w in self._waiters.get(host_id, {}).items():
            if (
                w.parked
                and w.reserved is None
                and not w.hints
                and not woken.done()
                and w.wanted is not None
                and device_id in w.wanted
                and (best is None or w.generation > best[1].generation)
            ):
                best = (woken, w)
        return best

    async def _claim_hinted(self, session: Session, hints: list[Assignment]) -> Claimed | None:
        """Claim the first still claimable of ``hints``, in claim-deadline order,
        removing each from the list once tried (one whose claim raises stays)."""
        hints.sort(key=lambda a: a.claim_deadline)
        while hints:
            a = hints[0]
            key = (a.task_id, a.attempt)
            claimed = None
            # Skipped when another poll of this process is claiming it, or it has
            # no Lease actor (the attempt ended, or the actor is being replaced):
            # the read decides.
            if key not in self._claiming and self.supervisor.lease_for(a.task_id) is not None:
                self._claiming.add(key)
                try:
                    claimed = await self._claim_one(session, a)
                finally:
                    self._claiming.discard(key)
            del hints[0]
            if claimed is not None:
                return claimed
        return None

    def _take_unhanded(
        self, host: str, wanted: frozenset[str] | None, limit: int
    ) -> list[Assignment]:
        """At most ``limit`` of the host's unhanded assignments this poll may
        claim, the first kept first (removed)."""
        kept = self._unhanded.get(host)
        if kept is None:
            return []
        mine = kept.take(wanted, limit)
        if not kept:
            del self._unhanded[host]
        return mine

    def _known_empty_until(self, session: Session, wanted: frozenset[str] | None) -> float | None:
        """Until when every device of ``wanted`` is known to have nothing pending
        (None: not known, read)."""
        known = self._known_empty.get(session.host_id)
        if wanted is None or known is None or known[0] != session.generation:
            return None
        now = self.loop.time()
        until = min((known[1].get(d, 0.0) for d in wanted), default=0.0)
        return until if until > now else None

    def _mark_known_empty(self, session: Session, device_ids: Sequence[str], until: float) -> None:
        known = self._known_empty.get(session.host_id)
        if known is None or known[0] != session.generation:
            if len(self._known_empty) >= 100_000:
                self._known_empty.clear()
            known = self._known_empty[session.host_id] = (session.generation, {})
        for d in device_ids:
            known[1][d] = until

    def _forget_known(self, host: str, device: str | None = None) -> None:
        self._forgets += 1
        if device is None:
            self._known_empty.pop(host, None)
            return
        known = self._known_empty.get(host)
        if known is not None:
            known[1].pop(device, None)

    async def _claim_pending(self, session: Session, device_ids: Sequence[str]) -> Claimed | None:
        # The oldest few are enough (reading every pending assignment of a host with
        # a thousand of them, for each of its polls, saturated the event loop); the
        # limit also covers those other polls of this process are claiming.
        read_at, forgets = self.loop.time(), self._forgets
        pending: list[Assignment] = await self._bounded(
            self.repo.session_pending(
                session, device_ids=device_ids, limit=len(self._claiming) + 16
            )
        )
        if not pending and device_ids and forgets == self._forgets:
            self._mark_known_empty(session, device_ids, read_at + _KNOWN_EMPTY_S)
        for a in sorted(pending, key=lambda a: a.claim_deadline):
            key = (a.task_id, a.attempt)
            if key in self._claiming:
                # Another long-poll of this process is claiming it: concurrent polls
                # of one host went down the same list in the same order, each losing
                # every race but the last (with 1,000 pending, past the timeout).
                continue
            self._claiming.add(key)
            try:
                claimed = await self._claim_one(session, a)
            finally:
                self._claiming.discard(key)
            if claimed is not None:
                return claimed
        return None

    async def _claim_one(self, session: Session, a: Assignment) -> Claimed | None:
        for attempt in range(_REDELIVERIES + 1):
            ref = self.supervisor.lease_for(a.task_id) or self.supervisor.ensure_lease(a)
            try:
                claimed: Claimed = await self._ask(
                    ref,
                    lambda r: Claim(reply=r, session=session, task_id=a.task_id, attempt=a.attempt),
                )
            except (Conflict, Gone):
                return None  # claimed by a concurrent poller, or just expired
            except NotDelivered:
                if attempt == _REDELIVERIES:
                    raise
                continue
            return claimed
        return None

    async def ack(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        return await self._via_lease(
            Ack(session=session, task_id=task_id, attempt=attempt, lease_token=lease_token),
            lambda: self.repo.ack(session, task_id, attempt, lease_token),
        )

    async def renew(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """Extend the lease (see the module doc: not through the Lease actor)."""
        return await self._renew(
            Renew(session=session, task_id=task_id, attempt=attempt, lease_token=lease_token)
        )

    async def _renew(self, msg: Renew | CancelPoll) -> LeaseStatus:
        msg.validate()
        renewal = Renewal(
            session=msg.session,
            task_id=msg.task_id,
            attempt=msg.attempt,
            lease_token=msg.lease_token,
        )
        async with self._request():
            batcher = self._batcher
            status: LeaseStatus = await self._bounded(
                batcher.renew(renewal)
                if batcher is not None
                else self.repo.renew(msg.session, msg.task_id, msg.attempt, msg.lease_token)
            )
        if status.cancel_requested:
            ref = self.supervisor.lease_for(msg.task_id)
            if ref is not None:
                with contextlib.suppress(ActorDeadError):
                    ref.tell(Renewed(status=status))
        return status

    async def progress(
        self, session: Session, task_id: str, attempt: int, lease_token: str, seq: int
    ) -> LeaseStatus:
        return await self._via_lease(
            Progress(
                session=session,
                task_id=task_id,
                attempt=attempt,
                lease_token=lease_token,
                seq=seq,
            ),
            lambda: self.repo.progress(session, task_id, attempt, lease_token, seq),
        )

    async def report_result(
        self,
        session: Session,
        task_id: str,
        attempt: int,
        lease_token: str,
        *,
        outcome: Outcome | str,
        retryable: bool = False,
        reason: str = "",
        result: dict[str, Any] | None = None,
        fingerprint: str,
    ) -> ResultRecord:
        msg = ReportResult(
            session=session,
            task_id=task_id,
            attempt=attempt,
            lease_token=lease_token,
            outcome=outcome,  # type: ignore[arg-type]  # validated below
            retryable=retryable,
            reason=reason,
            result=result,
            fingerprint=fingerprint,
        )

        async def direct() -> ResultRecord:
            record: ResultRecord = await self.repo.report_result(
                session,
                task_id,
                attempt,
                lease_token,
                outcome=Outcome(outcome),
                retryable=retryable,
                reason=reason,
                result=result,
                fingerprint=fingerprint,
            )
            if not record.replayed:
                self._dispatch(
                    [self._event(task_id, record.state, record.attempt, session.host_id)]
                )
                self.supervisor.wake_scheduler()
            return record

        return await self._via_lease(msg, direct)

    async def cancel_poll(
        self, session: Session, task_id: str, attempt: int, lease_token: str
    ) -> LeaseStatus:
        """A fenced renewal (extends the lease) that reports ``cancel_requested``."""
        return await self._renew(
            CancelPoll(session=session, task_id=task_id, attempt=attempt, lease_token=lease_token)
        )

    # --- user-facing ----------------------------------------------------------------------------
    async def submit(self, spec: TaskSpec) -> str:
        return (await self.submit_many([spec]))[0]

    async def submit_many(self, specs: Sequence[TaskSpec]) -> list[str]:
        """Submit in one transaction. A repeated request id returns its first task
        and makes no event (that task has its own history)."""
        async with self._request():
            ids, new = await self._bounded(self.repo.submit_many_new(specs))
        if new:
            self._dispatch([self._event(t, TaskState.QUEUED, 0, None) for t in ids if t in new])
            self.supervisor.wake_scheduler()
        return ids

    async def cancel(self, task_id: str, user: User) -> CancelRecord:
        """Queued/retrying: cancelled at once. In flight: a durable intent written
        through the task's Lease actor; the host sees it on its next renewal."""
        msg = Cancel(task_id=task_id, user=user)
        msg.validate()
        async with self._request():
            for _ in range(_REDELIVERIES):
                ref = self.supervisor.lease_for(task_id)
                if ref is None:
                    break
                try:
                    record: CancelRecord = await self._ask(ref, lambda r: _with_reply(msg, r))
                except NotDelivered:
                    continue  # stopped before handling it: its replacement, or directly
                return record
            record = await self._bounded(self.repo.request_cancel(task_id, user))
        if record.state is TaskState.CANCELLED:
            self._dispatch([self._event(task_id, record.state, 0, None)])
        return record

    # --- plumbing ------------------------------------------------------------------------------
    async def _via_lease(self, msg: Message, direct: Callable[[], Coroutine[Any, Any, T]]) -> T:
        msg.validate()
        assert isinstance(msg, Claim | Ack | Progress | ReportResult)
        async with self._request():
            sup = self.supervisor
            for attempt in range(_REDELIVERIES + 1):
                ref = sup.lease_for(msg.task_id)
                if ref is None:
                    active = await self._active_attempt(msg.session.host_id, msg.task_id)
                    if active is None:
                        result: T = await self._bounded(direct())
                        return result
                    ref = sup.ensure_lease(active)
                try:
                    answer: T = await self._ask(ref, lambda r: _with_reply(msg, r))
                except NotDelivered:
                    # The actor stopped before handling it (its task ended, or it
                    # crashed on an earlier message): nothing happened, send again.
                    if attempt == _REDELIVERIES:
                        raise
                    continue
                return answer
            raise AssertionError("unreachable")

    async def _active_attempt(self, host_id: str, task_id: str) -> Assignment | None:
        actives: list[Assignment] = await self._bounded(self.repo.active_attempts(host_id))
        mine = [a for a in actives if a.task_id == task_id]
        return max(mine, key=lambda a: a.attempt) if mine else None

    async def _ask(self, ref: ActorRef[Any], build: Callable[[Reply[Any]], Message]) -> Any:
        reply: Reply[Any] = Reply(self.loop)
        try:
            ref.tell(build(reply))
        except ActorDeadError as exc:
            raise NotDelivered("the actor is restarting; retry") from exc
        return await reply.wait(self.ask_timeout_s)

    async def _bounded(self, coro: Coroutine[Any, Any, T]) -> T:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for runs the
        # coroutine in a task of its own, a task per request for nothing.
        try:
            async with asyncio.timeout(self.ask_timeout_s):
                return await coro
        except TimeoutError as exc:
            raise Unavailable(f"no answer within {self.ask_timeout_s} s") from exc

    def _request(self) -> _InFlight:
        """``async with`` around serving one request: refused once stopping;
        ``stop`` waits for those in flight. (A class, not an
        ``asynccontextmanager``: an async generator per request, on every
        renewal, for a counter.)"""
        return self._in_flight

    def _enter_request(self) -> None:
        if not self._accepting or self._idle is None:
            raise Unavailable("the control plane is not running")
        self._inflight += 1
        self._idle.clear()

    def _exit_request(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    def _event(self, task_id: str, state: str, attempt: int, host_id: str | None) -> dict[str, Any]:
        return {
            "task_id": task_id,
            "state": str(state),
            "attempt": attempt,
            "host_id": host_id,
            "at": self.clock.now().isoformat(),
        }

    def _emit_threadsafe(self, events: list[dict[str, Any]]) -> None:
        if self._ctx is not None:
            self._ctx.bridge.call_soon(self._dispatch, events)

    def _dispatch(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            for callback in list(self._listeners):
                try:
                    callback(event)
                except Exception as exc:  # one bad listener must not stop the others
                    log.error("control_plane.listener_failed", error=repr(exc))

    def _wake_hosts_threadsafe(self, hosts: Any) -> None:
        if self._ctx is not None:
            self._ctx.bridge.call_soon(self.wake_hosts, list(hosts))

    def wake_hosts(self, hosts: Iterable[str | tuple[str, str] | Assignment]) -> None:
        """Wake the parked long-polls of these hosts (on the loop). The server calls
        this when another control-plane process assigned them work.

        An :class:`Assignment` (new, from the Scheduler) is handed to one
        long-poll that may claim its device, which claims it without reading the
        pending assignments first: waking every poll of the host would make each
        of them read, for one assignment that only one of them can take. An
        item ``(host_id, device_id)`` wakes the polls that may claim that device,
        a host id every poll of the host; those read."""
        for item in hosts:
            if isinstance(item, Assignment):
                self._hand(item)
                continue
            if isinstance(item, tuple):
                host, device = item
                self._forget_known(host, device)
                targets = [f for f, w in self._waiters.get(host, {}).items() if w.may_claim(device)]
            else:
                self._forget_known(item)
                targets = list(self._waiters.get(item, {}))
            for woken in targets:
                self._wake(woken)

    def _hand(self, a: Assignment) -> None:
        """Give ``a`` to a long-poll that may claim it: one not woken yet if any
        (a woken one may already be claiming another), of the newest session,
        with the fewest others in hand, and fewer than ``_HINTS_PER_POLL``.
        With none, the host's next poll takes it (or, past ``_UNHANDED_MAX``
        kept, a later read finds it)."""
        candidates = [
            (woken, w)
            for woken, w in self._waiters.get(a.host_id, {}).items()
            if len(w.hints) < _HINTS_PER_POLL and w.may_claim(a.device_id)
        ]
        if not candidates:
            kept = self._unhanded.setdefault(a.host_id, _Kept())
            if len(kept) < _UNHANDED_MAX:
                kept.add(a)
            else:
                self._forget_known(a.host_id, a.device_id)
            return
        woken, w = min(candidates, key=lambda c: (c[0].done(), -c[1].generation, len(c[1].hints)))
        w.hints.append(a)
        self._wake(woken)

    def _wake(self, woken: asyncio.Future[None]) -> None:
        if not woken.done():
            woken.set_result(None)
            self._host_wakeups += 1


def _with_reply(msg: Message, reply: Reply[Any]) -> Message:
    import dataclasses

    return dataclasses.replace(msg, reply=reply)


def _check_session(session: object) -> None:
    if not isinstance(session, Session):
        raise Invalid("session must be a Session", field="session")


__all__ = ["ControlPlane", "RepositoryError"]
