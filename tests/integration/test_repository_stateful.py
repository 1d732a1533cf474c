"""A hypothesis state machine against a small reference model of the task state
machine: random submits, assigns, claims, acks, renewals, progress, results (fresh
and replayed, current and stale), cancels, heartbeats, re-registrations,
reconciliations and clock jumps on a real PostgreSQL.

After every step the database must equal the model (states, attempts, deadlines,
bindings, reservations), and: at most one active reservation per device and per
task, attempt numbers only grow, terminal states never change, every ended attempt
stays in the history with its reason, backoff is respected; every message the
model rejects must be rejected and must leave every row as it was.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar, TypeVar

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fleetlease.persistence.clock import ManualClock
from fleetlease.persistence.db import create_engine
from fleetlease.persistence.errors import RepositoryError
from fleetlease.persistence.model import (
    DeviceSnapshot,
    JournalEntry,
    Outcome,
    RetryPolicy,
    Session,
    TaskKind,
    TaskSpec,
    User,
)
from fleetlease.persistence.repository import Repository
from tests.integration.test_repository_support import TIMINGS

pytestmark = pytest.mark.embedded

T = TypeVar("T")
HOSTS = ("h0", "h1")
DEVICES = ("d0", "d1")
ACTIVE = ("assigned", "dispatched", "running")
LEASED = ("dispatched", "running")
TERMINAL = ("done", "failed", "cancelled")
ALICE = User(name="alice", platform_admin=False)


@dataclass
class MAttempt:
    number: int
    host: str
    device: str
    claim_deadline: datetime
    token: str | None = None
    generation: int | None = None
    ack_deadline: datetime | None = None
    lease_expires_at: datetime | None = None
    end_reason: str | None = None


@dataclass
class MTask:
    id: str
    pin: str | None
    max_attempts: int
    base: float
    eligible_at: datetime
    state: str = "queued"
    attempt: int = 0
    cancel: bool = False
    progress_seq: int = 0
    result_attempt: int | None = None
    fingerprint: str | None = None
    attempts: list[MAttempt] = field(default_factory=list)

    @property
    def current(self) -> MAttempt:
        return self.attempts[-1]

    def deadline(self) -> datetime:
        a = self.current
        if self.state == "assigned":
            return a.claim_deadline
        if self.state == "dispatched":
            assert a.ack_deadline is not None
            return a.ack_deadline
        assert a.lease_expires_at is not None
        return a.lease_expires_at


@dataclass
class MHost:
    credential: str
    generation: int
    last_seen: datetime
    devices: dict[str, str] = field(default_factory=dict)  # device -> idle | busy


@dataclass(frozen=True)
class Lease:
    """A claimed attempt as a host holds it (its journal entry)."""

    task_id: str
    attempt: int
    host: str
    token: str


@dataclass(frozen=True)
class _Fixed:
    """Stands in for the data object when ``drive`` sends a correct message."""

    lease: Lease
    session: Session


class RepositoryMachine(RuleBasedStateMachine):
    db_url: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.engine = create_engine(self.db_url, pool_size=2, max_overflow=2)
        self.repo = Repository(self.engine, self.clock, TIMINGS)
        self.tasks: dict[str, MTask] = {}
        self.hosts: dict[str, MHost] = {}
        self.leases: list[Lease] = []
        self.terminal_seen: dict[str, str] = {}
        self.attempts_seen: dict[str, int] = {}
        self.run(self._reset())

    # --- plumbing ------------------------------------------------------------------
    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.engine.dispose())
        self.loop.close()

    async def _reset(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                sa.text(
                    "TRUNCATE log_lines, artifacts, device_reservations, attempts, tasks, "
                    "devices, hosts, project_admins, projects, users RESTART IDENTITY CASCADE"
                )
            )
        await self.repo.add_user("alice")
        await self.repo.add_project("p1", owner="alice")
        for h in HOSTS:
            credential = await self.repo.add_host(h)
            session = await self.repo.register_session(h, credential)
            host = MHost(credential, session.generation, self.now)
            host.devices = dict.fromkeys(DEVICES, "idle")
            self.hosts[h] = host
            await self.repo.heartbeat(session, self._snapshot_of(h))

    @property
    def now(self) -> datetime:
        return self.clock.now()

    def session(self, host: str, which: str = "current") -> Session:
        gen = self.hosts[host].generation
        if which == "old":
            gen -= 1
        return Session(host_id=host, generation=gen)

    def _snapshot_of(self, host: str) -> list[DeviceSnapshot]:
        return [
            DeviceSnapshot(device_id=d, state=s, capabilities={"host": host})
            for d, s in self.hosts[host].devices.items()
        ]

    async def _rows(self) -> list[list[dict[str, Any]]]:
        out = []
        async with self.engine.connect() as conn:
            for sql in (
                "SELECT * FROM tasks ORDER BY id",
                "SELECT * FROM attempts ORDER BY task_id, number",
                "SELECT * FROM device_reservations ORDER BY host_id, device_id",
            ):
                out.append([dict(r) for r in (await conn.execute(sa.text(sql))).mappings()])
        return out

    def expect(self, accepted: bool, call: Awaitable[T]) -> T | None:
        """Run a call the model predicts; a rejected one must change nothing."""
        before = self.run(self._rows()) if not accepted else None

        async def go() -> T:
            return await call

        try:
            result = self.run(go())
        except RepositoryError as exc:
            assert not accepted, f"model accepted, repository said {exc!r} {exc.fields}"
            assert self.run(self._rows()) == before
            return None
        assert accepted, f"model rejected, repository accepted: {result!r}"
        return result

    # --- model transitions -------------------------------------------------------------
    def _hold_device(self, t: MTask) -> None:
        """An expired leased attempt: its idle device turns busy until the host
        reports again (the host may still be running on it)."""
        if t.state in LEASED:
            devices = self.hosts[t.current.host].devices
            if devices.get(t.current.device) == "idle":
                devices[t.current.device] = "busy"

    def _end(self, t: MTask, reason: str) -> str:
        """End the current attempt without success: the model of _after_failure."""
        t.current.end_reason = reason
        if t.cancel:
            t.state = "cancelled"
        elif t.attempt >= t.max_attempts:
            t.state = "failed"
        else:
            policy = RetryPolicy(
                max_attempts=t.max_attempts, backoff_base_s=t.base, backoff_cap_s=60
            )
            delay = policy.delay_after(t.attempt)
            t.eligible_at = self.now + delay
            t.state = "queued" if delay <= timedelta(0) else "retrying"
        return t.state

    def _live(self, host: str) -> bool:
        return self.hosts[host].last_seen > self.now - timedelta(seconds=TIMINGS.liveness_s)

    def _reserved(self) -> dict[tuple[str, str], str]:
        return {
            (t.current.host, t.current.device): t.id
            for t in self.tasks.values()
            if t.state in ACTIVE
        }

    def _lease_ok(self, lease: Lease, session: Session, token: str) -> bool:
        """Fencing for ack / renew / progress / fresh results (deadline included)."""
        t = self.tasks[lease.task_id]
        a = t.attempts[lease.attempt - 1]
        return (
            session.generation == self.hosts[session.host_id].generation
            and token == a.token
            and a.host == session.host_id
            and lease.attempt == t.attempt
            and a.generation == session.generation
            and t.state in LEASED
            and t.deadline() > self.now
        )

    def _pick_task(self, data: st.DataObject, *prefer: str) -> MTask:
        """Mostly a task in one of the preferred states (when there is one)."""
        everything = list(self.tasks.values())  # submission order: deterministic
        preferred = [t for t in everything if t.state in prefer]
        if preferred and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(preferred))
        return data.draw(st.sampled_from(everything))

    def _draw_message(self, data: st.DataObject) -> tuple[Lease, Session, str]:
        if isinstance(data, _Fixed):
            return data.lease, data.session, data.lease.token
        live = [
            lease
            for lease in self.leases
            if self.tasks[lease.task_id].state in LEASED
            and self.tasks[lease.task_id].attempt == lease.attempt
        ]
        if live and data.draw(st.integers(0, 3)):
            lease = data.draw(st.sampled_from(live))
        else:
            lease = data.draw(st.sampled_from(self.leases))
        who = data.draw(st.sampled_from(["owner", "owner", "owner", "old", "other"]))
        if who == "other":
            session = self.session(next(h for h in HOSTS if h != lease.host))
        else:
            session = self.session(lease.host, "old" if who == "old" else "current")
        token = lease.token if data.draw(st.integers(0, 5)) else "0" * 64
        return lease, session, token

    # --- rules ------------------------------------------------------------------------
    @rule(
        pin=st.sampled_from([None, "h0", "h1"]),
        max_attempts=st.integers(1, 3),
        base=st.sampled_from([0.0, 1.0, 5.0]),
        priority=st.integers(-1, 1),
    )
    def submit(self, pin: str | None, max_attempts: int, base: float, priority: int) -> None:
        task_id = self.run(
            self.repo.submit(
                TaskSpec(
                    kind=TaskKind.GOAL,
                    goal="g",
                    project="p1",
                    owner="alice",
                    priority=priority,
                    selector={"host": pin} if pin else {},
                    retry=RetryPolicy(
                        max_attempts=max_attempts, backoff_base_s=base, backoff_cap_s=60
                    ),
                )
            )
        )
        self.tasks[task_id] = MTask(task_id, pin, max_attempts, base, eligible_at=self.now)

    @rule()
    def assign(self) -> None:
        got = self.run(self.repo.assign())
        reserved = self._reserved()
        for a in got:
            t = self.tasks[a.task_id]
            assert t.state in ("queued", "retrying"), (t.state, a)
            assert t.eligible_at <= self.now, "assigned before its eligible time"
            assert t.pin in (None, a.host_id)
            assert (a.host_id, a.device_id) not in reserved
            assert self._live(a.host_id)
            assert self.hosts[a.host_id].devices.get(a.device_id) == "idle"
            assert a.attempt == t.attempt + 1
            reserved[(a.host_id, a.device_id)] = t.id
            t.attempt += 1
            t.state = "assigned"
            t.progress_seq = 0
            t.attempts.append(
                MAttempt(a.attempt, a.host_id, a.device_id, claim_deadline=a.claim_deadline)
            )
        # Completeness: nothing eligible is left while a matching free device waits.
        free = {
            (h, d)
            for h, host in self.hosts.items()
            if self._live(h)
            for d, s in host.devices.items()
            if s == "idle" and (h, d) not in reserved
        }
        for t in self.tasks.values():
            if t.state in ("queued", "retrying") and t.eligible_at <= self.now:
                assert not any(t.pin in (None, h) for h, _ in free), f"{t.id} left unassigned"

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        t = self._pick_task(data, "assigned")
        attempt = max(1, t.attempt + data.draw(st.sampled_from([0] * 8 + [-1, 1])))
        host = data.draw(st.sampled_from(HOSTS))
        if t.attempts and data.draw(st.integers(0, 3)):
            host = t.current.host
        which = data.draw(st.sampled_from(["current"] * 5 + ["old"]))
        session = self.session(host, which)
        a = t.attempts[attempt - 1] if attempt <= len(t.attempts) else None
        ok = (
            session.generation == self.hosts[host].generation
            and a is not None
            and a.host == host
            and attempt == t.attempt
            and t.state == "assigned"
            and a.claim_deadline > self.now
        )
        claimed = self.expect(ok, self.repo.claim(session, t.id, attempt))
        if claimed is not None:
            assert a is not None
            t.state = "dispatched"
            a.token = claimed.lease_token
            a.generation = session.generation
            a.ack_deadline = a.lease_expires_at = self.now + timedelta(seconds=TIMINGS.ack_s)
            assert claimed.ack_deadline == a.ack_deadline
            self.leases.append(Lease(t.id, attempt, host, claimed.lease_token))

    @rule(host=st.sampled_from(HOSTS))
    def claim_next(self, host: str) -> None:
        session = self.session(host)
        candidates = {
            t.id: t
            for t in self.tasks.values()
            if t.state == "assigned"
            and t.current.host == host
            and t.current.claim_deadline > self.now
        }
        claimed = self.run(self.repo.claim_next(session))
        if claimed is None:
            assert not candidates
            return
        t = candidates[claimed.task_id]
        oldest = min(c.current.claim_deadline for c in candidates.values())
        assert t.current.claim_deadline == oldest
        a = t.current
        t.state = "dispatched"
        a.token = claimed.lease_token
        a.generation = session.generation
        a.ack_deadline = a.lease_expires_at = self.now + timedelta(seconds=TIMINGS.ack_s)
        self.leases.append(Lease(t.id, a.number, host, claimed.lease_token))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        lease, session, token = self._draw_message(data)
        t = self.tasks[lease.task_id]
        ok = self._lease_ok(lease, session, token)
        status = self.expect(ok, self.repo.ack(session, lease.task_id, lease.attempt, token))
        if status is not None and t.state == "dispatched":
            t.state = "running"
            t.current.lease_expires_at = self.now + timedelta(seconds=TIMINGS.lease_s)
        if status is not None:
            assert status.lease_expires_at == t.current.lease_expires_at

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), progress=st.booleans())
    def renew(self, data: st.DataObject, progress: bool) -> None:
        lease, session, token = self._draw_message(data)
        t = self.tasks[lease.task_id]
        ok = self._lease_ok(lease, session, token)
        seq = data.draw(st.integers(0, 5))
        if progress:
            call = self.repo.progress(session, lease.task_id, lease.attempt, token, seq)
        else:
            call = self.repo.renew(session, lease.task_id, lease.attempt, token)
        status = self.expect(ok, call)
        if status is None:
            return
        if t.state == "running":
            t.current.lease_expires_at = self.now + timedelta(seconds=TIMINGS.lease_s)
        if progress:
            t.progress_seq = max(t.progress_seq, seq)
        assert status.lease_expires_at == t.deadline()
        assert status.cancel_requested == t.cancel

    @precondition(lambda self: self.leases)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(list(Outcome)),
        retryable=st.booleans(),
        fingerprint=st.sampled_from(["f1", "f2"]),
    )
    def report(
        self, data: st.DataObject, outcome: Outcome, retryable: bool, fingerprint: str
    ) -> None:
        lease, session, token = self._draw_message(data)
        t = self.tasks[lease.task_id]
        a = t.attempts[lease.attempt - 1]
        replay = t.result_attempt == lease.attempt
        if replay:
            ok = (
                session.generation == self.hosts[session.host_id].generation
                and token == a.token
                and a.host == session.host_id
                and fingerprint == t.fingerprint
            )
        else:
            ok = self._lease_ok(lease, session, token)
        rec = self.expect(
            ok,
            self.repo.report_result(
                session,
                lease.task_id,
                lease.attempt,
                token,
                outcome=outcome,
                retryable=retryable,
                fingerprint=fingerprint,
            ),
        )
        if rec is None:
            return
        assert rec.replayed == replay
        if replay:
            return
        t.result_attempt, t.fingerprint = lease.attempt, fingerprint
        # The report frees the device: a "busy" its host reported while the
        # attempt ran turns idle with it (an expiry makes it busy).
        devices = self.hosts[a.host].devices
        if devices.get(a.device) == "busy":
            devices[a.device] = "idle"
        if outcome is Outcome.DONE:
            t.current.end_reason, t.state = "done", "done"
        elif outcome is Outcome.CANCELLED:
            t.current.end_reason, t.state = "cancelled", "cancelled"
        elif not retryable:
            t.current.end_reason, t.state = "failed", "failed"
        else:
            self._end(t, "retryable_failure")
        assert rec.state.value == t.state

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        t = self._pick_task(data, *ACTIVE)
        rec = self.run(self.repo.request_cancel(t.id, ALICE))
        if t.state in TERMINAL or t.cancel:
            pass
        elif t.state in ("queued", "retrying"):
            t.state, t.cancel = "cancelled", True
        else:
            t.cancel = True
        assert rec.state.value == t.state

    @rule(
        host=st.sampled_from(HOSTS),
        states=st.tuples(*[st.sampled_from(["idle", "idle", "busy", None]) for _ in DEVICES]),
        which=st.sampled_from(["current", "current", "old"]),
    )
    def heartbeat(self, host: str, states: tuple[str | None, ...], which: str) -> None:
        session = self.session(host, which)
        ok = session.generation == self.hosts[host].generation
        devices = {d: s for d, s in zip(DEVICES, states, strict=True) if s is not None}
        snapshot = [
            DeviceSnapshot(device_id=d, state=s, capabilities={"host": host})
            for d, s in devices.items()
        ]
        self.expect(ok, self.repo.heartbeat(session, snapshot))
        if ok:
            self.hosts[host].devices = devices
            self.hosts[host].last_seen = self.now

    @rule(host=st.sampled_from(HOSTS), data=st.data())
    def restart(self, host: str, data: st.DataObject) -> None:
        """A host agent restart: a new session, then (mostly) reconciliation."""
        h = self.hosts[host]
        session = self.run(self.repo.register_session(host, h.credential))
        assert session.generation == h.generation + 1
        h.generation = session.generation
        h.last_seen = self.now
        if data.draw(st.integers(0, 3)):
            self.reconcile(host, data)

    @rule(host=st.sampled_from(HOSTS), data=st.data())
    def reconcile(self, host: str, data: st.DataObject) -> None:
        journal = [lease for lease in self.leases if lease.host == host]
        entries = data.draw(st.lists(st.sampled_from(journal), unique=True)) if journal else []
        which = data.draw(st.sampled_from(["current"] * 5 + ["old"]))
        session = self.session(host, which)
        ok = session.generation == self.hosts[host].generation
        report = self.expect(
            ok,
            self.repo.reconcile(
                session,
                [
                    JournalEntry(task_id=e.task_id, attempt=e.attempt, lease_token=e.token)
                    for e in entries
                ],
            ),
        )
        if report is None:
            return
        self.hosts[host].last_seen = self.now
        confirmed, expired = set(), set()
        for e, v in zip(entries, report.verdicts, strict=True):
            t = self.tasks[e.task_id]
            a = t.attempts[e.attempt - 1]
            match = e.attempt == t.attempt and e.token == a.token and t.state in LEASED
            want = "discard"
            if match and t.deadline() > self.now:
                want = "confirmed"
                confirmed.add(t.id)
                a.generation = session.generation
                if t.state == "running":
                    a.lease_expires_at = self.now + timedelta(seconds=TIMINGS.lease_s)
            elif match:
                expired.add(t.id)
            assert v.verdict == want, (v, t.state)
        lost = set()
        for t in self.tasks.values():
            if t.state in LEASED and t.current.host == host and t.id not in confirmed:
                if t.id in expired:
                    self._end(t, "lease_expired" if t.state == "running" else "ack_expired")
                else:
                    self._end(t, "reconcile_lost")
                lost.add(t.id)
        assert {x.task_id for x in report.lost} == lost

    @rule()
    def expire(self) -> None:
        got = {e.task_id: e for e in self.run(self.repo.expire_due())}
        due = {
            t.id: t for t in self.tasks.values() if t.state in ACTIVE and t.deadline() <= self.now
        }
        assert set(got) == set(due)
        reasons = {
            "assigned": "claim_expired",
            "dispatched": "ack_expired",
            "running": "lease_expired",
        }
        for task_id, t in due.items():
            assert got[task_id].reason.value == reasons[t.state]
            assert got[task_id].attempt == t.attempt
            self._hold_device(t)
            assert got[task_id].new_state.value == self._end(t, reasons[t.state])

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def drive(self, data: st.DataObject) -> None:
        """Push one task up to four correct steps forward (keeps histories deep):
        assign it, claim it, ack it, or report a result, with the right session and
        lease."""
        t = self._pick_task(data, "queued", "retrying", *ACTIVE)
        for _ in range(data.draw(st.integers(1, 4))):
            if t.state in TERMINAL:
                return
            self._drive_once(t, data)

    def _drive_once(self, t: MTask, data: st.DataObject) -> None:
        if t.state in ("queued", "retrying"):
            for h in HOSTS:
                self.heartbeat(h, tuple(self.hosts[h].devices.get(d) for d in DEVICES), "current")
            self.assign()
        elif t.state == "assigned":
            host = t.current.host
            session = self.session(host)
            if t.current.generation not in (None, session.generation):
                return
            ok = t.current.claim_deadline > self.now
            claimed = self.expect(ok, self.repo.claim(session, t.id, t.attempt))
            if claimed is not None:
                a = t.current
                t.state = "dispatched"
                a.token, a.generation = claimed.lease_token, session.generation
                a.ack_deadline = a.lease_expires_at = self.now + timedelta(seconds=TIMINGS.ack_s)
                self.leases.append(Lease(t.id, a.number, host, claimed.lease_token))
        elif t.state in LEASED:
            lease = next(
                x for x in reversed(self.leases) if x.task_id == t.id and x.attempt == t.attempt
            )
            session = self.session(lease.host)
            if t.state == "dispatched" and data.draw(st.integers(0, 3)):
                ok = self._lease_ok(lease, session, lease.token)
                if self.expect(ok, self.repo.ack(session, t.id, t.attempt, lease.token)):
                    t.state = "running"
                    t.current.lease_expires_at = self.now + timedelta(seconds=TIMINGS.lease_s)
            else:
                self.report(
                    _Fixed(lease, session),  # type: ignore[arg-type]
                    data.draw(st.sampled_from(list(Outcome))),
                    data.draw(st.booleans()),
                    "f1",
                )

    @rule(seconds=st.sampled_from([0.5, 1, 2, 5, 5, 10, 15, 16, 31]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # --- invariants ---------------------------------------------------------------------
    @invariant()
    def database_equals_the_model(self) -> None:
        task_rows, attempt_rows, reservations = self.run(self._rows())
        assert {str(r["id"]) for r in task_rows} == set(self.tasks)
        for r in task_rows:
            t = self.tasks[str(r["id"])]
            assert (r["status"], r["attempt"]) == (t.state, t.attempt), t.id
            assert (r["cancel_requested_at"] is not None) == t.cancel
            assert r["progress_seq"] == t.progress_seq
            if t.state in ("queued", "retrying"):
                assert r["eligible_at"] == t.eligible_at
            # Terminal states never change; attempt numbers only grow.
            if t.id in self.terminal_seen:
                assert r["status"] == self.terminal_seen[t.id]
            if r["status"] in TERMINAL:
                self.terminal_seen[t.id] = r["status"]
            assert r["attempt"] >= self.attempts_seen.get(t.id, 0)
            self.attempts_seen[t.id] = r["attempt"]
        by_task = {
            k: list(g) for k, g in itertools.groupby(attempt_rows, key=lambda r: str(r["task_id"]))
        }
        for t in self.tasks.values():
            rows = by_task.get(t.id, [])
            assert [r["number"] for r in rows] == list(range(1, len(t.attempts) + 1))
            for r, a in zip(rows, t.attempts, strict=True):
                assert (r["host_id"], r["device_id"]) == (a.host, a.device)
                assert r["end_reason"] == a.end_reason
                assert (r["ended_at"] is None) == (a.end_reason is None)
                assert r["session_generation"] == a.generation
                if a.end_reason is None and t.state in LEASED:
                    assert r["lease_expires_at"] == a.lease_expires_at
        # Reservations: exactly the model's active attempts, one per device and task.
        got = {(r["host_id"], r["device_id"]): str(r["task_id"]) for r in reservations}
        assert len(got) == len(reservations)
        assert len(set(got.values())) == len(got)
        assert got == self._reserved()


@pytest.mark.timeout(900)
def test_repository_matches_the_reference_model_under_random_operations(db_url: str) -> None:
    RepositoryMachine.db_url = db_url
    run_state_machine_as_test(
        RepositoryMachine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
