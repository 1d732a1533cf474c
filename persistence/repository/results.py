"""Results: the terminal report of an attempt, and its replay."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict, Forbidden, Invalid
from fleetlease.persistence.model import (
    TERMINAL_STATES,
    EndReason,
    Outcome,
    ResultRecord,
    Session,
    TaskState,
)
from fleetlease.persistence.repository._retry import _after_failure
from fleetlease.persistence.repository._sql import _LEASED
from fleetlease.persistence.repository._validate import _check_json_dict, _check_str
from fleetlease.persistence.repository.fencing import FencingMixin
from fleetlease.persistence.repository.transitions import (
    Transition,
    TransitionRunner,
    _Batch,
    verb_of,
)
from fleetlease.persistence.secrets import matches, secrets_equal

_OUTCOME_OF_END = {
    EndReason.DONE.value: Outcome.DONE,
    EndReason.FAILED.value: Outcome.FAILED,
    EndReason.RETRYABLE_FAILURE.value: Outcome.FAILED,
    EndReason.CANCELLED.value: Outcome.CANCELLED,
}


class ResultMixin(TransitionRunner, FencingMixin):
    """Recording an attempt's result."""

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
        """Terminal report from the active lease: done / failed / cancelled; a
        retryable failure with attempts left goes to retrying (eligible_at = now +
        backoff). Releases the reservation. Replay with the same attempt and
        fingerprint returns the recorded outcome (``replayed=True``); a different
        fingerprint or a stale attempt is ``Conflict``.

        ``report_result_op`` builds it as a :class:`Transition`, validated now and run
        later (alone, or sharing a transaction in ``run_many``); ``report_result``
        runs it in a transaction of its own."""
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

    report_result = verb_of(report_result_op, ResultRecord)

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
