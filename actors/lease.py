"""The Lease actor: one per task in assigned, dispatched or running.

Every host message about its task that changes its state (claim, ack, progress,
result) and a user's cancel of it are handled by it, one at a time. Claims,
acks, progress and results are handed to the event loop (``Context.hand_off``):
the loop writes the transition through (group commit), answers the host right
after the commit, emits the transition's event (a claim's, an ack's or a
result's, unless it was a replay) and then tells the actor ``Committed``, on
which it updates its cache and decides whether to stop (and emits a progress
report's event if its state changed). The actor does not wait for the commit,
and neither the answer nor the event comes back through its thread: three
thread hops per transition instead of five, and only two before the answer. A
failed write is a typed error answer and the actor is not told. Renewals and
cancel polls go around it, straight to the renewal group commit (see
``actors/runtime.py``); it is told of one (``Renewed``) when the answer carries
a pending cancel. It still handles ``Renew`` and ``CancelPoll`` sent to it, and a
user's ``Cancel``, by waiting for their commit.

The cache (attempt, state, deadline, cancel flag) is never used to accept or
refuse a message: the repository fences every message in its own transaction,
so a fresh actor built from the database answers exactly as an old one would,
and two transitions of one task in flight at once are decided by the database.
The cache serves events, introspection and the decision to stop: the actor stops
itself once its task leaves the active states (a result, a completed cancel, or
the Reaper / a reconcile telling it its attempt ended). ``Committed`` goes to
whichever Lease actor is current for the task when the commit lands, so a
replacement started meanwhile still learns that its task ended.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import structlog

from fleetlease.actors import failpoints
from fleetlease.actors.base import Context, FleetActor
from fleetlease.actors.messages import (
    Ack,
    Adopt,
    AttemptEnded,
    Cancel,
    CancelPoll,
    Claim,
    Committed,
    Crash,
    Progress,
    Rebuild,
    Renew,
    Renewed,
    ReportResult,
)
from fleetlease.persistence.model import (
    Assignment,
    Claimed,
    LeaseStatus,
    Outcome,
    ResultRecord,
    TaskState,
)
from fleetlease.persistence.repository import Renewal

log = structlog.get_logger("fleetlease.lease")


class LeaseActor(FleetActor):
    kind = "lease"
    start_in_background = True

    def __init__(self, ctx: Context, assignment: Assignment) -> None:
        super().__init__(ctx)
        self.assignment = assignment
        self.task_id = assignment.task_id
        self.attempt = assignment.attempt
        self.host_id = assignment.host_id
        self.device_id = assignment.device_id
        self.state: TaskState = TaskState.ASSIGNED
        self.lease_expires_at: datetime | None = None
        self.cancel_requested = False
        self.handle(Claim, self._claim)
        self.handle(Ack, self._ack)
        self.handle(Renew, self._renew)
        self.handle(CancelPoll, self._renew)
        self.handle(Renewed, lambda m: self._after_status(None, m.status))
        self.handle(Progress, self._progress)
        self.handle(ReportResult, self._report_result)
        self.handle(Cancel, self._cancel)
        self.handle(Adopt, self._adopt)
        self.handle(AttemptEnded, self._attempt_ended)
        self.handle(Rebuild, self._rebuild)
        self.handle(Committed, self._committed)
        self.handle(Crash, lambda m: None)

    def describe(self) -> dict[str, Any]:
        return {"actor": self.kind, "task_id": self.task_id, "attempt": self.attempt}

    # --- host messages ----------------------------------------------------------------
    # Claims, acks, progress and results are handed to the event loop (see
    # Context.hand_off): the loop commits, answers the host, and tells this actor
    # Committed; the handler does not wait for the commit.
    def _claim(self, m: Claim) -> None:
        failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)
        self.ctx.hand_off(
            "claim", self.ctx.repo.claim_op(m.session, m.task_id, m.attempt), m.reply, self.task_id
        )

    def _ack(self, m: Ack) -> None:
        failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)
        self.ctx.hand_off(
            "ack",
            self.ctx.repo.ack_op(m.session, m.task_id, m.attempt, m.lease_token),
            m.reply,
            self.task_id,
        )

    def _committed(self, m: Committed) -> None:
        # The loop emitted the event of a claim, an ack or a result already.
        if m.kind == "claim":
            self._claimed(m.outcome)
        elif m.kind == "result":
            self._result_recorded(m.outcome)
        else:
            self._after_status(None, m.outcome, emit=m.kind != "ack")

    def _claimed(self, claimed: Claimed) -> None:
        if claimed.attempt < self.attempt:
            return
        self._set(attempt=claimed.attempt, state=TaskState.DISPATCHED)
        self.ctx.sup.hint_deadline(claimed.ack_deadline)

    def _renew(self, m: Renew | CancelPoll) -> None:
        failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)
        if self.ctx.renew is not None:
            coro = self.ctx.renew(
                Renewal(
                    session=m.session,
                    task_id=m.task_id,
                    attempt=m.attempt,
                    lease_token=m.lease_token,
                )
            )
        else:
            coro = self.ctx.repo.renew(m.session, m.task_id, m.attempt, m.lease_token)
        status = self.ctx.db(coro)
        failpoints.hit(failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY)
        self._after_status(m.reply, status)

    def _progress(self, m: Progress) -> None:
        failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)
        self.ctx.hand_off(
            "progress",
            self.ctx.repo.progress_op(m.session, m.task_id, m.attempt, m.lease_token, m.seq),
            m.reply,
            self.task_id,
        )

    def _report_result(self, m: ReportResult) -> None:
        failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)
        self.ctx.hand_off(
            "result",
            self.ctx.repo.report_result_op(
                m.session,
                m.task_id,
                m.attempt,
                m.lease_token,
                outcome=Outcome(m.outcome),
                retryable=m.retryable,
                reason=m.reason,
                result=m.result,
                fingerprint=m.fingerprint,
            ),
            m.reply,
            self.task_id,
        )

    def _result_recorded(self, record: ResultRecord) -> None:
        if record.attempt < self.attempt:
            return  # a replay of an older attempt's report: nothing about ours changed
        self._set(attempt=record.attempt, state=record.state)
        if not record.state.is_active:
            self.ctx.sup.wake_scheduler()  # the device is free again
            self.stop_self()

    # --- user and runtime messages -----------------------------------------------------
    def _cancel(self, m: Cancel) -> None:
        failpoints.hit(failpoints.LEASE_BEFORE_COMMIT)
        record = self.ctx.db(self.ctx.repo.request_cancel(m.task_id, m.user))
        failpoints.hit(failpoints.LEASE_AFTER_COMMIT_BEFORE_REPLY)
        assert m.reply is not None
        m.reply.set_result(record)
        previous = self.state
        self.cancel_requested = True
        self.state = record.state
        if record.state != previous:
            self._emit(record.state)
        if not record.state.is_active:
            self.ctx.sup.wake_scheduler()
            self.stop_self()

    def _adopt(self, m: Adopt) -> None:
        a = m.assignment
        if a.task_id != self.task_id or a.attempt < self.attempt:
            return
        if a.attempt > self.attempt:
            self.state = TaskState.ASSIGNED
            self.lease_expires_at = None
            self.cancel_requested = False
        self.assignment = a
        self.attempt = a.attempt
        self.host_id = a.host_id
        self.device_id = a.device_id

    def _attempt_ended(self, m: AttemptEnded) -> None:
        if m.attempt >= self.attempt:
            self.stop_self()

    def _rebuild(self, m: Rebuild) -> None:
        """Reload from the database: the task's active attempt on its host, or, if
        it has none any more, stop (nothing left to serve)."""
        actives: list[Assignment] = self.ctx.db(self.ctx.repo.active_attempts(self.host_id))
        mine = [a for a in actives if a.task_id == self.task_id]
        if not mine:
            log.info("lease.rebuild_inactive", **self.describe())
            self.stop_self()
            return
        current = max(mine, key=lambda a: a.attempt)
        self._adopt(Adopt(assignment=current))
        log.info("lease.rebuilt", **self.describe())

    # --- helpers ------------------------------------------------------------------------
    def _after_status(self, reply: Any, status: LeaseStatus, *, emit: bool = True) -> None:
        if reply is not None:
            reply.set_result(status)
        if status.attempt < self.attempt:
            return
        previous = self.state
        self._set(attempt=status.attempt, state=status.state)
        self.lease_expires_at = status.lease_expires_at
        self.cancel_requested = status.cancel_requested
        if status.state != previous:
            if emit:
                self._emit(status.state)
            if status.state is TaskState.RUNNING:
                self.ctx.sup.hint_deadline(status.lease_expires_at)
        if not status.state.is_active:
            self.stop_self()

    def _set(self, *, attempt: int, state: TaskState) -> None:
        if attempt > self.attempt:
            self.cancel_requested = False
            self.lease_expires_at = None
        self.attempt = max(self.attempt, attempt)
        self.state = state

    def _emit(self, state: TaskState) -> None:
        self.ctx.emit(
            [
                self.ctx.event(
                    task_id=self.task_id, state=state, attempt=self.attempt, host_id=self.host_id
                )
            ]
        )
