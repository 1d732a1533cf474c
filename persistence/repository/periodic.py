"""The fleet's periodic host messages, many to one statement.

An idle fleet sends the control plane two kinds of request by the hundred a
second: heartbeats of an unchanged device snapshot (``heartbeat_unchanged``)
and long-poll claims coming back after their wait, each reading the host's
pending assignments (``session_pending``). Answered one statement each, most
of a request's cost is the statement's round trip and the pool checkout
around it, not the work. The group commit of the control plane
(``actors/groupcommit.py``) collects them and calls the methods here, which
answer a whole batch with one statement and give each entry its own outcome,
exactly the one the single-entry method would have given:

* ``heartbeats_unchanged``: one statement refreshes ``last_seen`` of every
  host whose session, stored digest and device rows allow it, and reads, for
  the others, why not (``Unauthorized``, or ``Conflict`` ``snapshot_unknown``).
  It never waits for a row lock: it takes the lock an update of ``last_seen``
  alone takes (``FOR NO KEY UPDATE``, which the inserts referencing a host do
  not conflict with) and skips a host row another transaction holds,
  so it cannot be part of a deadlock, whatever order others lock hosts in. An
  entry whose host was skipped, or a second heartbeat of one host in the
  batch, is answered by ``heartbeat_unchanged`` itself.
* ``sessions_pending``: one read of every entry's host session and pending
  assignments (at most its limit, on its devices when it names them), in the
  order and with the checks of ``session_pending``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from fleetlease.persistence.errors import Invalid, RepositoryError
from fleetlease.persistence.model import Assignment, Session, TaskState
from fleetlease.persistence.repository._assign_sql import _pending_params
from fleetlease.persistence.repository._validate import _check_session
from fleetlease.persistence.repository.fencing import _session_ok, _unauthorized
from fleetlease.persistence.repository.hosts import HostMixin, _check_digest, _snapshot_unknown

#: Per heartbeat ``(host_id, generation, digest)``: refreshed or not (the
#: conditions of ``_host_alive_stmt``; rows another transaction holds are
#: skipped), and the host row as the statement found it, to say why not.
_ALIVE_SQL = """
WITH v AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::text[]) AS v(host_id, generation, digest)
), ok AS (
    SELECT h.host_id FROM hosts h JOIN v ON v.host_id = h.host_id
    WHERE h.session_generation = v.generation
      AND h.session_generation > 0
      AND h.revoked_at IS NULL
      AND h.devices_digest = v.digest
      AND h.devices_synced_at IS NOT NULL
      AND NOT EXISTS (
          SELECT 1 FROM devices d
          WHERE d.host_id = h.host_id AND d.updated_at > h.devices_synced_at
      )
    FOR NO KEY UPDATE OF h SKIP LOCKED
), done AS (
    UPDATE hosts h SET last_seen = $4 FROM ok WHERE h.host_id = ok.host_id
    RETURNING h.host_id
)
SELECT v.host_id, done.host_id IS NOT NULL AS refreshed,
       h.session_generation, h.revoked_at,
       h.devices_digest IS NOT DISTINCT FROM v.digest
           AND h.devices_synced_at IS NOT NULL
           AND NOT EXISTS (
               SELECT 1 FROM devices d
               WHERE d.host_id = h.host_id AND d.updated_at > h.devices_synced_at
           ) AS same
FROM v
LEFT JOIN done ON done.host_id = v.host_id
LEFT JOIN hosts h ON h.host_id = v.host_id
"""

#: Per entry ``i`` (host, limit, whether it names devices; the devices as
#: ``(i, device_id)`` pairs): its host's session row, with its pending
#: assignments beside it (``_session_pending_stmt``, one row with NULL
#: assignment columns when none is pending, no row for an unknown host).
_PENDING_SQL = f"""
WITH q AS (
    SELECT * FROM unnest($1::int[], $2::text[], $3::int[], $4::bool[])
        AS q(i, host_id, lim, on_devices)
), d AS MATERIALIZED (
    SELECT * FROM unnest($5::int[], $6::text[]) AS d(i, device_id)
)
SELECT q.i, h.session_generation, h.revoked_at,
       p.id, p.project, p.number, p.device_id, p.lease_id, p.claim_deadline
FROM q
JOIN hosts h ON h.host_id = q.host_id
LEFT JOIN LATERAL (
    SELECT t.id::text AS id, t.project, a.number, a.device_id, a.lease_id::text AS lease_id,
           a.claim_deadline
    FROM tasks t
    JOIN attempts a ON a.task_id = t.id AND a.number = t.attempt
    WHERE t.status = '{TaskState.ASSIGNED.value}'
      AND a.host_id = q.host_id
      AND a.claim_deadline > $7
      AND (NOT q.on_devices OR a.device_id IN (SELECT d.device_id FROM d WHERE d.i = q.i))
    ORDER BY a.assigned_at, t.seq
    LIMIT q.lim
) p ON true
ORDER BY q.i, p.claim_deadline
"""

Pending = tuple[Session, Sequence[str], int | None]


class PeriodicMixin(HostMixin):
    """Batched heartbeats and long-poll reads (see the module doc)."""

    async def heartbeats_unchanged(
        self, beats: Sequence[tuple[Session, str]]
    ) -> list[Exception | None]:
        """``heartbeat_unchanged`` of each ``(session, digest)``, one outcome
        each (None: refreshed)."""
        out: list[Exception | None] = [None] * len(beats)
        first: dict[str, int] = {}
        again: list[int] = []
        for i, (session, digest) in enumerate(beats):
            try:
                _check_session(session)
                _check_digest(digest)
                if digest is None:
                    raise Invalid("digest is required", field="digest")
            except RepositoryError as exc:
                out[i] = exc
                continue
            if session.host_id in first:
                again.append(i)
            else:
                first[session.host_id] = i
        if first:
            idx = list(first.values())

            async def run(conn: Any, now: datetime) -> dict[str, Any]:
                rows = await conn.fetch(
                    _ALIVE_SQL,
                    [beats[i][0].host_id for i in idx],
                    [beats[i][0].generation for i in idx],
                    [beats[i][1] for i in idx],
                    now,
                )
                return {r["host_id"]: r for r in rows}

            try:
                found = await self._raw("heartbeats_unchanged", run)
            except RepositoryError as exc:
                for i in idx:
                    out[i] = exc
                return out  # the database is not answering: no fallback
            for i in idx:
                session = beats[i][0]
                r = found[session.host_id]
                if r["refreshed"]:
                    continue
                # As ``heartbeat_unchanged`` tells a refusal apart.
                if (
                    r["session_generation"] is None
                    or r["revoked_at"] is not None
                    or r["session_generation"] != session.generation
                ):
                    out[i] = _unauthorized(session)
                elif not r["same"]:
                    out[i] = _snapshot_unknown(session)
                else:
                    again.append(i)  # its row was held by another transaction
        if again:
            # Rare: answered one by one (the single statement waits for the row).
            async def single(i: int) -> Exception | None:
                try:
                    await self.heartbeat_unchanged(*beats[i])
                except RepositoryError as exc:
                    return exc
                return None

            for i, outcome in zip(again, await asyncio.gather(*map(single, again)), strict=True):
                out[i] = outcome
        return out

    async def sessions_pending(
        self, reads: Sequence[Pending]
    ) -> list[list[Assignment] | Exception]:
        """``session_pending`` of each ``(session, device_ids, limit)``, one
        outcome each."""
        out: list[list[Assignment] | Exception] = [[] for _ in reads]
        q_i: list[int] = []
        q_host: list[str] = []
        q_lim: list[int | None] = []
        q_on: list[bool] = []
        d_i: list[int] = []
        d_dev: list[str] = []
        for i, (session, device_ids, limit) in enumerate(reads):
            try:
                _check_session(session)
                params = _pending_params(session.host_id, device_ids, limit)
            except RepositoryError as exc:
                out[i] = exc
                continue
            q_i.append(i)
            q_host.append(session.host_id)
            q_lim.append(limit)
            q_on.append("device_ids" in params)
            for device in params.get("device_ids", ()):
                d_i.append(i)
                d_dev.append(device)
        if not q_i:
            return out

        async def run(conn: Any, now: datetime) -> list[Any]:
            return list(await conn.fetch(_PENDING_SQL, q_i, q_host, q_lim, q_on, d_i, d_dev, now))

        try:
            rows = await self._raw("sessions_pending", run)
        except RepositoryError as exc:
            for i in q_i:
                out[i] = exc
            return out
        seen: set[int] = set()
        for r in rows:
            i = r["i"]
            session = reads[i][0]
            if i not in seen:
                seen.add(i)
                if not _session_ok(session, r["session_generation"], r["revoked_at"]):
                    out[i] = _unauthorized(session)
                    continue
            found = out[i]
            if isinstance(found, Exception) or r["id"] is None:
                continue
            found.append(
                Assignment(
                    task_id=r["id"],
                    attempt=r["number"],
                    host_id=session.host_id,
                    device_id=r["device_id"],
                    lease_id=r["lease_id"],
                    claim_deadline=r["claim_deadline"],
                    project=r["project"],
                )
            )
        for i in q_i:
            if i not in seen:  # no such host
                out[i] = _unauthorized(reads[i][0])
        return out
