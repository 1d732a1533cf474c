"""The committed task events, as PostgreSQL announces them.

Every change of a task's state is announced by the database itself at its
commit (``pg_notify`` from a deferred trigger on ``tasks``, migration 0008):
never before the commit, never lost by a crash after it, delivered to every
listener in commit order. :class:`TaskEventStream` keeps one connection of its
own LISTENing on :data:`CHANNEL` and hands each event, in that order, to a
:class:`Sink` (the user API's ``EventFeed``).

Each event carries an id from the database sequence ``task_event_ids``: the
same event has the same id on every ``serve`` process, so a client's cursor
names the same position wherever it is read. Ids are unique, not ordered: two
transactions take theirs before they commit, in either order. Position is the
order of delivery, which is the same everywhere.

The stream also announces itself: right after LISTEN, and then every
``check_s``, it sends a *mark* (a notification with an id and no task). The
first one received names the present; each one received proves that the
connection still hears the channel. When the connection drops, or a mark is
not heard back within ``check_s``, the sink is told to ``reset`` (whatever it
holds no longer reaches the present without a hole) and the stream reconnects
with a capped backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from datetime import UTC, datetime
from typing import Any, Protocol

import asyncpg
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from fleetlease.persistence.db import raw_connect

log = structlog.get_logger("fleetlease.taskevents")

#: The channel the trigger notifies on (per database: deployments with
#: databases of their own never hear each other).
CHANNEL = "fleetlease_task_events"

_MARK_SQL = f"SELECT pg_notify('{CHANNEL}', json_build_array(nextval('task_event_ids'))::text)"


class Sink(Protocol):
    def append(self, event_id: int, event: dict[str, Any] | None) -> None:
        """An event (None: a mark) in commit order."""

    def reset(self) -> None:
        """Events may have been missed: forget what came before."""


def parse(payload: str) -> tuple[int, dict[str, Any] | None]:
    """The id and event (None for a mark) of one notification's payload;
    ``ValueError`` when it is not one."""
    try:
        row = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError("not JSON") from exc
    if not isinstance(row, list) or not row or type(row[0]) is not int:
        raise ValueError("not an event")
    if len(row) == 1:
        return row[0], None
    if len(row) != 7:
        raise ValueError("not an event")
    event_id, task_id, state, attempt, host_id, device_id, at = row
    if not isinstance(task_id, str) or not isinstance(state, str) or type(attempt) is not int:
        raise ValueError("not an event")
    return event_id, {
        "task_id": task_id,
        "state": state,
        "attempt": attempt,
        "host_id": host_id if isinstance(host_id, str) else None,
        "device_id": device_id if isinstance(device_id, str) else None,
        "at": datetime.fromtimestamp(float(at), UTC).isoformat()
        if isinstance(at, int | float)
        else None,
    }


def connect_kwargs(engine: AsyncEngine) -> dict[str, Any]:
    """``asyncpg.connect`` arguments for the database ``engine`` connects to
    (hosts, credentials and options of its URL, as its dialect reads them)."""
    _, kwargs = engine.dialect.create_connect_args(engine.url)
    accepted = inspect.signature(asyncpg.connect).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


class TaskEventStream:
    """LISTENs for the committed task events and feeds ``sink`` (on the loop)."""

    def __init__(
        self,
        engine: AsyncEngine,
        sink: Sink,
        *,
        check_s: float = 10.0,
        backoff_s: tuple[float, float] = (0.1, 5.0),
    ) -> None:
        if not check_s > 0:
            raise ValueError(f"check_s must be > 0, got {check_s!r}")
        self._kwargs = connect_kwargs(engine)
        self._connect = raw_connect(engine)
        self.sink = sink
        self.check_s = check_s
        self.backoff_s = backoff_s
        self._task: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._heard = asyncio.Event()
        self._lost = asyncio.Event()
        #: Connections made, and events that could not be read.
        self.connects = 0
        self.malformed = 0

    @property
    def backend_pid(self) -> int | None:
        """The PostgreSQL backend of the listen connection (None: not connected)."""
        conn = self._conn
        return None if conn is None or conn.is_closed() else int(conn.get_server_pid())

    def start(self) -> TaskEventStream:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close()

    async def _run(self) -> None:
        delay = self.backoff_s[0]
        while True:
            try:
                await self._listen()
                delay = self.backoff_s[0]
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("task_events.listen_failed", error=type(exc).__name__)
            self.sink.reset()
            await self._close()
            await asyncio.sleep(delay)
            delay = min(self.backoff_s[1], delay * 2)

    async def _listen(self) -> None:
        """One connection's life: LISTEN, mark, and check by marks until it fails."""
        self._lost.clear()
        self._conn = conn = await self._connect(**self._kwargs)
        self.connects += 1
        conn.add_termination_listener(lambda _c: self._lost.set())
        await conn.add_listener(CHANNEL, self._on_notify)
        log.info("task_events.listening", connects=self.connects)
        while True:
            self._heard.clear()
            await asyncio.wait_for(conn.execute(_MARK_SQL), self.check_s)
            heard = asyncio.ensure_future(self._heard.wait())
            lost = asyncio.ensure_future(self._lost.wait())
            try:
                done, _ = await asyncio.wait(
                    {heard, lost}, timeout=self.check_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                heard.cancel()
                lost.cancel()
            if heard not in done:
                raise ConnectionError("the listen connection did not hear its mark")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), self.check_s)
                raise ConnectionError("the listen connection closed")

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        mine = self._conn
        if mine is None or conn is not mine:
            return  # a connection already given up
        try:
            event_id, event = parse(payload)
        except ValueError:
            self.malformed += 1
            log.warning("task_events.malformed")
            return
        if event is None and pid == mine.get_server_pid():
            self._heard.set()
        self.sink.append(event_id, event)

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2.0)
            if not conn.is_closed():
                conn.terminate()
