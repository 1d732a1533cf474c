"""The Scheduler actor: binds eligible tasks to free devices.

It is woken (coalesced, see :meth:`actors.supervisor.Supervisor.wake_scheduler`)
by submits, heartbeats, released reservations, expiries and a timer. Each pass
calls ``repo.assign(limit)`` while it returns a full batch; fairness across
projects and priority within a project are the repository's ``assign`` (one
transaction per batch, SKIP LOCKED); through ``Context.assign`` the pass runs
on the loop and also claims, in the same transaction, the assignments a parked
long-poll of its host is waiting for (``LongPollBroker.assign_pass``). For every
new assignment it starts a Lease actor through the supervisor, tells the Reaper
about the claim deadline and hands the unclaimed ones to a long-poll of their
host, which claims it without a read.

It holds no state of its own: after a crash, the replacement's first message is
:class:`~actors.messages.Rebuild`, which makes sure every active attempt in the
database has a Lease actor (an assignment committed just before the crash would
otherwise have none) and wakes every host that may have pending work.
"""

from __future__ import annotations

import structlog

from fleetlease.actors import failpoints
from fleetlease.actors.base import Context, FleetActor
from fleetlease.actors.messages import Crash, Rebuild, Wake
from fleetlease.persistence.errors import RepositoryError
from fleetlease.persistence.model import Assignment

log = structlog.get_logger("fleetlease.scheduler")

_MAX_ASSIGN_BATCH = 1024


class SchedulerActor(FleetActor):
    kind = "scheduler"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.handle(Wake, self._wake)
        self.handle(Rebuild, self._rebuild)
        self.handle(Crash, lambda m: None)

    def _wake(self, m: Wake) -> None:
        self.ctx.sup.scheduler_woken()
        self._assign_all()

    def _assign_all(self) -> None:
        limit = self.ctx.assign_batch
        while True:
            failpoints.hit(failpoints.SCHEDULER_BEFORE_ASSIGN)
            self.ctx.stats.incr("assign_calls")
            try:
                if self.ctx.assign is not None:
                    batch, claimed = self.ctx.db(self.ctx.assign(limit))
                else:
                    batch, claimed = self.ctx.db(self.ctx.repo.assign(limit=limit)), frozenset()
            except RepositoryError as exc:
                # The timer wakes us again; nothing was assigned.
                log.warning("scheduler.assign_failed", error=exc.message, code=exc.code)
                return
            failpoints.hit(failpoints.SCHEDULER_AFTER_ASSIGN_COMMIT)
            if batch:
                self._started(batch, claimed)
            if len(batch) < limit:
                return
            # A backlog: larger passes, each reading the free devices once for
            # more assignments (10,000 tasks on 10,000 free devices took 156
            # passes, each reading every free device).
            limit = min(limit * 2, _MAX_ASSIGN_BATCH)

    def _started(self, batch: list[Assignment], claimed: frozenset[str]) -> None:
        """Lease actors for the new assignments, and the hosts told. Those
        ``claimed`` at the assignment's commit have their actor, events and
        answer already (``LongPollBroker.assign_pass``)."""
        self.ctx.stats.incr("assigned", len(batch))
        for a in batch:
            self.ctx.sup.ensure_lease(a)
        self.ctx.sup.hint_deadline(min(a.claim_deadline for a in batch))
        waiting = [a for a in batch if a.task_id not in claimed]
        if not waiting:
            return
        self.ctx.wake_hosts(waiting)
        self.ctx.emit(
            [
                self.ctx.event(
                    task_id=a.task_id, state="assigned", attempt=a.attempt, host_id=a.host_id
                )
                for a in waiting
            ]
        )

    def _rebuild(self, m: Rebuild) -> None:
        self.ctx.sup.scheduler_woken()
        mark = self.ctx.sup.mark()
        actives: list[Assignment] = self.ctx.db(self.ctx.repo.active_attempts())
        self.ctx.sup.reconcile_leases(actives, mark)
        self.ctx.wake_hosts({a.host_id for a in actives})
        log.info("scheduler.rebuilt", active=len(actives))
        self._assign_all()
