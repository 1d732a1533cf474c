"""What must hold in the database after any fault: the one checker shared by the
fault tests (``tests/faults``) and ``fleetlease soak``.

Two halves:

- :class:`Observer` samples the database *during* a run, each sample one
  consistent snapshot (REPEATABLE READ): never two unended attempts on one
  device or for one task, every unended attempt holds its own device's
  reservation, a task's attempt number never goes down, a terminal task never
  changes again (state, attempt, recorded result).
- :func:`check` reads the database *after* the run and compares it with what
  clients were told (:class:`Acknowledged`): every acknowledged submit exists;
  every task is terminal (or legitimately active when allowed); attempts are
  numbered 1..n, ended unless current; attempt time ranges never overlap per
  device or per task; a report was accepted only before its deadline and an
  expiry only after it (so no stale report changed state and exactly one of
  renew/expire won); every acknowledged ack and result is in the database (a result with its
  fingerprint); no attempt was acknowledged as finished twice with different
  results; no reservation outlives its attempt.

Reservation history: every transaction stamps its rows with the clock read
when it *started*, so an assignment whose transaction began before the commit
that freed its device (a slow transaction, injected latency) carries an
``assigned_at`` earlier than the previous attempt's ``ended_at`` although the
two never overlapped. Attempt time ranges are therefore only a fallback (with
``OVERLAP_TOLERANCE_S``). The fault suite installs an audit trail instead
(:func:`install_reservation_audit`): an AFTER trigger on ``device_reservations``
records every reserve and release with ``clock_timestamp()`` taken when the row
changed, in the same transaction (so only committed history stays). A device or
task reserved again before its release is then an exact violation.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence import tables

TERMINAL = frozenset({"done", "failed", "cancelled"})
ACTIVE = frozenset({"assigned", "dispatched", "running"})
WAITING = frozenset({"queued", "retrying"})
#: End reasons written by a host's report (fenced by the deadline).
REPORTED = frozenset({"done", "failed", "retryable_failure", "cancelled"})
#: End reasons written by the reaper when a deadline passed.
EXPIRED = {"claim_expired": "claim_deadline", "ack_expired": "ack_deadline"}
OVERLAP_TOLERANCE_S = 0.5


AUDIT_TABLE = "fault_reservation_audit"
_AUDIT_DDL = [
    f"""CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} (
        id bigserial PRIMARY KEY, op text NOT NULL, host_id text NOT NULL,
        device_id text NOT NULL, task_id uuid NOT NULL, attempt integer NOT NULL,
        at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    f"""CREATE OR REPLACE FUNCTION fault_audit_reservation() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP IN ('DELETE', 'UPDATE') THEN
            INSERT INTO {AUDIT_TABLE} (op, host_id, device_id, task_id, attempt)
            VALUES ('release', OLD.host_id, OLD.device_id, OLD.task_id, OLD.attempt);
        END IF;
        IF TG_OP IN ('INSERT', 'UPDATE') THEN
            INSERT INTO {AUDIT_TABLE} (op, host_id, device_id, task_id, attempt)
            VALUES ('reserve', NEW.host_id, NEW.device_id, NEW.task_id, NEW.attempt);
        END IF;
        RETURN NULL;
    END $$""",
    "DROP TRIGGER IF EXISTS fault_audit_reservation ON device_reservations",
    """CREATE TRIGGER fault_audit_reservation
    AFTER INSERT OR UPDATE OR DELETE ON device_reservations
    FOR EACH ROW EXECUTE FUNCTION fault_audit_reservation()""",
]


async def install_reservation_audit(engine: AsyncEngine) -> None:
    """Record every reservation change (see the module docstring). Test and soak
    databases only: it is not part of the schema."""
    async with engine.begin() as conn:
        for sql in _AUDIT_DDL:
            await conn.execute(sa.text(sql))


def _audit_violations(events: list[Any]) -> list[str]:
    """Replay the audit trail: never a second reserve of a device or of a task
    before its release."""
    out: list[str] = []
    by_device: dict[tuple[str, str], str] = {}
    by_task: dict[str, str] = {}
    for e in events:
        device, task, who = (e.host_id, e.device_id), str(e.task_id), f"{e.task_id}#{e.attempt}"
        if e.op == "reserve":
            if device in by_device:
                out.append(
                    f"device {e.host_id}/{e.device_id} reserved for {who} at {e.at} "
                    f"while held by {by_device[device]}"
                )
            if task in by_task:
                out.append(f"task {task} reserved again ({who}) while holding {by_task[task]}")
            by_device[device] = who
            by_task[task] = who
        else:
            by_device.pop(device, None)
            by_task.pop(task, None)
    return out


@dataclass
class Acknowledged:
    """What clients were told succeeded (the database must still say so)."""

    #: Task ids whose submit was acknowledged.
    submitted: set[str] = field(default_factory=set)
    #: (task, attempt) -> fingerprints of results acknowledged as recorded
    #: (``replayed`` False: the first, accepted report).
    results: dict[tuple[str, int], list[str]] = field(default_factory=lambda: defaultdict(list))
    #: (task, attempt) pairs whose ack (dispatched -> running) was acknowledged.
    acked: set[tuple[str, int]] = field(default_factory=set)
    #: (task, attempt) -> fingerprints acknowledged as replays of a recorded result.
    replays: dict[tuple[str, int], list[str]] = field(default_factory=lambda: defaultdict(list))

    def result(self, task_id: str, attempt: int, fingerprint: str, *, replayed: bool) -> None:
        (self.replays if replayed else self.results)[(task_id, attempt)].append(fingerprint)


@dataclass
class Observer:
    """Samples taken during a run; ``violations`` collects what they found."""

    violations: list[str] = field(default_factory=list)
    samples: int = 0
    failed_samples: int = 0
    _attempt: dict[str, int] = field(default_factory=dict)
    _terminal: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    async def sample(self, engine: AsyncEngine) -> bool:
        """One consistent snapshot; False if the database could not be read (a
        restart in progress), which is not a violation."""
        try:
            rows, twice, unreserved = await _snapshot(engine)
        except (sa.exc.DBAPIError, OSError, TimeoutError, sa.exc.TimeoutError):
            self.failed_samples += 1
            return False
        self.samples += 1
        found: list[str] = []
        for host, device, n in twice:
            found.append(f"device {host}/{device} has {n} unended attempts")
        for task_id, number, device, reserved in unreserved:
            found.append(f"attempt {task_id}#{number} on {device} holds reservation {reserved}")
        for r in rows:
            tid = str(r.id)
            prev = self._attempt.get(tid)
            if prev is not None and r.attempt < prev:
                found.append(f"task {tid}: attempt went down from {prev} to {r.attempt}")
            self._attempt[tid] = max(prev or 0, r.attempt)
            key = (r.status, r.attempt, r.result_fingerprint, r.result_attempt)
            if tid in self._terminal and self._terminal[tid] != key:
                found.append(f"task {tid}: terminal {self._terminal[tid]} changed to {key}")
            if r.status in TERMINAL and tid not in self._terminal:
                self._terminal[tid] = key
        for v in found:
            if v not in self.violations:
                self.violations.append(v)
        return True


async def _snapshot(engine: AsyncEngine) -> tuple[list[Any], list[Any], list[Any]]:
    t, a, r = tables.tasks, tables.attempts, tables.device_reservations
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            rows = (
                await conn.execute(
                    sa.select(
                        t.c.id, t.c.status, t.c.attempt, t.c.result_fingerprint, t.c.result_attempt
                    )
                )
            ).all()
            twice: list[Any] = list(
                (
                    await conn.execute(
                        sa.select(a.c.host_id, a.c.device_id, sa.func.count())
                        .where(a.c.ended_at.is_(None))
                        .group_by(a.c.host_id, a.c.device_id)
                        .having(sa.func.count() > 1)
                    )
                ).all()
            )
            twice += (
                await conn.execute(
                    sa.select(sa.literal("task"), sa.cast(a.c.task_id, sa.Text), sa.func.count())
                    .where(a.c.ended_at.is_(None))
                    .group_by(a.c.task_id)
                    .having(sa.func.count() > 1)
                )
            ).all()
            unreserved = (
                await conn.execute(
                    sa.select(a.c.task_id, a.c.number, a.c.device_id, r.c.device_id)
                    .select_from(
                        a.outerjoin(
                            r,
                            sa.and_(
                                r.c.task_id == a.c.task_id,
                                r.c.attempt == a.c.number,
                                r.c.host_id == a.c.host_id,
                            ),
                        )
                    )
                    .where(
                        a.c.ended_at.is_(None),
                        sa.or_(r.c.device_id.is_(None), r.c.device_id != a.c.device_id),
                    )
                )
            ).all()
    return list(rows), list(twice), list(unreserved)


@dataclass
class Report:
    violations: list[str]
    tasks: int
    by_state: dict[str, int]
    attempts: int

    @property
    def ok(self) -> bool:
        return not self.violations


async def check(
    engine: AsyncEngine,
    *,
    acknowledged: Acknowledged | None = None,
    observer: Observer | None = None,
    task_ids: set[str] | None = None,
    allow_active: bool = False,
) -> Report:
    """Check the database now (see the module docstring). ``task_ids`` limits
    the check to these tasks (default: all); ``allow_active`` accepts tasks that
    are legitimately still waiting or in flight."""
    ack = acknowledged or Acknowledged()
    async with engine.connect() as conn:
        conn = await conn.execution_options(isolation_level="REPEATABLE READ")
        async with conn.begin():
            tasks = {
                str(r["id"]): dict(r)
                for r in (await conn.execute(sa.select(tables.tasks))).mappings()
            }
            attempts = [
                dict(r) for r in (await conn.execute(sa.select(tables.attempts))).mappings()
            ]
            reservations = [
                dict(r)
                for r in (await conn.execute(sa.select(tables.device_reservations))).mappings()
            ]
            audited = bool(
                (
                    await conn.execute(
                        sa.text("SELECT to_regclass(:t) IS NOT NULL"), {"t": AUDIT_TABLE}
                    )
                ).scalar()
            )
            audit: list[Any] = []
            if audited:
                audit = list(
                    (
                        await conn.execute(
                            sa.text(
                                "SELECT op, host_id, device_id, task_id, attempt, at "
                                f"FROM {AUDIT_TABLE} ORDER BY at, id"
                            )
                        )
                    ).all()
                )
    scope = set(tasks) if task_ids is None else set(task_ids)
    v: list[str] = list(observer.violations) if observer is not None else []

    for tid in sorted(ack.submitted - set(tasks)):
        v.append(f"task {tid}: submit was acknowledged but the task is not in the database")

    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_device: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for a in attempts:
        by_task[str(a["task_id"])].append(a)
        by_device[(a["host_id"], a["device_id"])].append(a)
    reserved = {(str(r["task_id"]), r["attempt"]): r for r in reservations}

    by_state: dict[str, int] = defaultdict(int)
    for tid in sorted(scope & set(tasks)):
        t = tasks[tid]
        state, n = str(t["status"]), int(t["attempt"])
        by_state[state] += 1
        history = sorted(by_task[tid], key=lambda a: a["number"])
        numbers = [a["number"] for a in history]
        if numbers != list(range(1, n + 1)):
            v.append(f"task {tid}: attempts {numbers} for attempt counter {n}")
        if n > int(t["max_attempts"]):
            v.append(f"task {tid}: attempt {n} beyond max_attempts {t['max_attempts']}")
        if state not in TERMINAL and not (allow_active and (state in ACTIVE or state in WAITING)):
            v.append(f"task {tid}: not terminal ({state}, attempt {n})")
        unended = [a for a in history if a["ended_at"] is None]
        if state in ACTIVE:
            if [a["number"] for a in unended] != [n]:
                v.append(
                    f"task {tid}: {state} but unended attempts {[a['number'] for a in unended]}"
                )
        elif unended:
            v.append(f"task {tid}: {state} with unended attempts {[a['number'] for a in unended]}")
        if state == "done":
            last = history[-1] if history else None
            if last is None or last["end_reason"] != "done" or t["result_attempt"] != n:
                v.append(f"task {tid}: done without a done report on its last attempt")
        for prev, nxt in itertools.pairwise(history):
            if prev["ended_at"] is None:
                v.append(f"task {tid}: attempt {prev['number']} never ended before {nxt['number']}")
            elif audited:
                pass  # the audit trail below is exact
            elif nxt["assigned_at"] + timedelta(seconds=OVERLAP_TOLERANCE_S) < prev["ended_at"]:
                v.append(
                    f"task {tid}: attempt {nxt['number']} assigned before {prev['number']} ended"
                )
        for a in history:
            v += _fencing(tid, a)
        for number in sorted(n for t_, n in ack.acked if t_ == tid):
            att = [a for a in history if a["number"] == number]
            if not att or att[0]["acked_at"] is None:
                v.append(f"task {tid} attempt {number}: ack acknowledged but not recorded")
        for key in [k for k in ack.results if k[0] == tid]:
            v += _acknowledged(tid, key[1], ack.results[key], t, history)

    if audited:
        v += _audit_violations(audit)
    for (host, device), rows in [] if audited else list(by_device.items()):
        rows = sorted(rows, key=lambda a: a["assigned_at"])
        for prev, nxt in itertools.pairwise(rows):
            end = prev["ended_at"]
            if end is None or nxt["assigned_at"] + timedelta(seconds=OVERLAP_TOLERANCE_S) < end:
                v.append(
                    f"device {host}/{device}: {prev['task_id']}#{prev['number']} and "
                    f"{nxt['task_id']}#{nxt['number']} overlap"
                )

    for (tid, number), r in reserved.items():
        match = [a for a in by_task[tid] if a["number"] == number and a["ended_at"] is None]
        if not match or match[0]["device_id"] != r["device_id"]:
            v.append(f"reservation of {r['host_id']}/{r['device_id']} outlives {tid}#{number}")

    return Report(
        violations=v, tasks=len(scope & set(tasks)), by_state=dict(by_state), attempts=len(attempts)
    )


def _fencing(tid: str, a: dict[str, Any]) -> list[str]:
    """A report is accepted only before the attempt's deadline; an expiry only
    at or after it. (Deadlines are stamped by the same clock as ``ended_at``.)"""
    reason, ended = a["end_reason"], a["ended_at"]
    if ended is None:
        return []
    where = f"task {tid} attempt {a['number']}"
    if reason in REPORTED:
        deadline: datetime | None = a["lease_expires_at"] or a["ack_deadline"]
        if reason == "cancelled" and deadline is None:
            return []  # cancelled before it was ever claimed
        if deadline is not None and not ended < deadline:
            return [f"{where}: report ({reason}) accepted at {ended} after its deadline {deadline}"]
    elif reason == "lease_expired":
        if a["lease_expires_at"] is None or ended < a["lease_expires_at"]:
            return [f"{where}: lease expired at {ended} before {a['lease_expires_at']}"]
    elif reason in EXPIRED:
        deadline = a[EXPIRED[reason]]
        if deadline is None or ended < deadline:
            return [f"{where}: {reason} at {ended} before {deadline}"]
    return []


def _acknowledged(
    tid: str, number: int, fingerprints: list[str], t: dict[str, Any], history: list[dict[str, Any]]
) -> list[str]:
    """A result acknowledged as recorded (not a replay) is in the database: its
    attempt ended by that report; if it is the task's result, with that fingerprint."""
    out: list[str] = []
    where = f"task {tid} attempt {number}"
    if len(set(fingerprints)) > 1:
        out.append(
            f"{where}: different results acknowledged as recorded: {sorted(set(fingerprints))}"
        )
    att = [a for a in history if a["number"] == number]
    if not att or att[0]["end_reason"] not in REPORTED:
        reason = att[0]["end_reason"] if att else "missing"
        out.append(f"{where}: result acknowledged but the attempt ended {reason}")
    if t["result_attempt"] == number and t["result_fingerprint"] not in fingerprints:
        out.append(f"{where}: recorded fingerprint is not the acknowledged one")
    elif t["result_attempt"] is not None and t["result_attempt"] < number:
        out.append(f"{where}: result acknowledged but an older attempt's result is recorded")
    return out
