"""Running host transitions: a :class:`Transition` in a transaction of its own
(``run_one``) or many sharing one (``run_many``, group commit), and the
compare-and-set writes they make, alone or deferred to one statement."""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from fleetlease.persistence.errors import Conflict, RepositoryError, Unavailable
from fleetlease.persistence.repository._sql import (
    _load_many_stmt,
    _prebuilt,
    _release_devices_stmt,
    _update_pair_stmt,
    _write_batch_stmt,
)
from fleetlease.persistence.repository._tx import Transactions, log
from fleetlease.persistence.tables import attempts, tasks

#: Transitions ``run_many`` runs without a transaction around them (see
#: ``Repository._run_optimistic``): each only defers its writes.
_OPTIMISTIC_OPS = frozenset({"claim", "ack", "report_result"})


class _BatchAborted(Exception):
    """A transition of a shared transaction failed after it may have written."""


@dataclass(frozen=True)
class Transition:
    """One fenced host transition (claim, ack, progress, result), validated and
    ready to run inside a transaction: ``run(conn, now)`` loads, fences and
    writes. Built by the ``*_op`` methods; ``run_one`` gives it a transaction of
    its own, ``run_many`` lets many share one (group commit).

    Every ``run`` raises its typed errors before its first write, so a refused
    transition leaves nothing behind in a shared transaction."""

    op: str
    task_id: str
    attempt: int
    host_id: str
    #: ``run(conn, now, batch)``: ``batch`` is the shared state of ``run_many``
    #: (rows it already loaded and locked, device releases it does at the end),
    #: None in a transaction of its own.
    run: Callable[[AsyncConnection, datetime, _Batch | None], Awaitable[Any]]


class _Batch:
    """What the transitions of one ``run_many`` transaction share."""

    __slots__ = ("free", "generations", "rows", "writes")

    def __init__(
        self, rows: dict[tuple[str, int, str], RowMapping], *, defer_writes: bool = False
    ) -> None:
        self.rows = rows
        #: The attempt's session generation each task's row was read with: the
        #: deferred compare-and-set writes only if it is unchanged.
        self.generations: dict[str, int | None] = {
            r["task_id"]: r["a_generation"] for r in rows.values()
        }
        #: Tasks whose device reservation is released at the end of the batch, in
        #: one statement locking devices in (host, device) order, as heartbeats do:
        #: released one by one in task order they deadlocked with heartbeats.
        self.free: list[str] = []
        #: With ``defer_writes`` (no task twice in the batch), the compare-and-set
        #: of each transition is collected here by statement shape and written at
        #: the end, one multi-row statement per shape: the rows are already locked
        #: by the batch read, and no transition reads what another one writes.
        self.writes: dict[Any, list[tuple[str, int, dict[str, Any], dict[str, Any]]]] | None = (
            {} if defer_writes else None
        )

    def row(self, task_id: str, attempt: int, host_id: str) -> RowMapping | None:
        return self.rows.get((task_id, attempt, host_id))


class TransitionRunner(Transactions):
    """Runs :class:`Transition` objects and writes their compare-and-sets."""

    async def _update_pair(
        self,
        conn: AsyncConnection,
        task_id: str,
        attempt: int,
        from_states: Sequence[str],
        task_values: dict[str, Any],
        attempt_values: dict[str, Any],
        batch: _Batch | None = None,
    ) -> None:
        """Compare-and-set the task (state and attempt) and its attempt in one
        statement; zero rows is a ``Conflict`` (the caller holds the row locks, so
        it means a bug rather than a race). In a batch that defers its writes,
        collected for ``_write_deferred``."""
        # A None is SQL NULL, part of the statement's shape (a JSON column would
        # take a bound None as the JSON value null).
        shape = (
            tuple(from_states),
            tuple(sorted((k, v is None) for k, v in task_values.items())),
            tuple(sorted((k, v is None) for k, v in attempt_values.items())),
        )
        if batch is not None and batch.writes is not None:
            batch.writes.setdefault(shape, []).append(
                (task_id, attempt, task_values, attempt_values)
            )
            return
        params = {f"t_{k}": v for k, v in task_values.items() if v is not None}
        params.update({f"a_{k}": v for k, v in attempt_values.items() if v is not None})
        params["p_task_id"] = task_id
        params["p_attempt"] = attempt
        done = (
            await conn.execute(
                _prebuilt(("update_pair", shape), lambda: _update_pair_stmt(*shape)), params
            )
        ).first()
        if done is None:
            raise Conflict("the task changed underneath", reason="cas_failed", task_id=task_id)

    async def _write_deferred(
        self, conn: AsyncConnection, batch: _Batch, now: datetime, *, strict: bool = True
    ) -> set[str]:
        """A batch's collected compare-and-sets and its device releases, in one
        statement (``_write_batch_stmt``: one round trip for the batch's writes).
        Returns the tasks written. ``strict`` (the rows are locked by the batch's
        read): a row that did not match raises ``_BatchAborted``, the batch is
        rolled back and run one by one."""
        assert batch.writes is not None
        shapes = sorted(batch.writes)
        params: dict[str, Any] = {}
        for n, shape in enumerate(shapes):
            items = batch.writes[shape]
            params[f"v{n}_task_id"] = [i[0] for i in items]
            params[f"v{n}_attempt"] = [i[1] for i in items]
            params[f"v{n}_generation"] = [batch.generations.get(i[0]) for i in items]
            for prefix, keys, at in (("t_", shape[1], 2), ("a_", shape[2], 3)):
                table = tasks if prefix == "t_" else attempts
                for k, is_none in keys:
                    if is_none:
                        continue
                    values = [cast(dict[str, Any], i[at])[k] for i in items]
                    if isinstance(table.c[k].type, sa.JSON):
                        values = [json.dumps(v) for v in values]
                    params[f"v{n}_{prefix}{k}"] = values
        release = bool(batch.free)
        if release:
            params["task_ids"] = list(batch.free)
            params["now"] = now
        key = ("write_batch", tuple(shapes), release)
        rows = (
            await conn.execute(
                _prebuilt(key, functools.partial(_write_batch_stmt, tuple(shapes), release)),
                params,
            )
        ).all()
        written = {str(r.task_id) for r in rows if r.task_id is not None}
        if strict:
            missed = sum(len(items) for items in batch.writes.values()) - len(written)
            if missed:
                raise _BatchAborted(f"{missed} compare-and-set(s) failed")
        batch.writes.clear()
        batch.free.clear()
        return written

    async def run_one(self, t: Transition) -> Any:
        """A transition in a transaction of its own."""
        return await self._tx(t.op, lambda conn, now: t.run(conn, now, None), driver=True)

    async def run_many(self, ts: Sequence[Transition]) -> list[Any]:
        """Many transitions in one transaction (one commit): each gets its own
        outcome (a result or a ``RepositoryError``); a typed error for one never
        rolls back the others (each refuses before writing). They run in task id
        order, so concurrent batches lock rows in one order.

        Claims, acks and results, each task once (the usual batch, and a batch
        of one), take ``_run_optimistic`` instead: a read and one write, both in
        autocommit, each written only if its rows are as read.

        ``Unavailable`` (the database is down or the commit's fate unknown) is
        every transition's outcome. Any other failure that aborts the shared
        transaction (a compare-and-set that found a written row inconsistent, an
        unexpected database error) rolls it all back; then each transition runs
        in a transaction of its own, so only the culprit fails."""
        if not ts:
            return []
        seen = Counter(t.task_id for t in ts)
        distinct = len(seen) == len(ts)
        if distinct and all(t.op in _OPTIMISTIC_OPS for t in ts):
            return await self._run_optimistic(ts)
        if len(ts) == 1:
            return [await self._outcome(ts[0])]
        order = sorted(range(len(ts)), key=lambda i: ts[i].task_id)
        # One locking read for the batch, of every task it names, in task id
        # order: a task named twice is locked here too (then reads its own row
        # again, as the first transition may change it), or two batches naming
        # the same tasks twice lock them in different orders and deadlock.
        keys = list({t.task_id: (t.task_id, t.attempt, t.host_id) for t in ts}.values())

        async def run(conn: AsyncConnection, now: datetime) -> list[Any]:
            rows = await self._load_fenced_many(conn, keys)
            if not distinct:
                rows = {k: r for k, r in rows.items() if seen[k[0]] == 1}
            batch = _Batch(rows, defer_writes=distinct)
            out: list[Any] = [None] * len(ts)
            for i in order:
                t = ts[i]
                try:
                    out[i] = await t.run(conn, now, batch)
                except RepositoryError as exc:
                    if exc.fields.get("reason") == "cas_failed":
                        raise _BatchAborted from exc  # it may have written: undo all
                    out[i] = exc
            if batch.writes:
                await self._write_deferred(conn, batch, now)
            if batch.free:
                await self._release_devices(conn, now, batch.free)
            return out

        try:
            result: list[Any] = await self._tx("transitions", run, driver=True)
            return result
        except Unavailable as exc:
            return [exc] * len(ts)
        except Exception as exc:  # isolated below, one by one
            log.warning("repository.batch_isolated", size=len(ts), error=repr(exc))
        return [await self._outcome(t) for t in ts]

    async def _run_optimistic(self, ts: Sequence[Transition]) -> list[Any]:
        """Claims, acks and results (each task once) without a transaction
        around them: two statements, each its own transaction in autocommit.

        The first reads every transition's task, attempt and host row without
        locking them; each transition fences itself against its row in Python,
        as in a locked batch (a refusal is its answer: the row was the state at
        the time of that read), and defers its compare-and-set. The second writes
        them all (``_write_batch_stmt``), each only if its row is still as read:
        the task's state and attempt, the attempt open and bound to the session
        generation read, the attempt row locked first. A pair is written whole or
        not at all, and whatever one writes does not depend on another. A
        transition whose row changed in between (an expiry, a reconcile, a
        cancel won the race) was not written: it runs again in a locked
        transaction of its own, which gives its precise answer."""
        keys = [(t.task_id, t.attempt, t.host_id) for t in ts]
        order = sorted(range(len(ts)), key=lambda i: ts[i].task_id)

        # What the fence phase decided, kept for the answer when the write fails.
        fenced: dict[str, Any] = {}

        async def run(conn: AsyncConnection, now: datetime) -> tuple[list[Any], set[str], set[str]]:
            fenced.clear()
            batch = _Batch(await self._load_fenced_many(conn, keys, lock=False), defer_writes=True)
            out: list[Any] = [None] * len(ts)
            for i in order:
                try:
                    out[i] = await ts[i].run(conn, now, batch)
                except RepositoryError as exc:
                    out[i] = exc
            assert batch.writes is not None
            deferred = {item[0] for items in batch.writes.values() for item in items}
            fenced.update(out=out, deferred=deferred)
            written: set[str] = set()
            if deferred:
                written = await self._write_deferred(conn, batch, now, strict=False)
            return out, deferred, written

        try:
            # Both statements on one connection, each its own transaction (no
            # BEGIN and COMMIT round trips; a retried run reads again).
            out, deferred, written = await self._tx(
                "transitions", run, autocommit=True, driver=True
            )
        except Unavailable as exc:
            if not fenced:
                return [exc] * len(ts)
            # The write's fate is unknown: so is every deferred transition's.
            return [
                exc if t.task_id in fenced["deferred"] else o
                for t, o in zip(ts, fenced["out"], strict=True)
            ]
        except Exception as exc:  # isolated below, one by one
            log.warning("repository.batch_isolated", size=len(ts), error=repr(exc))
            if not fenced:
                return [await self._outcome(t) for t in ts]
            # The write failed as a whole (one statement): nothing was written.
            out, deferred, written = fenced["out"], fenced["deferred"], set()
        for i, t in enumerate(ts):
            if t.task_id in deferred and t.task_id not in written:
                out[i] = await self._outcome(t)
        return out

    async def _load_fenced_many(
        self,
        conn: AsyncConnection,
        keys: Sequence[tuple[str, int, str]],
        *,
        lock: bool = True,
        lease_only: bool = False,
    ) -> dict[tuple[str, int, str], RowMapping]:
        """``_load`` for a batch: (task, attempt, caller's host) rows, locked in
        task id order unless ``lock`` is false, in one statement. A key with no
        row is left out (its transition loads it itself, to raise the precise
        error)."""
        if not keys:
            return {}
        rows = (
            (
                await conn.execute(
                    _prebuilt(
                        ("load_many", lock, lease_only),
                        functools.partial(_load_many_stmt, lock, lease_only),
                    ),
                    {
                        "k_task_id": [k[0] for k in keys],
                        "k_number": [k[1] for k in keys],
                        "k_host_id": [k[2] for k in keys],
                    },
                )
            )
            .mappings()
            .all()
        )
        return {(r["task_id"], r["a_number"], r["k_host_id"]): r for r in rows}

    async def _release_devices(
        self, conn: AsyncConnection, now: datetime, task_ids: Sequence[str]
    ) -> None:
        """Delete the reservations of ``task_ids`` and turn their devices idle if
        they were reported busy, in one statement that locks the device rows in
        (host, device) order."""
        await conn.execute(
            _prebuilt("release_devices", _release_devices_stmt),
            {"task_ids": list(task_ids), "now": now},
        )

    async def _outcome(self, t: Transition) -> Any:
        try:
            return await self.run_one(t)
        except RepositoryError as exc:
            return exc


_Runner = TypeVar("_Runner", bound=TransitionRunner)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def verb_of(
    build: Callable[Concatenate[_Runner, _P], Transition], result: type[_R]
) -> Callable[Concatenate[_Runner, _P], Coroutine[Any, Any, _R]]:
    """The awaitable verb of a host transition declared once, as its builder
    (``claim = verb_of(claim_op, Claimed)``): ``await claim(...)`` is
    ``run_one(claim_op(...))``, the transition in a transaction of its own,
    answering with the ``result`` its ``run`` returns. The verb takes the
    builder's arguments and documentation."""

    async def verb(self: _Runner, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return cast(_R, await self.run_one(build(self, *args, **kwargs)))

    verb.__name__ = build.__name__.removesuffix("_op")
    verb.__qualname__ = build.__qualname__.removesuffix("_op")
    verb.__doc__ = build.__doc__
    verb.__module__ = build.__module__
    return verb
