"""``ControlPlane``: the asyncio-side facade of the actor system, used by the
transport's host handlers (``transport/host_handlers.py``).

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

Long-poll claims are parked, handed new assignments and woken by the
:class:`~fleetlease.actors.longpoll.LongPollBroker` (``actors/longpoll.py``);
the facade validates a claim and counts it among the requests in flight.

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
from typing import Any, TypeVar

import structlog
from pykka import ActorDeadError, ActorRef

from fleetlease.actors.base import LEASE_THREADS, REDELIVERIES, Context, NotDelivered, Stats
from fleetlease.actors.bridge import Bridge, Reply
from fleetlease.actors.groupcommit import (
    HeartbeatBatcher,
    PendingReader,
    RenewBatcher,
    TransitionBatcher,
)
from fleetlease.actors.lease import LeaseActor
from fleetlease.actors.longpoll import LongPollBroker
from fleetlease.actors.messages import (
    Ack,
    Cancel,
    CancelPoll,
    Claim,
    Message,
    Progress,
    Renew,
    Renewed,
    ReportResult,
)
from fleetlease.actors.supervisor import Supervisor
from fleetlease.persistence.clock import Clock
from fleetlease.persistence.errors import (
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


class _InFlight:
    """See ``ControlPlane._request``."""

    __slots__ = ("_cp",)

    def __init__(self, cp: ControlPlane) -> None:
        self._cp = cp

    async def __aenter__(self) -> None:
        self._cp._enter_request()

    async def __aexit__(self, *exc: object) -> None:
        self._cp._exit_request()


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
        self._inflight = 0
        self._in_flight = _InFlight(self)
        self._idle: asyncio.Event | None = None
        self._accepting = False
        #: Parked long-poll claims and their wake-ups.
        self.longpoll = LongPollBroker(self)
        self._started = False
        self._ticker: asyncio.Task[None] | None = None
        self._batcher: RenewBatcher | None = None
        self._tbatcher: TransitionBatcher | None = None
        self._hbatcher: HeartbeatBatcher | None = None
        #: The long-poll reads' group commit (``LongPollBroker``).
        self.pending_reader: PendingReader | None = None
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
        self._hbatcher = HeartbeatBatcher(self.repo) if self.group_commit else None
        self.pending_reader = PendingReader(self.repo) if self.group_commit else None
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
            assign=self.longpoll.assign_pass,
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
        self.longpoll.release_all()
        if self._idle is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        refs = self._sup.shutdown()
        await self.loop.run_in_executor(None, Supervisor.stop_actors, refs, grace_s)
        for batcher in (self._batcher, self._tbatcher, self._hbatcher, self.pending_reader):
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
        return self.longpoll.host_wakeups

    @property
    def accepting(self) -> bool:
        """Started and not stopping: requests are served."""
        return self._accepting

    @property
    def parked_claims(self) -> int:
        """Host claims parked in the long-poll broker now."""
        return self.longpoll.parked

    def actors_alive(self) -> dict[str, bool]:
        """Whether the Scheduler and the Reaper run (both False when not started)."""
        sup = self._sup
        if sup is None or not self._accepting:
            return {"scheduler": False, "reaper": False}
        return {
            name: ref is not None and ref.is_alive()
            for name, ref in (("scheduler", sup.scheduler), ("reaper", sup.reaper))
        }

    @property
    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = dict(self.stats.snapshot())
        m["host_wakeups"] = self.longpoll.host_wakeups
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
        *,
        digest: str | None = None,
    ) -> None:
        async with self._request():
            await self._bounded(self.repo.heartbeat(session, devices, advert, digest=digest))
        self.supervisor.wake_scheduler()

    async def heartbeat_unchanged(self, session: Session, digest: str) -> None:
        """A heartbeat without a snapshot (``Repository.heartbeat_unchanged``):
        nothing the Scheduler matches on changed, so it is not woken."""
        async with self._request():
            hb = self._hbatcher
            await self._bounded(
                hb.beat(session, digest)
                if hb is not None
                else self.repo.heartbeat_unchanged(session, digest)
            )

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
        after ``wait_s`` (``LongPollBroker.claim``)."""
        _check_session(session)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or wait_s < 0:
            raise Invalid("wait_s must be a number >= 0", field="wait_s")
        if isinstance(device_ids, str) or not all(isinstance(d, str) for d in device_ids):
            raise Invalid("device_ids must be a list of strings", field="device_ids")
        async with self._request():
            return await self.longpoll.claim(session, float(wait_s), device_ids)

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
            for _ in range(REDELIVERIES):
                ref = self.supervisor.lease_for(task_id)
                if ref is None:
                    break
                try:
                    record: CancelRecord = await self._ask(ref, lambda r: _with_reply(msg, r))
                except NotDelivered:
                    continue  # stopped before handling it: its replacement, or directly
                return record
            record = await self._bounded(self.repo.request_cancel(task_id, user))
        if record.state is TaskState.CANCELLED and not (record.repeated or record.ended_before):
            self._dispatch([self._event(task_id, record.state, 0, None)])
        return record

    # --- plumbing ------------------------------------------------------------------------------
    async def _via_lease(self, msg: Message, direct: Callable[[], Coroutine[Any, Any, T]]) -> T:
        msg.validate()
        assert isinstance(msg, Claim | Ack | Progress | ReportResult)
        async with self._request():
            sup = self.supervisor
            for attempt in range(REDELIVERIES + 1):
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
                    if attempt == REDELIVERIES:
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
        this when another control-plane process assigned them work
        (``LongPollBroker.wake_hosts``)."""
        self.longpoll.wake_hosts(hosts)


def _with_reply(msg: Message, reply: Reply[Any]) -> Message:
    import dataclasses

    return dataclasses.replace(msg, reply=reply)


def _check_session(session: object) -> None:
    if not isinstance(session, Session):
        raise Invalid("session must be a Session", field="session")


__all__ = ["ControlPlane", "RepositoryError"]
