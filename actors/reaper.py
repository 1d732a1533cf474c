"""The Reaper actor: ends attempts whose claim, ack or lease deadline passed.

It sleeps until ``repo.next_deadline()`` (measured with the injected clock), not
on a fixed poll; the sleep is capped (``reaper_max_sleep_s``) and cut short when
a :class:`~actors.messages.DeadlineHint` announces a nearer deadline (a new
assignment's claim deadline, a claim's ack deadline; one not nearer is not sent:
the supervisor knows when the timer fires, and that run reads every deadline
again). The sleep is a timer on
the event loop that sends a :class:`~actors.messages.Tick`; an actor never
sleeps inside a handler. Each timer carries a sequence number and only the
newest one counts.

A run: ``expire_due`` (batches until short), then ``hand_back_drained`` (the
active attempts of drained hosts past their drain deadline, likewise), then for
each ended attempt tell its Lease actor the attempt ended, emit the task event,
and wake the Scheduler (devices are free, retrying tasks may be eligible). The
next wake-up is the earliest attempt deadline or drain deadline.

With a :class:`~persistence.clock.ManualClock` time does not pass by itself:
tests advance the clock and poke the reaper (``ControlPlane.poke_reaper()``,
i.e. ``reaper.tell(Tick())``).
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta

import structlog
from pykka import ActorDeadError

from fleetlease.actors import failpoints
from fleetlease.actors.base import Context, FleetActor
from fleetlease.actors.messages import Crash, DeadlineHint, Rebuild, Tick
from fleetlease.ops.observe import metrics
from fleetlease.persistence.errors import RepositoryError
from fleetlease.persistence.model import Assignment, Expired

log = structlog.get_logger("fleetlease.reaper")

#: Added to a deadline so that the run happens strictly after it.
_EPSILON_S = 0.01


def _earliest(a: datetime | None, b: datetime | None) -> datetime | None:
    if a is None or b is None:
        return a if b is None else b
    return min(a, b)


class ReaperActor(FleetActor):
    kind = "reaper"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._timer_seq = 0
        self._next_at: datetime | None = None
        self.handle(Tick, self._tick)
        self.handle(DeadlineHint, self._hint)
        self.handle(Rebuild, self._rebuild)
        self.handle(Crash, lambda m: None)

    def _tick(self, m: Tick) -> None:
        if m.seq is not None and m.seq != self._timer_seq:
            return  # superseded timer
        self._run()

    def _publish(self, next_at: datetime | None) -> None:
        # Hints of deadlines at or after next_at are not sent (see
        # Supervisor.hint_deadline); while a run reads, every hint is.
        if self.ctx.supervisor is not None:
            self.ctx.supervisor.reaper_next_at = next_at

    def _hint(self, m: DeadlineHint) -> None:
        self.ctx.stats.incr("reaper_hints")
        if self._next_at is None or m.at < self._next_at:
            self._schedule(m.at)

    def _rebuild(self, m: Rebuild) -> None:
        # The crashed reaper may have committed expiries without telling the Lease
        # actors: end every Lease actor whose attempt is no longer active.
        mark = self.ctx.sup.mark()
        actives: list[Assignment] = self.ctx.db(self.ctx.repo.active_attempts())
        self.ctx.sup.reconcile_leases(actives, mark)
        log.info("reaper.rebuilt", active=len(actives))
        self._run()

    def _run(self) -> None:
        self._publish(None)
        self.ctx.stats.incr("reaper_runs")
        try:
            failpoints.hit(failpoints.REAPER_BEFORE_EXPIRE)
            total = 0
            while True:
                expired: list[Expired] = self.ctx.db(
                    self.ctx.repo.expire_due(limit=self.ctx.expire_batch)
                )
                failpoints.hit(failpoints.REAPER_AFTER_EXPIRE_COMMIT)
                total += len(expired)
                self._ended(expired)
                if len(expired) < self.ctx.expire_batch:
                    break
            while True:
                drained: list[Expired] = self.ctx.db(
                    self.ctx.repo.hand_back_drained(limit=self.ctx.expire_batch)
                )
                total += len(drained)
                self._ended(drained)
                if len(drained) < self.ctx.expire_batch:
                    break
            nd: datetime | None = _earliest(
                self.ctx.db(self.ctx.repo.next_deadline()),
                self.ctx.db(self.ctx.repo.next_drain_deadline()),
            )
        except RepositoryError as exc:
            log.warning("reaper.run_failed", error=exc.message, code=exc.code)
            self._schedule(None, retry=True)
            return
        except failpoints.FailPointError:
            raise  # a deliberate crash: the replacement schedules itself
        except Exception as exc:
            # Not a typed error (a bug, a driver error that escaped translation):
            # keep the timer alive whatever happens.
            log.error("reaper.run_error", error=repr(exc), exc_info=True)
            self._schedule(None, retry=True)
            return
        finally:
            # Devices may be free and retrying tasks eligible (coalesced; cheap).
            self.ctx.sup.wake_scheduler()
        if total:
            log.info("reaper.expired", count=total)
        self._schedule(nd)

    def _ended(self, expired: list[Expired]) -> None:
        if not expired:
            return
        self.ctx.stats.incr("expired", len(expired))
        metrics.expired(expired)
        for e in expired:
            self.ctx.sup.attempt_ended(e.task_id, e.attempt)
        self.ctx.emit(
            [
                self.ctx.event(
                    task_id=e.task_id, state=e.new_state, attempt=e.attempt, host_id=e.host_id
                )
                for e in expired
            ]
        )

    def _schedule(self, at: datetime | None, *, retry: bool = False) -> None:
        now = self.ctx.clock.now()
        if retry or at is None:
            delay = self.ctx.reaper_max_sleep_s
        elif at <= now:
            # Nothing expirable is left, so a past deadline is a retrying task's
            # eligible_at waiting for a device: the Scheduler's business. Re-check
            # later rather than spin.
            delay = self.ctx.reaper_idle_recheck_s
        else:
            delay = min((at - now).total_seconds() + _EPSILON_S, self.ctx.reaper_max_sleep_s)
        self._next_at = now + timedelta(seconds=delay)
        self._publish(self._next_at)
        self._timer_seq += 1
        seq = self._timer_seq
        ref = self.actor_ref

        def fire() -> None:
            with contextlib.suppress(ActorDeadError):
                ref.tell(Tick(seq=seq))

        loop = self.ctx.bridge.loop
        self.ctx.bridge.call_soon(loop.call_later, delay, fire)
