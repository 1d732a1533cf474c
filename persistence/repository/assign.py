"""Assignment: waiting tasks bound to free devices (and claimed in the same
transaction for waiting host requests); the reads of assignments."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Hashable, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict, Invalid, RepositoryError
from fleetlease.persistence.matching import host_serves
from fleetlease.persistence.model import Assignment, Claimed, Session
from fleetlease.persistence.repository._assign_sql import (
    FREE_COUNT_CAPS,
    _assignment,
    _assignments_select,
    _free_count_stmt,
    _free_sample_stmt,
    _FreeDevice,
    _lock_candidates_stmt,
    _pending_params,
    _pending_stmt,
    _rank_candidates_stmt,
    _reserve_and_bind_stmt,
    _session_pending_stmt,
)
from fleetlease.persistence.repository._sql import _ACTIVE, _prebuilt
from fleetlease.persistence.repository._tx import log
from fleetlease.persistence.repository._validate import _check_host_id, _check_int, _check_session
from fleetlease.persistence.repository.fencing import _session_ok, _unauthorized
from fleetlease.persistence.repository.leases import LeaseMixin
from fleetlease.persistence.repository.transitions import _Batch
from fleetlease.persistence.tables import attempts, tasks

#: How far past the first device a task may take ``_reserve`` looks for one
#: whose waiting request is still free (see ``assign_and_claim``), and how many
#: devices one transaction asks about at most: past that (a backlog on hosts
#: whose few requests each wait for hundreds of devices), devices are taken in
#: order, as without requests.
_PREFER_LOOKAHEAD = 64


_PREFER_BUDGET = 4096

#: Free devices a pass reads per candidate (see ``_free_sample``): twice the
#: candidates of a requirement, one device per host, and as many again from
#: the first hosts that have them.
_SAMPLE_SPARE = 2


class _Prefer:
    """The requests waiting for devices that this assignment transaction has
    given an assignment already (see ``assign_and_claim``)."""

    __slots__ = ("budget", "taken", "waiting")

    def __init__(self, waiting: Callable[[str, str], Hashable | None]) -> None:
        self.waiting = waiting
        self.taken: set[Hashable] = set()
        self.budget = _PREFER_BUDGET

    @property
    def spent(self) -> bool:
        return self.budget <= 0

    def take(self, host_id: str, device_id: str) -> bool:
        """Whether a request waits for this device and has no assignment of
        this transaction yet (it has one now)."""
        self.budget -= 1
        key = self.waiting(host_id, device_id)
        if key is None or key in self.taken:
            return False
        self.taken.add(key)
        return True


class AssignMixin(LeaseMixin):
    """Binding waiting tasks to devices, and reading the assignments."""

    async def assign(self, *, limit: int = 64) -> list[Assignment]:
        """Bind up to ``limit`` eligible waiting tasks (queued, or retrying with
        ``eligible_at <= now``) to distinct idle devices of live hosts matching each
        selector, fair across projects (round-robin by project), priority then FIFO
        within a project; one transaction: attempt n+1, lease id, claim deadline,
        reservation row. Uses FOR UPDATE SKIP LOCKED so concurrent assigners never
        collide; the reservation primary key makes a double reservation impossible."""
        _check_int(limit, "limit", 1, 10_000)
        return await self._tx(
            "assign", lambda conn, now: self._assign(conn, now, limit), driver=True
        )

    async def assign_and_claim(
        self,
        *,
        limit: int = 64,
        claimer: Callable[[Assignment], Session | None],
        waiting: Callable[[str, str], Hashable | None] | None = None,
    ) -> tuple[list[Assignment], list[Claimed]]:
        """``assign``, and in the same transaction a claim of each new
        assignment that has a claimer: ``claimer`` is asked once per
        assignment, in rank order, and returns the session of a host request
        waiting for that work now (a parked long-poll), or None. Each such
        claim is the claim ``claim`` would make for that session (fenced the
        same way: current session, owning host), written by the transaction
        that assigns, so the request is answered with the lease at the
        assignment's commit. A claim refused (the session was superseded)
        leaves its assignment assigned, to be claimed as usual. Returns the
        assignments and the claims made.

        ``waiting(host_id, device_id)``, if given, names the request that would
        claim an assignment on that device (any hashable; None: no request
        waits for it). A request claims one assignment at most, so among the
        devices a task may take, one whose request no earlier assignment of
        this transaction took comes first (looking a bounded way past the
        first matching device): a host's requests each waiting for several
        devices then get one assignment each, not several on the devices of
        one."""
        _check_int(limit, "limit", 1, 10_000)
        if not callable(claimer):
            raise Invalid("claimer must be a callable", field="claimer")
        if waiting is not None and not callable(waiting):
            raise Invalid("waiting must be a callable", field="waiting")

        async def run(
            conn: AsyncConnection, now: datetime
        ) -> tuple[list[Assignment], list[Claimed]]:
            prefer = _Prefer(waiting) if waiting is not None else None
            won = await self._assign(conn, now, limit, prefer)
            return won, await self._claim_assigned(conn, now, won, claimer)

        return await self._tx("assign", run, driver=True)

    async def _claim_assigned(
        self,
        conn: AsyncConnection,
        now: datetime,
        won: Sequence[Assignment],
        claimer: Callable[[Assignment], Session | None],
    ) -> list[Claimed]:
        """Claim, in the assigning transaction, the assignments just made that
        have a claimer: one read of their rows (locked already), their writes in
        one statement at the end, as a group commit of claims does."""
        mine: list[tuple[Assignment, Session]] = []
        for a in won:  # rank order
            session = claimer(a)
            if session is not None:
                _check_session(session)
                mine.append((a, session))
        if not mine:
            return []
        mine.sort(key=lambda item: item[0].task_id)
        batch = _Batch(
            await self._load_fenced_many(
                conn, [(a.task_id, a.attempt, a.host_id) for a, _ in mine]
            ),
            defer_writes=True,
        )
        claimed: list[Claimed] = []
        for a, session in mine:
            op = self.claim_op(session, a.task_id, a.attempt)
            try:
                claimed.append(await op.run(conn, now, batch))
            except RepositoryError as exc:
                log.info("repository.claim_at_assign_refused", task_id=a.task_id, code=exc.code)
        if batch.writes:
            await self._write_deferred(conn, batch, now)
        return claimed

    def _free_params(self, now: datetime) -> dict[str, Any]:
        return {"now": now, "live_after": now - timedelta(seconds=self.timings.liveness_s)}

    async def _assign(
        self, conn: AsyncConnection, now: datetime, limit: int, prefer: _Prefer | None = None
    ) -> list[Assignment]:
        """Candidates come in rank order, in batches: each batch counts the free
        devices (up to what it may still assign; they then exclude this
        transaction's own reservations and those other assigners committed),
        locks the next candidates that still match one of them, reads a sample
        of the free devices bounded by those candidates (``_free_sample``) and
        reserves greedily. Candidates left without a device stay locked and are
        tried again (first, keeping their rank) in the next batch."""
        won: list[Assignment] = []
        pending: list[Any] = []
        seen: list[str] = []
        params = self._free_params(now)
        for _batch in range(8):
            # The count is 0 when nothing waits (the common wake-up after a
            # result): no device is read to find out, and it is one statement.
            want = limit - len(won)
            cap = next((c for c in FREE_COUNT_CAPS if c >= want), FREE_COUNT_CAPS[-1])
            n_free = await conn.scalar(
                _prebuilt(("free_count", cap), functools.partial(_free_count_stmt, cap)), params
            )
            room = min(limit - len(won), n_free or 0)
            if room <= 0:
                break
            fresh = await self._lock_candidates(conn, now, room, seen)
            seen.extend(t.id for t in fresh)
            pending.extend(fresh)
            if not pending:
                break
            got = await self._reserve(conn, now, pending, limit - len(won), prefer)
            won.extend(got)
            taken = {a.task_id for a in got}
            pending = [t for t in pending if t.id not in taken]
            if not fresh and not got:
                break
            # Enough; or every device this transaction counted as free is now
            # taken; or the ranking ran out of waiting tasks and none is left
            # unmatched: another count could only find devices freed, or tasks
            # submitted, by commits since, and each of those wakes the Scheduler
            # for another pass anyway.
            if len(won) >= limit or len(got) >= room or (len(fresh) < room and not pending):
                break
        return won

    async def _free_sample(
        self, conn: AsyncConnection, now: datetime, candidates: Sequence[Any], ordered: bool
    ) -> list[_FreeDevice]:
        """The free devices ``_reserve`` matches ``candidates`` against: for each
        distinct requirement (selector, workflow) of the candidates, up to
        ``_SAMPLE_SPARE`` times its candidates in free devices matching it, one
        per host (hosts in id order), and as many again from the first hosts
        that have them (all of a few hosts' devices when few hosts have any).
        Every candidate with a matching free device meets one in it, and its
        size grows with the candidates, not with the fleet.

        ``ordered``: hosts in id order, devices in id order within a host (as
        a pass without waiting requests takes them). Otherwise the one-per-host
        part comes first, so that greedy matching with ``prefer`` meets many
        hosts' (and so many long-polls') devices first."""
        need: dict[tuple[str, str | None], int] = {}
        for t in candidates:
            key = (json.dumps(t.selector or {}, sort_keys=True), t.workflow)
            need[key] = need.get(key, 0) + 1
        keys = ("i", "selector", "workflow", "want", "per_host")
        cols: dict[str, list[Any]] = {k: [] for k in keys}
        for n, ((selector, workflow), count) in enumerate(need.items()):
            want = _SAMPLE_SPARE * count
            for spread, per_host in enumerate((1, want)):
                cols["i"].append(2 * n + spread)
                cols["selector"].append(selector)
                cols["workflow"].append(workflow)
                cols["want"].append(want)
                cols["per_host"].append(per_host)
        rows = list(
            await conn.execute(
                _prebuilt("free_sample", _free_sample_stmt),
                {**self._free_params(now), **{f"q_{k}": v for k, v in cols.items()}},
            )
        )
        if ordered:
            rows.sort(key=lambda r: (r.host_id, r.device_id))
        else:
            rows.sort(key=lambda r: (r.i % 2, r.host_id, r.device_id))
        unique: dict[tuple[str, str], Any] = {}
        for r in rows:
            unique.setdefault((r.host_id, r.device_id), r)
        return _FreeDevice.load(list(unique.values()))

    async def _lock_candidates(
        self, conn: AsyncConnection, now: datetime, n: int, exclude: Sequence[str]
    ) -> list[Any]:
        """Lock the next ``n`` waiting tasks, fair across projects (round-robin by
        project, priority then FIFO within one), that match some free device."""
        # Two short statements: the rank (no locks), then the ranked tasks locked
        # by primary key. As one statement the planner, misled by the fast-moving
        # statistics of the tasks table, may join every waiting task against the
        # ranking, on every assignment.
        params = {**self._free_params(now), "scan": 2 * n + len(exclude)}
        ranked = await self._rank(conn, now, params)
        skip = set(exclude)
        ranked = [t for t in ranked if t not in skip]
        if not ranked:
            return []
        return list(
            await conn.execute(
                _prebuilt("lock_candidates", _lock_candidates_stmt),
                {"now": now, "ids": ranked, "n": n},
            )
        )

    async def _rank(
        self, conn: AsyncConnection, now: datetime, params: dict[str, Any]
    ) -> list[str]:
        """The ids of ``_rank_candidates_stmt``. First the ranking without the
        check against the free devices, and one probe per distinct requirement
        of the tasks it returns (``_free_sample_stmt``, one device each): when
        every one has a free device, that ranking is the checked one, and no
        scan of the free devices' capability sets was needed. Otherwise the
        checked ranking, which skips the tasks no free device meets."""
        rows = list(
            await conn.execute(
                _prebuilt(
                    "rank_candidates_unchecked",
                    functools.partial(_rank_candidates_stmt, filtered=False),
                ),
                params,
            )
        )
        if not rows:
            return []
        needs = list(dict.fromkeys((r.selector or "{}", r.workflow) for r in rows))
        probe = {
            "q_i": list(range(len(needs))),
            "q_selector": [sel for sel, _ in needs],
            "q_workflow": [wf for _, wf in needs],
            "q_want": [1] * len(needs),
            "q_per_host": [1] * len(needs),
        }
        met = {
            r.i
            for r in await conn.execute(
                _prebuilt("free_sample", _free_sample_stmt), {**self._free_params(now), **probe}
            )
        }
        if len(met) == len(needs):
            return [r.id for r in rows]
        return [
            r.id
            for r in await conn.execute(_prebuilt("rank_candidates", _rank_candidates_stmt), params)
        ]

    async def _reserve(
        self,
        conn: AsyncConnection,
        now: datetime,
        candidates: list[Any],
        limit: int,
        prefer: _Prefer | None = None,
    ) -> list[Assignment]:
        """Match locked candidates to a sample of the free devices
        (``_free_sample``) greedily in rank order and insert the reservations
        (ON CONFLICT DO NOTHING: a device another assigner reserved first is
        simply lost, and looked for again with a fresh read). With
        ``prefer``, a task takes a device whose waiting request is still free
        if one comes soon enough after the first it matches."""
        won: list[Assignment] = []
        pending = list(candidates)
        for _round in range(4):
            if not pending or len(won) >= limit:
                break
            free = await self._free_sample(conn, now, pending, ordered=prefer is None)
            if not free:
                break
            pairs: list[tuple[Any, Any]] = []
            used: set[int] = set()
            # Devices before ``first`` are all taken: a task without a selector
            # takes the first one left, without walking past the taken ones again
            # (that walk would be quadratic in the batch).
            first = 0
            for task in pending:
                if len(won) + len(pairs) >= limit:
                    break
                while first in used:
                    first += 1
                selector = (task.selector or {}).items()
                fallback: int | None = None
                for i in range(first, len(free)):
                    if i in used:
                        continue
                    dev = free[i]
                    caps = dev.capabilities or {}
                    if not all(caps.get(k) == v for k, v in selector):
                        continue
                    if not host_serves(dev.workflows, task.workflow):
                        continue
                    pick = i
                    if prefer is not None:
                        if prefer.spent:  # the first that matched
                            pick = i if fallback is None else fallback
                        elif not prefer.take(dev.host_id, dev.device_id):
                            if fallback is None:
                                fallback = i
                            if i - fallback < _PREFER_LOOKAHEAD:
                                continue
                            pick = fallback
                    used.add(pick)
                    pairs.append((task, free[pick]))
                    fallback = None
                    break
                if fallback is not None:  # nothing preferred up to the end
                    used.add(fallback)
                    pairs.append((task, free[fallback]))
            if not pairs:
                break
            pairs.sort(key=lambda p: (p[1].host_id, p[1].device_id))
            # One statement reserves the devices (a device another assigner
            # reserved first is skipped), inserts the attempts of the reserved
            # ones and moves their tasks to assigned.
            deadline = now + timedelta(seconds=self.timings.claim_s)
            rows = (
                await conn.execute(
                    _prebuilt("reserve_and_bind", _reserve_and_bind_stmt),
                    {
                        "r_host_id": [d.host_id for _, d in pairs],
                        "r_device_id": [d.device_id for _, d in pairs],
                        "r_task_id": [t.id for t, _ in pairs],
                        "r_attempt": [t.attempt + 1 for t, _ in pairs],
                        "p_now": now,
                        "p_deadline": deadline,
                    },
                )
            ).all()
            if rows and rows[0].bound != len(rows):  # locked rows cannot move: a bug if seen
                raise Conflict("assignment lost its task", reason="assign_race")
            lease_ids = {str(r.task_id): str(r.lease_id) for r in rows}
            got = set(lease_ids)
            won.extend(
                Assignment(
                    task_id=t.id,
                    attempt=t.attempt + 1,
                    host_id=d.host_id,
                    device_id=d.device_id,
                    lease_id=lease_ids[t.id],
                    claim_deadline=deadline,
                    project=t.project,
                )
                for t, d in pairs
                if t.id in got
            )
            pending = [t for t in pending if t.id not in got]
            if not pending:
                break
            # Somebody else reserved some of our devices, or the requirements of
            # several candidates shared their sample's devices: look again (the
            # sample now leaves out what this transaction reserved).
        # Rank order for the caller, whatever order the devices were inserted in.
        rank = {t.id: i for i, t in enumerate(candidates)}
        return sorted(won, key=lambda a: rank[a.task_id])

    async def pending_assignments(
        self, host_id: str, *, device_ids: Sequence[str] = (), limit: int | None = None
    ) -> list[Assignment]:
        """Assigned (unclaimed, unexpired) attempts of a host (read only), oldest
        first; only those on ``device_ids`` when given; at most ``limit``."""
        _check_host_id(host_id)
        params = _pending_params(host_id, device_ids, limit)
        on_devices = "device_ids" in params

        async def run(conn: AsyncConnection, now: datetime) -> list[Assignment]:
            stmt = _prebuilt(("pending", on_devices), lambda: _pending_stmt(on_devices))
            rows = (await conn.execute(stmt, {**params, "now": now})).all()
            return [_assignment(r) for r in rows]

        return await self._tx("pending_assignments", run, autocommit=True, driver=True)

    async def session_pending(
        self, session: Session, *, device_ids: Sequence[str] = (), limit: int | None = None
    ) -> list[Assignment]:
        """``pending_assignments`` of the session's host, checking in the same
        statement that the session is current (``Unauthorized`` if not): one read
        per long-poll look instead of two."""
        _check_session(session)
        params = _pending_params(session.host_id, device_ids, limit)
        on_devices = "device_ids" in params

        async def run(conn: AsyncConnection, now: datetime) -> list[Assignment]:
            stmt = _prebuilt(
                ("session_pending", on_devices), lambda: _session_pending_stmt(on_devices)
            )
            rows = (await conn.execute(stmt, {**params, "now": now})).all()
            if not rows or not _session_ok(session, rows[0].session_generation, rows[0].revoked_at):
                raise _unauthorized(session)
            return [_assignment(r) for r in rows if r.id is not None]

        return await self._tx("session_pending", run, autocommit=True, driver=True)

    async def _assignments(
        self, conn: AsyncConnection, *conds: sa.ColumnElement[bool], limit: int | None = None
    ) -> list[Assignment]:
        rows = (await conn.execute(_assignments_select(*conds).limit(limit))).all()
        return [_assignment(r) for r in rows]

    async def active_attempts(self, host_id: str | None = None) -> list[Assignment]:
        """Every active attempt (for rebuilding Lease actors after a restart)."""
        conds: list[sa.ColumnElement[bool]] = [tasks.c.status.in_(_ACTIVE)]
        if host_id is not None:
            _check_host_id(host_id)
            conds.append(attempts.c.host_id == host_id)
        return await self._tx(
            "active_attempts", lambda conn, now: self._assignments(conn, *conds), autocommit=True
        )
