"""The supervisor: starts the Scheduler, the Reaper and the Lease actors, and
replaces any of them that dies.

It is a plain thread-safe object, not an actor, so that it keeps working whatever
actor is dead and never takes part in an ask cycle. Deaths reach it three ways:

* a crash inside a handler: pykka calls the actor's ``on_failure``, which calls
  :meth:`Supervisor.child_failed`;
* a stop nobody asked for (``ref.stop()`` from outside): ``on_stop`` calls
  :meth:`Supervisor.child_stopped` with ``expected=False``;
* anything else (say an exception in a pykka hook): :meth:`Supervisor.check`,
  the watchdog the runtime calls on its timer, finds the dead ref.

A replacement's first message is :class:`~actors.messages.Rebuild`: it reloads
what it needs from the database (the actors' memory is only a cache). Messages
queued for the dead actor are answered with the retryable ``Unavailable`` by its
inbox (see :class:`~actors.base.ClosableInbox`), and a ``tell`` to a dead ref
raises ``ActorDeadError``, which every caller turns into ``Unavailable``.

Lease actors are keyed by task id. The newest attempt wins: starting the actor
of attempt n+1 tells the actor of attempt n (if still alive) to end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from pykka import ActorDeadError, ActorRef

from fleetlease.actors.base import Context, FleetActor
from fleetlease.actors.lease import LeaseActor
from fleetlease.actors.messages import AttemptEnded, DeadlineHint, Message, Rebuild, Tick, Wake
from fleetlease.actors.reaper import ReaperActor
from fleetlease.actors.scheduler import SchedulerActor
from fleetlease.persistence.errors import Unavailable
from fleetlease.persistence.model import Assignment

log = structlog.get_logger("fleetlease.supervisor")

#: An attempt number above any real one: "whatever your attempt is, it ended".
_ANY_ATTEMPT = 2**31 - 1


@dataclass(kw_only=True)
class _LeaseEntry:
    ref: ActorRef[LeaseActor]
    assignment: Assignment
    mark: int


def _tell(ref: ActorRef[Any] | None, message: Message) -> bool:
    if ref is None:
        return False
    try:
        ref.tell(message)
    except ActorDeadError:
        return False
    return True


class Supervisor:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        ctx.supervisor = self
        self._lock = threading.RLock()
        self._running = False
        self._scheduler: ActorRef[SchedulerActor] | None = None
        self._reaper: ActorRef[ReaperActor] | None = None
        self._leases: dict[str, _LeaseEntry] = {}
        self._mark = 0
        self._wake_pending = False
        #: When the Reaper's timer wakes it next (its run then reads every
        #: deadline again); None while it runs or has not scheduled one. Written
        #: by the Reaper only.
        self.reaper_next_at: datetime | None = None

    # --- lifecycle ----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        with self._lock:
            self._running = True
            self._scheduler = SchedulerActor.start(self.ctx)
            self._reaper = ReaperActor.start(self.ctx)
            _tell(self._reaper, Tick())
        self.wake_scheduler()

    def shutdown(self) -> list[ActorRef[Any]]:
        """No more restarts; returns every actor to stop."""
        with self._lock:
            self._running = False
            refs: list[ActorRef[Any]] = [e.ref for e in self._leases.values()]
            refs += [r for r in (self._scheduler, self._reaper) if r is not None]
            self._leases.clear()
            return refs

    @staticmethod
    def stop_actors(refs: list[ActorRef[Any]], timeout: float) -> None:
        """Blocking (run it in an executor): graceful stop, each actor finishing
        the messages already in its inbox."""
        futures = [ref.stop(block=False) for ref in refs]
        deadline = time.monotonic() + timeout
        stuck = 0
        for fut in futures:
            try:
                fut.get(timeout=max(deadline - time.monotonic(), 0.001))
            except Exception:  # a stuck actor must not stop the shutdown
                stuck += 1
        if stuck:
            log.warning("supervisor.stop_timeout", stuck=stuck, timeout=timeout)

    # --- scheduler and reaper --------------------------------------------------------------
    @property
    def scheduler(self) -> ActorRef[SchedulerActor] | None:
        return self._scheduler

    @property
    def reaper(self) -> ActorRef[ReaperActor] | None:
        return self._reaper

    def wake_scheduler(self, *, force: bool = False) -> None:
        """Coalesced: at most one ``Wake`` waits in the Scheduler's inbox. The
        Scheduler clears the flag before it reads the database, so a wake-up that
        arrives during a pass causes exactly one more pass."""
        with self._lock:
            if not self._running or (self._wake_pending and not force):
                return
            self._wake_pending = True
            ref = self._scheduler
        self.ctx.stats.incr("scheduler_wakes")
        if not _tell(ref, Wake()):
            with self._lock:
                self._wake_pending = False

    def scheduler_woken(self) -> None:
        with self._lock:
            self._wake_pending = False

    def hint_deadline(self, at: datetime) -> None:
        """Tell the Reaper of a deadline ``at`` committed just now, unless it
        wakes by then anyway: then its run reads the deadline from the database
        (a claim and an ack each hinted, and each hint woke the Reaper's
        thread, to find its timer already earlier)."""
        next_at = self.reaper_next_at
        if next_at is not None and at >= next_at:
            return
        _tell(self._reaper, DeadlineHint(at=at))

    def poke_reaper(self) -> bool:
        return _tell(self._reaper, Tick())

    # --- lease actors -------------------------------------------------------------------------
    def mark(self) -> int:
        """A point in the supervisor's history: Lease actors started after it are
        never ended by a reconcile based on a database read taken after it."""
        with self._lock:
            self._mark += 1
            return self._mark

    def lease_for(self, task_id: str) -> ActorRef[LeaseActor] | None:
        entry = self._leases.get(task_id)
        if entry is None or not entry.ref.is_alive():
            return None
        return entry.ref

    def lease_count(self) -> int:
        return len(self._leases)

    def lease_refs(self) -> dict[str, ActorRef[LeaseActor]]:
        with self._lock:
            return {tid: e.ref for tid, e in self._leases.items()}

    def ensure_lease(self, a: Assignment, *, rebuild: bool = False) -> ActorRef[LeaseActor]:
        """The live Lease actor of ``a.task_id`` for attempt ``a.attempt`` or newer,
        started if needed. ``rebuild``: its first message reloads from the database
        (use when ``a`` may be stale)."""
        with self._lock:
            if not self._running:
                raise Unavailable("the control plane is shutting down")
            entry = self._leases.get(a.task_id)
            if entry is not None and entry.ref.is_alive():
                if entry.assignment.attempt >= a.attempt:
                    return entry.ref
                _tell(entry.ref, AttemptEnded(attempt=entry.assignment.attempt))
            return self._start_lease(a, rebuild=rebuild)

    def _start_lease(self, a: Assignment, *, rebuild: bool) -> ActorRef[LeaseActor]:
        ref = LeaseActor.start(self.ctx, a)
        if rebuild:
            _tell(ref, Rebuild())
        self._mark += 1
        self._leases[a.task_id] = _LeaseEntry(ref=ref, assignment=a, mark=self._mark)
        self.ctx.stats.incr("lease_actors_started")
        return ref

    def attempt_ended(self, task_id: str, attempt: int) -> None:
        entry = self._leases.get(task_id)
        if entry is not None and not _tell(entry.ref, AttemptEnded(attempt=attempt)):
            with self._lock:
                if self._leases.get(task_id) is entry:
                    del self._leases[task_id]

    def reconcile_leases(
        self, actives: list[Assignment], mark: int, *, verify: bool = True
    ) -> None:
        """Make the Lease actors match ``actives`` (read from the database after
        ``mark``): start the missing ones, end those whose task has no active
        attempt. ``verify``: new actors re-read the database first (the task may
        have ended since the read)."""
        latest: dict[str, Assignment] = {}
        for a in actives:
            if a.task_id not in latest or latest[a.task_id].attempt < a.attempt:
                latest[a.task_id] = a
        with self._lock:
            if not self._running:
                return
            for a in latest.values():
                self.ensure_lease(a, rebuild=verify)
            stale = [e for tid, e in self._leases.items() if tid not in latest and e.mark < mark]
        for e in stale:
            _tell(e.ref, AttemptEnded(attempt=_ANY_ATTEMPT))
        if stale:
            log.info("supervisor.stale_leases_ended", count=len(stale))

    # --- deaths ---------------------------------------------------------------------------------
    def child_failed(self, actor: FleetActor, exc: BaseException | None) -> None:
        log.warning("supervisor.child_failed", error=repr(exc), **actor.describe())
        self._replace(actor)

    def child_stopped(self, actor: FleetActor, *, expected: bool) -> None:
        if isinstance(actor, LeaseActor) and expected:
            with self._lock:
                entry = self._leases.get(actor.task_id)
                if entry is not None and entry.ref is actor.actor_ref:
                    del self._leases[actor.task_id]
            return
        if self._running:
            log.warning("supervisor.child_stopped_unexpectedly", **actor.describe())
            self._replace(actor)

    def _replace(self, actor: FleetActor) -> None:
        ref = actor.actor_ref
        with self._lock:
            if not self._running:
                return
            if isinstance(actor, LeaseActor):
                entry = self._leases.get(actor.task_id)
                if entry is None or entry.ref is not ref:
                    return
                self._start_lease(entry.assignment, rebuild=True)
            elif isinstance(actor, SchedulerActor):
                if self._scheduler is not ref:
                    return
                self._scheduler = SchedulerActor.start(self.ctx)
                self._wake_pending = False
                _tell(self._scheduler, Rebuild())
            elif isinstance(actor, ReaperActor):
                if self._reaper is not ref:
                    return
                self.reaper_next_at = None  # the crashed one's timer is void
                self._reaper = ReaperActor.start(self.ctx)
                _tell(self._reaper, Rebuild())
            else:
                return
        self.ctx.stats.incr(f"restarts.{actor.kind}")
        log.info("supervisor.restarted", **actor.describe())

    def check(self) -> None:
        """Watchdog: replace any supervised actor found dead without a hook having
        told us (and re-send a Wake in case one was lost in a dead inbox)."""
        with self._lock:
            if not self._running:
                return
            for ref in (self._scheduler, self._reaper):
                if ref is not None and not ref.is_alive():
                    actor = _actor_of(ref)
                    if actor is not None:
                        self._replace(actor)
                    elif ref is self._scheduler:
                        self._scheduler = SchedulerActor.start(self.ctx)
                        _tell(self._scheduler, Rebuild())
                    else:
                        self._reaper = ReaperActor.start(self.ctx)
                        _tell(self._reaper, Rebuild())
            for e in [e for e in self._leases.values() if not e.ref.is_alive()]:
                actor = _actor_of(e.ref)
                if actor is not None and actor._stopping_expected:
                    continue  # stopping itself; on_stop removes the entry
                self._start_lease(e.assignment, rebuild=True)
                self.ctx.stats.incr("restarts.lease")


def _actor_of(ref: ActorRef[Any]) -> FleetActor | None:
    actor = ref._actor_weakref()
    return actor if isinstance(actor, FleetActor) else None
