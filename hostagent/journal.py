"""The host agent's local durable journal.

Every assignment is written here and committed *before* the agent acks it, and
every outcome is recorded here before it is reported, so that after a crash the
agent can tell the control plane (at reconciliation) which attempts it holds and
can repeat a terminal report with the same fingerprint.

One SQLite file under the agent's state directory, WAL mode with
``synchronous=FULL`` (a commit is on disk when it returns), mode 0600 because
it holds lease tokens. A corrupt or truncated file never stops the agent: it is
moved aside and a fresh journal is started; reconciliation with the control
plane (the source of truth) resolves whatever was lost.

Each entry counts how many times a restarted agent has resumed running it
(``resumes``, incremented and committed by :meth:`Journal.begin_resume` before
the resumed attempt runs), so an attempt that kills its agent every time is
given up after a bounded number of restarts instead of crash-looping. The
column was added after the first release: a journal file without it gets it
(``ALTER TABLE ... ADD COLUMN``, default 0) when opened, and a record without a
value reads as 0.

The resume count also numbers the attempt's log: the control plane keeps one
line per (task, attempt, seq) and ignores a repeated seq, so each run of an
attempt ships its lines from its own range of seqs, starting after
:func:`log_seq_base` of its resume count (run 0 from 1, the first resumed run
from ``2**32 + 1``, ...). The count is committed before the resumed run logs
anything, so no two runs share a range, and nothing is written per line.

Each entry also lists the process groups its steps started (``pgroups``, added
the same way), so a restarted agent can end those an agent that died left
running (see ``hostagent.execution``).

The lease token is never logged: ``JournalRecord`` hides it from ``repr`` and
no log event carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import math
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import structlog

from fleetlease.persistence.model import Outcome, TaskKind

__all__ = [
    "JOURNAL_FILENAME",
    "SCHEMA_VERSION",
    "EntryState",
    "Journal",
    "JournalError",
    "JournalRecord",
    "JournalThread",
    "UnknownEntry",
    "canonical_json",
    "log_seq_base",
    "result_fingerprint",
]

log = structlog.get_logger(__name__)

#: File name of the journal inside the agent's state directory.
JOURNAL_FILENAME = "journal.sqlite3"
#: Stored in ``PRAGMA user_version``; a file with another non-zero version is
#: treated like a corrupt one (moved aside), never migrated in place.
SCHEMA_VERSION = 1

# SQLite primary result codes meaning "the bytes on disk are not a usable
# database". Anything else (locked, I/O error, permission, disk full) is not
# fixed by moving the file aside, so it is raised instead.
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26


class EntryState(enum.StrEnum):
    ACCEPTED = "accepted"
    RUNNING = "running"
    FINISHED = "finished"


class JournalError(Exception):
    """The journal could not complete an operation."""

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self.message = message or (self.__doc__ or "journal error").strip()
        self.fields = fields
        super().__init__(self.message)


class UnknownEntry(JournalError):
    """No journal entry for this task attempt."""

    def __init__(self, task_id: str, attempt: int) -> None:
        super().__init__(
            f"no journal entry for task {task_id!r} attempt {attempt}",
            task_id=task_id,
            attempt=attempt,
        )
        self.task_id = task_id
        self.attempt = attempt


#: The seqs of one run of an attempt's log: run ``n`` (resumed ``n`` times)
#: numbers its lines from ``n * LOG_SEQ_RUN_SPAN + 1``.
LOG_SEQ_RUN_SPAN = 2**32
#: Runs beyond this share the last range (the wire takes seqs below 2**62).
_LOG_SEQ_MAX_RUN = 2**30 - 1


def log_seq_base(resumes: int) -> int:
    """The seq after which the run of an attempt resumed ``resumes`` times
    numbers its log lines."""
    return min(max(resumes, 0), _LOG_SEQ_MAX_RUN) * LOG_SEQ_RUN_SPAN


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, kw_only=True)
class JournalRecord:
    """One attempt the agent holds. The outcome fields are set only once the
    attempt is ``finished``; ``fingerprint`` is what the agent reports with the
    result and must repeat unchanged on every retry of that report."""

    task_id: str
    attempt: int
    lease_id: str
    lease_token: str = field(repr=False)
    device_id: str
    kind: TaskKind
    goal: str | None = None
    workflow: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    lease_s: float
    state: EntryState = EntryState.ACCEPTED
    outcome: Outcome | None = None
    retryable: bool = False
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    fingerprint: str | None = None
    created_at: datetime = field(default_factory=_utcnow)
    #: How many times a restarted agent has resumed running this attempt.
    resumes: int = 0
    #: The process groups its steps started: ``(pgid, leader start time)``.
    groups: tuple[tuple[int, int | None], ...] = ()

    def __post_init__(self) -> None:
        if not self.task_id:
            raise ValueError("task_id must be non-empty")
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int):
            raise ValueError(f"attempt must be an int, got {type(self.attempt).__name__}")
        if self.attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {self.attempt}")
        if not math.isfinite(self.lease_s) or self.lease_s <= 0:
            raise ValueError(f"lease_s must be a positive number, got {self.lease_s!r}")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")
        if isinstance(self.resumes, bool) or not isinstance(self.resumes, int) or self.resumes < 0:
            raise ValueError(f"resumes must be an int >= 0, got {self.resumes!r}")
        finished = self.state is EntryState.FINISHED
        if finished != (self.outcome is not None and self.fingerprint is not None):
            raise ValueError("outcome and fingerprint are set exactly when state is 'finished'")

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.attempt)


def canonical_json(value: Any) -> str:
    """The one JSON form used for fingerprints: sorted keys, no whitespace,
    UTF-8 text, no NaN/Infinity. Raises ``ValueError`` if ``value`` is not
    plain JSON data."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON-serialisable: {exc}") from exc


def result_fingerprint(
    *,
    task_id: str,
    attempt: int,
    outcome: Outcome,
    retryable: bool,
    reason: str,
    result: Mapping[str, Any],
) -> str:
    """SHA-256 hex of the canonical JSON array
    ``[task_id, attempt, outcome, retryable, reason, result]``.

    Deterministic across processes and Python versions, so the control plane can
    recompute it from the same fields. ``result`` must be plain JSON data."""
    canonical = canonical_json(
        [task_id, attempt, str(Outcome(outcome)), bool(retryable), reason, dict(result)]
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    task_id     TEXT    NOT NULL,
    attempt     INTEGER NOT NULL,
    lease_id    TEXT    NOT NULL,
    lease_token TEXT    NOT NULL,
    device_id   TEXT    NOT NULL,
    kind        TEXT    NOT NULL,
    goal        TEXT,
    workflow    TEXT,
    payload     TEXT    NOT NULL,
    lease_s     REAL    NOT NULL,
    state       TEXT    NOT NULL,
    outcome     TEXT,
    retryable   INTEGER NOT NULL DEFAULT 0,
    reason      TEXT    NOT NULL DEFAULT '',
    result      TEXT    NOT NULL DEFAULT '{}',
    fingerprint TEXT,
    created_at  TEXT    NOT NULL,
    resumes     INTEGER NOT NULL DEFAULT 0,
    pgroups     TEXT    NOT NULL DEFAULT '[]',
    PRIMARY KEY (task_id, attempt)
)
"""

#: Columns added after the first release, with their definition: added to an
#: older file when it is opened (same schema version: an additive change that
#: older agents, which name their columns, still read and write).
_ADDED_COLUMNS = {
    "resumes": "INTEGER NOT NULL DEFAULT 0",
    "pgroups": "TEXT NOT NULL DEFAULT '[]'",
}

_INSERT_COLUMNS = (
    "task_id, attempt, lease_id, lease_token, device_id, kind, goal, workflow, payload, "
    "lease_s, state, outcome, retryable, reason, result, fingerprint, created_at, resumes, pgroups"
)
# A NULL counter (written by hand, or by a tool that did not know it) reads as 0.
_COLUMNS = _INSERT_COLUMNS.replace("resumes", "COALESCE(resumes, 0)").replace(
    "pgroups", "COALESCE(pgroups, '[]')"
)
#: Index of ``fingerprint`` in a row of ``_COLUMNS``.
_FINGERPRINT_COLUMN = _INSERT_COLUMNS.split(", ").index("fingerprint")


def _from_row(row: tuple[Any, ...]) -> JournalRecord:
    (
        task_id,
        attempt,
        lease_id,
        lease_token,
        device_id,
        kind,
        goal,
        workflow,
        payload,
        lease_s,
        state,
        outcome,
        retryable,
        reason,
        result,
        fingerprint,
        created_at,
        resumes,
        pgroups,
    ) = row
    return JournalRecord(
        task_id=task_id,
        attempt=int(attempt),
        lease_id=lease_id,
        lease_token=lease_token,
        device_id=device_id,
        kind=TaskKind(kind),
        goal=goal,
        workflow=workflow,
        payload=json.loads(payload),
        lease_s=float(lease_s),
        state=EntryState(state),
        outcome=Outcome(outcome) if outcome is not None else None,
        retryable=bool(retryable),
        reason=reason,
        result=json.loads(result),
        fingerprint=fingerprint,
        created_at=datetime.fromisoformat(created_at),
        resumes=int(resumes or 0),
        groups=_groups_from(pgroups),
    )


def _groups_from(text: str | None) -> tuple[tuple[int, int | None], ...]:
    try:
        raw = json.loads(text or "[]")
    except ValueError:
        return ()
    out: list[tuple[int, int | None]] = []
    if isinstance(raw, list):
        for item in raw:
            if (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], int)
                and (item[1] is None or isinstance(item[1], int))
            ):
                out.append((item[0], item[1]))
    return tuple(out)


class _Corrupt(Exception):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _is_corruption(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    # Without an error code, only these messages are known to mean corruption.
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


class Journal:
    """The durable journal. Thread-safe: every method may be called from any
    thread (the agent calls it from an executor), and each write is one
    committed, fsynced transaction when the method returns.

    Usable as a context manager; ``close()`` is idempotent and any other call
    after it raises ``JournalError``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = self._open()

    @property
    def path(self) -> Path:
        return self._path

    @classmethod
    def in_state_dir(cls, state_dir: str | os.PathLike[str]) -> Journal:
        """The journal at ``<state_dir>/journal.sqlite3``, creating the directory
        (mode 0700) if needed."""
        directory = Path(state_dir)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(directory / JOURNAL_FILENAME)

    # -- opening and recovery -------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            return self._connect()
        except _Corrupt as exc:
            detail = exc.detail
        except sqlite3.Error as exc:
            if not _is_corruption(exc):
                raise JournalError(
                    f"cannot open journal {self._path}: {exc}", path=str(self._path)
                ) from exc
            detail = str(exc)
        except OSError as exc:
            raise JournalError(
                f"cannot open journal {self._path}: {exc}", path=str(self._path)
            ) from exc
        moved_to = self._move_aside()
        log.warning(
            "journal_corrupt_recovered",
            path=str(self._path),
            moved_to=str(moved_to),
            error=detail,
        )
        try:
            return self._connect()
        except (sqlite3.Error, _Corrupt, OSError) as exc:
            raise JournalError(
                f"cannot create a fresh journal at {self._path}: {exc}", path=str(self._path)
            ) from exc

    def _connect(self) -> sqlite3.Connection:
        self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Create the file ourselves so it never exists with a wider mode, and
        # tighten an existing one: it holds lease tokens. SQLite gives the -wal
        # and -shm files the database file's permissions.
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        # isolation_level=None: transactions are explicit (see _transaction),
        # never opened implicitly by the driver.
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            rows = conn.execute("PRAGMA integrity_check").fetchall()
            if [r[0] for r in rows] != ["ok"]:
                raise _Corrupt("integrity_check: " + "; ".join(str(r[0]) for r in rows[:5]))
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise _Corrupt(f"unknown journal schema version {version}")
            conn.execute(_SCHEMA)
            present = {r[1] for r in conn.execute("PRAGMA table_info(entries)").fetchall()}
            for name, definition in _ADDED_COLUMNS.items():
                if name not in present:
                    conn.execute(f"ALTER TABLE entries ADD COLUMN {name} {definition}")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_aside(self) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        target = self._path.with_name(f"{self._path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self._path.with_name(f"{self._path.name}.corrupt-{stamp}-{n}")
            n += 1
        os.replace(self._path, target)
        # The WAL belongs to the bad file: keep it beside it for inspection, so
        # SQLite never replays it into the fresh journal. The -shm is only an
        # index of the WAL and is rebuilt.
        wal = self._path.with_name(self._path.name + "-wal")
        if wal.exists():
            os.replace(wal, target.with_name(target.name + "-wal"))
        shm = self._path.with_name(self._path.name + "-shm")
        shm.unlink(missing_ok=True)
        return target

    # -- plumbing ---------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn
            if conn is None:
                raise JournalError("journal is closed", path=str(self._path))
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise JournalError(f"journal write failed: {exc}", path=str(self._path)) from exc

    @contextmanager
    def _statement(self) -> Iterator[sqlite3.Connection]:
        """For a write that is one statement: run in autocommit mode, SQLite
        makes the statement a transaction of its own, committed (and, with
        ``synchronous=FULL``, on disk) when ``execute`` returns, exactly as an
        explicit BEGIN ... COMMIT around it, in one call into SQLite instead of
        three (each releases and retakes the GIL the event loop is waiting for)."""
        with self._lock:
            conn = self._conn
            if conn is None:
                raise JournalError("journal is closed", path=str(self._path))
            if conn.in_transaction:
                # Never the case (every transaction ends in COMMIT or ROLLBACK);
                # a write inside a left-open one would not be committed.
                raise JournalError(
                    "journal write failed: a transaction is open", path=str(self._path)
                )
            try:
                yield conn
            except sqlite3.Error as exc:
                raise JournalError(f"journal write failed: {exc}", path=str(self._path)) from exc

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._conn
            if conn is None:
                raise JournalError("journal is closed", path=str(self._path))
            try:
                yield conn
            except sqlite3.Error as exc:
                raise JournalError(f"journal read failed: {exc}", path=str(self._path)) from exc

    # -- operations ---------------------------------------------------------------

    def add(self, record: JournalRecord) -> bool:
        """Store ``record`` durably. Idempotent on ``(task_id, attempt)``: if an
        entry exists already it is left unchanged and ``False`` is returned."""
        payload = canonical_json(record.payload)
        result = canonical_json(record.result)
        with self._statement() as conn:
            cur = conn.execute(
                f"INSERT OR IGNORE INTO entries ({_INSERT_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.task_id,
                    record.attempt,
                    record.lease_id,
                    record.lease_token,
                    record.device_id,
                    str(record.kind),
                    record.goal,
                    record.workflow,
                    payload,
                    record.lease_s,
                    str(record.state),
                    str(record.outcome) if record.outcome is not None else None,
                    int(record.retryable),
                    record.reason,
                    result,
                    record.fingerprint,
                    record.created_at.isoformat(),
                    record.resumes,
                    json.dumps([list(g) for g in record.groups]),
                ),
            )
            inserted = cur.rowcount == 1
        log.debug(
            "journal_entry_added",
            task_id=record.task_id,
            attempt=record.attempt,
            inserted=inserted,
        )
        return inserted

    def get(self, task_id: str, attempt: int) -> JournalRecord | None:
        with self._reading() as conn:
            row = conn.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE task_id = ? AND attempt = ?",
                (task_id, attempt),
            ).fetchone()
        return _from_row(row) if row is not None else None

    def entries(self) -> list[JournalRecord]:
        """Every entry, oldest first."""
        with self._reading() as conn:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM entries ORDER BY created_at, task_id, attempt"
            ).fetchall()
        return [_from_row(r) for r in rows]

    def mark_running(self, task_id: str, attempt: int) -> bool:
        """Move an ``accepted`` entry to ``running``. Returns whether it moved;
        an entry already running or finished is left as it is. Raises
        ``UnknownEntry`` if there is no such entry."""
        with self._statement() as conn:
            cur = conn.execute(
                "UPDATE entries SET state = ? WHERE task_id = ? AND attempt = ? AND state = ?",
                (str(EntryState.RUNNING), task_id, attempt, str(EntryState.ACCEPTED)),
            )
            if cur.rowcount == 0 and not self._exists(conn, task_id, attempt):
                raise UnknownEntry(task_id, attempt)
            moved = cur.rowcount == 1
        log.debug("journal_entry_running", task_id=task_id, attempt=attempt, moved=moved)
        return moved

    def begin_resume(self, task_id: str, attempt: int) -> int:
        """Count one more resume of the entry and return the new count, committed
        (fsynced) before it returns: call it *before* running a resumed attempt,
        so a run that kills the agent is counted. Raises ``UnknownEntry`` if
        there is no such entry."""
        with self._transaction() as conn:
            cur = conn.execute(
                "UPDATE entries SET resumes = COALESCE(resumes, 0) + 1 "
                "WHERE task_id = ? AND attempt = ?",
                (task_id, attempt),
            )
            if cur.rowcount == 0:
                raise UnknownEntry(task_id, attempt)
            row = conn.execute(
                "SELECT resumes FROM entries WHERE task_id = ? AND attempt = ?",
                (task_id, attempt),
            ).fetchone()
            count = int(row[0])
        log.debug("journal_entry_resumed", task_id=task_id, attempt=attempt, resumes=count)
        return count

    def add_group(self, task_id: str, attempt: int, pgid: int, start: int | None) -> None:
        """Record a process group started for the attempt (committed on return);
        an entry that is gone is left alone."""
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT COALESCE(pgroups, '[]') FROM entries WHERE task_id = ? AND attempt = ?",
                (task_id, attempt),
            ).fetchone()
            if row is None:
                return
            groups = [list(g) for g in _groups_from(row[0])]
            groups.append([int(pgid), start])
            conn.execute(
                "UPDATE entries SET pgroups = ? WHERE task_id = ? AND attempt = ?",
                (json.dumps(groups[-32:]), task_id, attempt),
            )

    def clear_groups(self, task_id: str, attempt: int) -> None:
        """Forget the attempt's recorded process groups (they have been ended)."""
        with self._statement() as conn:
            conn.execute(
                "UPDATE entries SET pgroups = '[]' WHERE task_id = ? AND attempt = ?",
                (task_id, attempt),
            )

    def record_result(
        self,
        task_id: str,
        attempt: int,
        outcome: Outcome,
        retryable: bool,
        reason: str,
        result: Mapping[str, Any],
    ) -> str:
        """Record the attempt's outcome and return its fingerprint.

        The first recorded result wins: once an entry is finished, later calls
        change nothing and return the first fingerprint, so a repeated report is
        always byte-identical. Raises ``UnknownEntry`` if there is no such
        entry and ``ValueError`` if ``result`` is not plain JSON data.
        """
        fingerprint, _ = self._record_result(
            task_id, attempt, outcome, retryable, reason, result, read_back=False
        )
        return fingerprint

    def finish(
        self,
        task_id: str,
        attempt: int,
        outcome: Outcome,
        retryable: bool,
        reason: str,
        result: Mapping[str, Any],
    ) -> JournalRecord:
        """:meth:`record_result`, then the entry as stored (the first recorded
        result, if there was one already), read in the same transaction: one
        call, so one trip to the agent's executor instead of two."""
        _, stored = self._record_result(
            task_id, attempt, outcome, retryable, reason, result, read_back=True
        )
        assert stored is not None
        return stored

    def _record_result(
        self,
        task_id: str,
        attempt: int,
        outcome: Outcome,
        retryable: bool,
        reason: str,
        result: Mapping[str, Any],
        *,
        read_back: bool,
    ) -> tuple[str, JournalRecord | None]:
        outcome = Outcome(outcome)
        # Round-trip through JSON so what is stored, what is fingerprinted and
        # what a reopened journal returns are the same value (tuples -> lists).
        plain: dict[str, Any] = json.loads(canonical_json(dict(result)))
        fingerprint = result_fingerprint(
            task_id=task_id,
            attempt=attempt,
            outcome=outcome,
            retryable=retryable,
            reason=reason,
            result=plain,
        )
        stored: JournalRecord | None = None
        with self._statement() as conn:
            # One statement: the first recorded result wins (a finished entry
            # has its fingerprint and is left as it is).
            cur = conn.execute(
                "UPDATE entries SET state = ?, outcome = ?, retryable = ?, reason = ?, "
                "result = ?, fingerprint = ? "
                "WHERE task_id = ? AND attempt = ? AND fingerprint IS NULL",
                (
                    str(EntryState.FINISHED),
                    str(outcome),
                    int(bool(retryable)),
                    reason,
                    canonical_json(plain),
                    fingerprint,
                    task_id,
                    attempt,
                ),
            )
            replayed = cur.rowcount == 0
            existing = fingerprint
            if replayed or read_back:
                row = conn.execute(
                    f"SELECT {_COLUMNS} FROM entries WHERE task_id = ? AND attempt = ?",
                    (task_id, attempt),
                ).fetchone()
                if row is None:
                    raise UnknownEntry(task_id, attempt)
                stored = _from_row(row) if read_back else None
                existing = row[_FINGERPRINT_COLUMN]
        log.debug(
            "journal_result_recorded",
            task_id=task_id,
            attempt=attempt,
            outcome=str(outcome),
            fingerprint=existing,
            replayed=replayed,
        )
        return existing, stored

    def remove(self, task_id: str, attempt: int) -> bool:
        """Delete the entry; returns whether one existed. Idempotent."""
        with self._statement() as conn:
            cur = conn.execute(
                "DELETE FROM entries WHERE task_id = ? AND attempt = ?", (task_id, attempt)
            )
            removed = cur.rowcount == 1
        log.debug("journal_entry_removed", task_id=task_id, attempt=attempt, removed=removed)
        return removed

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @staticmethod
    def _exists(conn: sqlite3.Connection, task_id: str, attempt: int) -> bool:
        row = conn.execute(
            "SELECT 1 FROM entries WHERE task_id = ? AND attempt = ?", (task_id, attempt)
        ).fetchone()
        return row is not None


T = TypeVar("T")
_Call = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class JournalThread:
    """An agent's journal calls, run in the order they are made on one thread
    of their own, so that the event loop never waits for SQLite's fsync.

    The journal serializes its calls behind its lock anyway; one thread in
    place of the default executor's pool means that a run of calls queued
    together (several attempts acking or finishing at once) wakes the thread
    once and reaches the loop in one hand-off, instead of one thread hand-off
    and one loop wake-up each. A call's caller is answered after the call
    returned, as before: a write is committed when its ``await`` ends. A
    caller cancelled meanwhile does not stop its call (nor did the executor).
    """

    def __init__(self, name: str = "fleetlease-journal") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((loop, fut, fn, args))
        return await fut

    async def stop(self) -> None:
        """Run what is queued, then end the thread (idempotent; a later call
        starts another)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)

    def _work(self) -> None:
        q = self._queue
        while True:
            batch = [q.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(q.get_nowait())
            answers: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, Any]]] = {}
            stop = False
            for item in batch:
                if item is None:
                    stop = True
                    continue
                loop, fut, fn, args = item
                answer: tuple[asyncio.Future[Any], Any, BaseException | None]
                try:
                    answer = (fut, fn(*args), None)
                except BaseException as exc:  # handed to the caller, as an executor does
                    answer = (fut, None, exc)
                answers.setdefault(loop, []).append(answer)
            for loop, settled in answers.items():
                # The loop is gone only if the agent is: nobody waits any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, settled)
            if stop:
                return


def _settle(settled: list[tuple[Any, Any, Any]]) -> None:
    for fut, result, exc in settled:
        if fut.done():
            continue  # its caller was cancelled
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
