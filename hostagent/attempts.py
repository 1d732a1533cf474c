"""The attempts this process holds: ack, run, renew, record, report; and the
journal entries the control plane confirms after a registration.

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

Confirmed journal entries that this process is not running (a restart) are
resumed: a finished one is reported again with the fingerprint stored in the
journal, an unfinished one is run again from the start on its device. Every
such resume is counted in the journal entry (committed before the runner
starts), and the count places the run's log lines after every earlier run's
(``journal.log_seq_base``); an entry already resumed ``max_resumes`` times is not run again but
reported as a retryable failure ("agent died N times running this attempt"),
so a task that kills its agent cannot crash-loop a promptly restarted agent:
the control plane retries it elsewhere or fails it after its max attempts.

An attempt still running when the agent's shutdown grace ends is *handed
back*: its runner is stopped and it is reported as a retryable failure
(:data:`HANDBACK_REASON`), unless the user had requested a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from fleetlease.hostagent.config import (
    FAILPOINT_AFTER_ACK,
    FAILPOINT_AFTER_RESULT_RECORDED,
    FAILPOINT_AFTER_RESULT_REPORTED,
)
from fleetlease.hostagent.devices import UnknownDevice
from fleetlease.hostagent.errors import Aborted
from fleetlease.hostagent.journal import EntryState, JournalError, JournalRecord, log_seq_base
from fleetlease.hostagent.retry import TRANSIENT_CODES, Backoff, sleep_or_event
from fleetlease.hostagent.runners import RunContext, RunOutcome
from fleetlease.hostagent.runners.base import GuardedRunner
from fleetlease.hostagent.session import Session
from fleetlease.hostagent.shipping import ArtifactItem, Shipping
from fleetlease.hostagent.state import AgentState, Attempt
from fleetlease.persistence.model import Outcome, TaskKind
from fleetlease.transport import wire
from fleetlease.transport.wire import RemoteError

__all__ = ["HANDBACK_REASON", "Attempts"]

log = structlog.get_logger("fleetlease.agent")

HANDBACK_REASON = "handed back: agent shutting down"

_MAX_REASON = 1000
_MAX_PROGRESS = 1000


class Attempts:
    """Runs the attempts of one agent, each in a task of its own, from the
    accepted (or resumed) journal entry to the answered report."""

    def __init__(
        self,
        state: AgentState,
        session: Session,
        shipping: Shipping,
        runners: Mapping[TaskKind, GuardedRunner],
    ) -> None:
        self._state = state
        self._config = state.config
        self._session = session
        self._shipping = shipping
        self._runners = runners

    def start(self, record: JournalRecord, ack_deadline: float | None) -> None:
        """Run a freshly accepted attempt (journaled; its device held and busy)."""
        att = Attempt(record=record, ack_deadline=ack_deadline, holds_device=True)
        self._state.attempts[record.key] = att
        att.task = asyncio.ensure_future(self.execute(att))

    async def settle(
        self,
        entries: Sequence[JournalRecord],
        verdicts: Mapping[tuple[str, int], wire.Verdict],
    ) -> tuple[int, int, int]:
        """Apply the reconciliation's verdicts to the journal entries: drop the
        discarded ones (stopping those running), resume the confirmed ones this
        process does not run. Returns (confirmed, discarded, resumed)."""
        state = self._state
        journal = state.journal_or_fail()
        confirmed = discarded = resumed = 0
        for entry in entries:
            verdict = verdicts.get(entry.key)
            att = state.attempts.get(entry.key)
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
                    self.lease_lost(att, f"reconcile: {reason or 'discard'}")
                else:
                    await state.journal_calls.call(journal.remove, entry.task_id, entry.attempt)
                continue
            confirmed += 1
            if att is not None:
                if verdict.cancel_requested:
                    self.request_cancel(att)
                continue
            resumed += 1
            self._resume(entry, cancel_requested=verdict.cancel_requested)
        return confirmed, discarded, resumed

    def hand_back(self, att: Attempt) -> None:
        """Shutdown: stop the runner; the attempt is reported as a retryable
        failure (or cancelled, if the user asked for that)."""
        att.handback = True
        self._state.stats.handed_back += 1
        log.info(
            "attempt_handed_back",
            task_id=att.record.task_id,
            attempt=att.record.attempt,
            reporting=att.reporting,
        )
        att.cancel_event.set()

    def _resume(self, entry: JournalRecord, *, cancel_requested: bool) -> None:
        att = Attempt(record=entry, resumed=True)
        try:
            self._state.mark(entry.device_id, busy=True)
            att.holds_device = True
            self._state.held.add(entry.device_id)
        except UnknownDevice:
            if entry.state is not EntryState.FINISHED:
                # Cannot run it here any more: say so; the retry policy acts.
                att.unrunnable = f"device {entry.device_id!r} is no longer attached"
        self._state.attempts[entry.key] = att
        log.info(
            "attempt_resumed",
            task_id=entry.task_id,
            attempt=entry.attempt,
            device_id=entry.device_id,
            state=str(entry.state),
            resumes=entry.resumes,
        )
        if cancel_requested:
            self.request_cancel(att)
        att.task = asyncio.ensure_future(self.execute(att))

    def request_cancel(self, att: Attempt) -> None:
        if not att.cancel_requested:
            att.cancel_requested = True
            log.info("cancel_requested", task_id=att.record.task_id, attempt=att.record.attempt)
            att.cancel_event.set()

    def lease_lost(self, att: Attempt, reason: str) -> None:
        """The lease is gone: stop the runner; the journal entry may go."""
        if self._stop_attempt(att, reason, "lease_lost"):
            att.entry_done = True
            self._state.stats.leases_lost += 1

    def _stop_attempt(self, att: Attempt, reason: str, event: str) -> bool:
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

    async def execute(self, att: Attempt) -> None:
        rec = att.record
        journal = self._state.journal_or_fail()
        try:
            if att.unrunnable is None and att.resumed and rec.state is not EntryState.FINISHED:
                att.unrunnable = await self._count_resume(att)
            if att.unrunnable is not None:
                await self._record(att, RunOutcome.failed(att.unrunnable, retryable=True))
            elif rec.state is not EntryState.FINISHED:
                if rec.state is EntryState.ACCEPTED:
                    if not await self._ack(att):
                        return
                    await self._state.journal_calls.call(
                        journal.mark_running, rec.task_id, rec.attempt
                    )
                outcome = await self._run(att)
                if outcome is None:
                    return
                await self._record(att, outcome)
            if att.holds_device:
                self._state.releasing.add(rec.device_id)
                # Nothing runs on the device any more, and every snapshot from
                # now on says so; it stays held (claimed only for a handover)
                # until the result is answered. Were it marked idle only then, a
                # snapshot sent between the result's commit and its answer would
                # report it busy, and nothing would correct that before the next
                # periodic heartbeat (lease flips send none).
                self._state.mark(rec.device_id, busy=False)
                self._state.wake.set()
            await self.report(att)
        except Aborted:
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
                    await self._state.journal_calls.call(journal.remove, rec.task_id, rec.attempt)
            self._state.attempts.pop(rec.key, None)
            if att.holds_device:
                self._state.releasing.discard(rec.device_id)
                successor = self._state.handover.pop(rec.device_id, None)
                if successor is not None and not successor.done():
                    successor.set_result(None)  # held, and busy again by the next attempt
                else:
                    self._state.held.discard(rec.device_id)
                    self._state.mark(rec.device_id, busy=False)
            self._state.wake.set()

    async def _count_resume(self, att: Attempt) -> str | None:
        """Before running a resumed attempt again: count the resume durably, or
        give the attempt up (the reason to report) when it has been resumed
        ``max_resumes`` times already, each time dying with the agent."""
        rec = att.record
        if rec.resumes >= self._config.max_resumes:
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
        journal = self._state.journal_or_fail()
        count = await self._state.journal_calls.call(journal.begin_resume, rec.task_id, rec.attempt)
        # This run's log lines take seqs no earlier run used: the control plane
        # ignores a seq it already has.
        att.log_seq = log_seq_base(count)
        log.info("attempt_resume_counted", task_id=rec.task_id, attempt=rec.attempt, resumes=count)
        return None

    async def _ack(self, att: Attempt) -> bool:
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
        self._state.failpoint(FAILPOINT_AFTER_ACK, task_id=rec.task_id, attempt=rec.attempt)
        if reply.cancel_requested:
            self.request_cancel(att)
        return True

    async def _ack_until_answered(
        self, att: Attempt, overdue: asyncio.Event
    ) -> wire.LeaseReply | None:
        """The ack's reply; None if the lease is lost or the ack is given up.
        Once the session is up the first ack is always sent and waited for in
        full (a clock running ahead of the control plane's must not lose every
        ack); no retry, nor a wait for a session, goes on past ``overdue``."""
        rec = att.record
        backoff = self._state.backoff()
        sent = False
        while not att.lost.is_set():
            if sent and overdue.is_set():
                self._ack_given_up(att, "ack unanswered at the ack deadline")
                return None
            try:
                return await self._session.call(
                    lambda c: c.ack(rec.task_id, rec.attempt, rec.lease_token),
                    abort=att.lost,
                    timeout_s=self._config.request_timeout_s,
                    give_up=overdue,
                )
            except Aborted:
                if att.lost.is_set():
                    raise
                self._ack_given_up(att, "no session to ack on by the ack deadline")
                return None
            except RemoteError as exc:
                sent = True
                if exc.code not in TRANSIENT_CODES:
                    self.lease_lost(att, f"ack refused: {exc.code}")
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
                await sleep_or_event(delay, att.lost, overdue)
        return None

    def _ack_given_up(self, att: Attempt, reason: str) -> None:
        """Stop trying to ack: the runner never starts. Unlike a lost lease the
        journal entry stays, for the next reconciliation to settle (discarded
        if the control plane expired the attempt, resumed if an ack got through
        just in time)."""
        if self._stop_attempt(att, reason, "ack_given_up"):
            self._state.stats.acks_given_up += 1

    def context(self, att: Attempt) -> RunContext:
        rec = att.record

        def log_line(line: str) -> None:
            self._state.in_loop(lambda: self._shipping.enqueue_log(att, str(line)))

        def artifact(name: str, data: bytes) -> None:
            item = ArtifactItem(rec.task_id, rec.attempt, rec.lease_token, str(name), bytes(data))
            self._state.in_loop(lambda: self._shipping.enqueue_artifact(item))

        def progress(message: str) -> None:
            def apply() -> None:
                att.progress_message = str(message)[:_MAX_PROGRESS]

            self._state.in_loop(apply)

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

    async def _run(self, att: Attempt) -> RunOutcome | None:
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
        run_task: asyncio.Task[RunOutcome] = asyncio.ensure_future(runner.run(self.context(att)))
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
                    cancel_deadline = loop.time() + self._config.cancel_timeout_s
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

    def _final_outcome(self, att: Attempt, outcome: RunOutcome) -> RunOutcome:
        if att.handback and not att.cancel_requested and outcome.outcome is Outcome.CANCELLED:
            return RunOutcome.failed(HANDBACK_REASON, retryable=True)
        return outcome

    async def _record(self, att: Attempt, outcome: RunOutcome) -> None:
        rec = att.record
        journal = self._state.journal_or_fail()
        reason = outcome.reason[:_MAX_REASON]
        # Recorded and read back in one executor call (the stored entry holds
        # the first recorded result, should there have been one already).
        try:
            stored = await self._state.journal_calls.call(
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
            stored = await self._state.journal_calls.call(
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
        self._state.failpoint(
            FAILPOINT_AFTER_RESULT_RECORDED, task_id=rec.task_id, attempt=rec.attempt
        )

    async def report(self, att: Attempt) -> None:
        """Report the recorded outcome until the control plane answers."""
        rec = att.record
        assert rec.outcome is not None and rec.fingerprint is not None
        outcome, fingerprint = rec.outcome, rec.fingerprint
        att.reporting = True
        backoff = self._state.backoff()
        try:
            await self._shipping.flush_artifacts(att)
            while not att.lost.is_set():
                try:
                    reply = await self._session.call(
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
                        timeout_s=self._config.request_timeout_s,
                    )
                except RemoteError as exc:
                    if exc.code in TRANSIENT_CODES:
                        delay = backoff.next_delay()
                        log.warning(
                            "result_report_retry",
                            task_id=rec.task_id,
                            attempt=rec.attempt,
                            code=exc.code,
                            retry_in_s=round(delay, 3),
                        )
                        await sleep_or_event(delay, att.lost)
                        continue
                    att.entry_done = True
                    self._state.stats.results_rejected += 1
                    log.warning(
                        "result_rejected",
                        task_id=rec.task_id,
                        attempt=rec.attempt,
                        code=exc.code,
                        error=exc.message,
                    )
                    return
                self._state.failpoint(
                    FAILPOINT_AFTER_RESULT_REPORTED, task_id=rec.task_id, attempt=rec.attempt
                )
                att.entry_done = True
                self._state.stats.results_reported += 1
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

    async def _renew_loop(self, att: Attempt) -> None:
        rec = att.record
        interval = max(rec.lease_s / 3.0, 0.05)
        backoff = Backoff(
            min(self._config.backoff_base_s, interval),
            max(interval, self._config.backoff_base_s),
            rng=self._state.rng,
        )
        delay = interval
        loop = asyncio.get_running_loop()
        # The lease as far as this agent can vouch for it: lease_s after the last
        # answered renewal, counted from when it was sent (the control plane's
        # deadline is never earlier). Past it the lease is lost even when nobody
        # can say so (a partition): stop the runner rather than run on unleased.
        valid_until = loop.time() + rec.lease_s
        while True:
            if await sleep_or_event(delay, att.lost):
                return
            sent = loop.time()
            try:
                reply = await self._renew_once(att, timeout_s=max(interval, 1.0))
            except Aborted:
                return
            except RemoteError as exc:
                if exc.code in TRANSIENT_CODES:
                    if loop.time() >= valid_until and not att.reporting:
                        self.lease_lost(att, "lease expired locally: no renewal answered")
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
                self.lease_lost(att, f"renewal refused: {exc.code}")
                return
            backoff.reset()
            delay = interval
            valid_until = sent + rec.lease_s
            if reply.cancel_requested and not att.reporting:
                self.request_cancel(att)

    async def _renew_once(self, att: Attempt, *, timeout_s: float) -> wire.LeaseReply:
        """One renewal: a progress report when the runner said something new
        (it extends the lease too), else a plain renew."""
        rec = att.record
        message = att.progress_message
        if message is None:
            return await self._session.call(
                lambda c: c.renew(rec.task_id, rec.attempt, rec.lease_token),
                abort=att.lost,
                timeout_s=timeout_s,
            )
        seq = att.progress_seq + 1
        reply = await self._session.call(
            lambda c: c.progress(rec.task_id, rec.attempt, rec.lease_token, seq, message),
            abort=att.lost,
            timeout_s=timeout_s,
        )
        att.progress_seq = seq
        if att.progress_message is message:
            att.progress_message = None
        return reply

    # --- logs and artifacts -----------------------------------------------------------------
