from __future__ import annotations

import asyncio
import os
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from fleetlease.hostagent.journal import (
    EntryState,
    Journal,
    JournalError,
    JournalRecord,
    JournalThread,
    UnknownEntry,
    log_seq_base,
    result_fingerprint,
)
from fleetlease.persistence.model import Outcome, TaskKind

TOKEN = "lease-token-0123456789abcdef-secret"
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def record(task_id: str = "task-1", attempt: int = 1, **overrides: Any) -> JournalRecord:
    fields: dict[str, Any] = {
        "task_id": task_id,
        "attempt": attempt,
        "lease_id": f"lease-{task_id}-{attempt}",
        "lease_token": TOKEN,
        "device_id": "sim-0",
        "kind": TaskKind.GOAL,
        "goal": "open settings",
        "payload": {"sim": {"duration_s": 0.5, "outcome": "done"}, "note": "héllo"},
        "lease_s": 30.0,
        "created_at": T0,
    }
    fields.update(overrides)
    return JournalRecord(**fields)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "journal.sqlite3"


@pytest.fixture
def journal(path: Path) -> Any:
    with Journal(path) as j:
        yield j


def test_added_entry_is_returned_by_get_and_entries(journal: Journal) -> None:
    assert journal.add(record()) is True

    got = journal.get("task-1", 1)

    assert got == record()
    assert got is not None and got.state is EntryState.ACCEPTED
    assert journal.entries() == [record()]


def test_get_of_an_unknown_attempt_is_none(journal: Journal) -> None:
    journal.add(record())

    assert journal.get("task-1", 2) is None
    assert journal.get("other", 1) is None


def test_add_is_idempotent_and_keeps_the_first_entry(journal: Journal) -> None:
    journal.add(record())

    assert journal.add(record(device_id="sim-9")) is False

    assert [e.device_id for e in journal.entries()] == ["sim-0"]


def test_attempts_of_one_task_are_separate_entries(journal: Journal) -> None:
    journal.add(record(attempt=1))
    journal.add(record(attempt=2, created_at=T0 + timedelta(seconds=1)))

    assert [e.key for e in journal.entries()] == [("task-1", 1), ("task-1", 2)]


def test_entries_are_oldest_first(journal: Journal) -> None:
    journal.add(record("b", created_at=T0 + timedelta(seconds=2)))
    journal.add(record("a", created_at=T0 + timedelta(seconds=1)))

    assert [e.task_id for e in journal.entries()] == ["a", "b"]


def test_mark_running_moves_an_accepted_entry_once(journal: Journal) -> None:
    journal.add(record())

    assert journal.mark_running("task-1", 1) is True
    assert journal.mark_running("task-1", 1) is False

    got = journal.get("task-1", 1)
    assert got is not None and got.state is EntryState.RUNNING


def test_mark_running_of_an_unknown_entry_raises(journal: Journal) -> None:
    with pytest.raises(UnknownEntry):
        journal.mark_running("nope", 1)


def test_record_result_finishes_the_entry_and_returns_its_fingerprint(journal: Journal) -> None:
    journal.add(record())
    journal.mark_running("task-1", 1)

    fp = journal.record_result("task-1", 1, Outcome.FAILED, True, "flaky", {"n": 1})

    got = journal.get("task-1", 1)
    assert got is not None
    assert got.state is EntryState.FINISHED
    assert (got.outcome, got.retryable, got.reason, got.result) == (
        Outcome.FAILED,
        True,
        "flaky",
        {"n": 1},
    )
    assert got.fingerprint == fp
    assert fp == result_fingerprint(
        task_id="task-1",
        attempt=1,
        outcome=Outcome.FAILED,
        retryable=True,
        reason="flaky",
        result={"n": 1},
    )


def test_first_recorded_result_wins(journal: Journal) -> None:
    journal.add(record())
    first = journal.record_result("task-1", 1, Outcome.DONE, False, "", {"a": 1})

    second = journal.record_result("task-1", 1, Outcome.FAILED, False, "later", {"b": 2})

    assert second == first
    got = journal.get("task-1", 1)
    assert got is not None and got.outcome is Outcome.DONE and got.result == {"a": 1}


def test_mark_running_after_finish_leaves_it_finished(journal: Journal) -> None:
    journal.add(record())
    journal.record_result("task-1", 1, Outcome.DONE, False, "", {})

    assert journal.mark_running("task-1", 1) is False
    got = journal.get("task-1", 1)
    assert got is not None and got.state is EntryState.FINISHED


def test_record_result_of_an_unknown_entry_raises(journal: Journal) -> None:
    with pytest.raises(UnknownEntry):
        journal.record_result("nope", 1, Outcome.DONE, False, "", {})


def test_record_result_rejects_a_result_that_is_not_json(journal: Journal) -> None:
    journal.add(record())

    with pytest.raises(ValueError):
        journal.record_result("task-1", 1, Outcome.DONE, False, "", {"x": object()})

    got = journal.get("task-1", 1)
    assert got is not None and got.state is EntryState.ACCEPTED


def test_finish_records_the_result_and_returns_the_stored_entry(path: Path) -> None:
    with Journal(path) as journal:
        journal.add(record())
        journal.mark_running("task-1", 1)

        stored = journal.finish("task-1", 1, Outcome.FAILED, True, "flaky", {"n": (1, 2)})

        assert stored == journal.get("task-1", 1)
        assert stored.state is EntryState.FINISHED
        assert (stored.outcome, stored.retryable, stored.reason, stored.result) == (
            Outcome.FAILED,
            True,
            "flaky",
            {"n": [1, 2]},
        )
        assert stored.fingerprint == result_fingerprint(
            task_id="task-1",
            attempt=1,
            outcome=Outcome.FAILED,
            retryable=True,
            reason="flaky",
            result={"n": [1, 2]},
        )
        # The first recorded result wins, and is what finish returns.
        again = journal.finish("task-1", 1, Outcome.DONE, False, "", {"other": 1})
        assert again == stored
        assert journal.record_result("task-1", 1, Outcome.DONE, False, "", {}) == stored.fingerprint
    # Committed: a reopened journal reads the same entry.
    with Journal(path) as reopened:
        assert reopened.get("task-1", 1) == stored


def test_finish_of_an_unknown_entry_or_a_result_that_is_not_json_raises(journal: Journal) -> None:
    with pytest.raises(UnknownEntry):
        journal.finish("nope", 1, Outcome.DONE, False, "", {})
    journal.add(record())
    with pytest.raises(ValueError):
        journal.finish("task-1", 1, Outcome.DONE, False, "", {"x": object()})
    got = journal.get("task-1", 1)
    assert got is not None and got.state is EntryState.ACCEPTED


def test_fingerprint_is_stable_and_independent_of_key_order() -> None:
    common: dict[str, Any] = {
        "task_id": "t",
        "attempt": 3,
        "outcome": Outcome.DONE,
        "retryable": False,
        "reason": "",
    }

    a = result_fingerprint(result={"x": 1, "y": [1, 2]}, **common)
    b = result_fingerprint(result={"y": [1, 2], "x": 1}, **common)

    assert a == b
    # Pinned to sha256('["t",3,"done",false,"",{"x":1,"y":[1,2]}]'): the control
    # plane may recompute it, so the canonical form must not drift.
    assert a == "8ef3760d5121f487e375d03360039ac70ee3a834abb4232f65fde36df6bdd581"


def test_fingerprint_changes_with_every_field() -> None:
    base: dict[str, Any] = {
        "task_id": "t",
        "attempt": 1,
        "outcome": Outcome.DONE,
        "retryable": False,
        "reason": "",
        "result": {},
    }
    variants: list[dict[str, Any]] = [
        {"task_id": "u"},
        {"attempt": 2},
        {"outcome": Outcome.FAILED},
        {"retryable": True},
        {"reason": "r"},
        {"result": {"k": 1}},
    ]
    prints = {result_fingerprint(**base)} | {result_fingerprint(**(base | v)) for v in variants}

    assert len(prints) == len(variants) + 1


def test_remove_deletes_the_entry_and_is_idempotent(journal: Journal) -> None:
    journal.add(record())

    assert journal.remove("task-1", 1) is True
    assert journal.remove("task-1", 1) is False
    assert journal.get("task-1", 1) is None
    assert journal.entries() == []


def test_entries_survive_close_and_reopen(path: Path) -> None:
    with Journal(path) as j:
        j.add(record("a"))
        j.add(record("b", created_at=T0 + timedelta(seconds=1)))
        j.mark_running("a", 1)
        fp = j.record_result("b", 1, Outcome.CANCELLED, False, "cancel requested", {"s": [1]})
        j.add(record("c", created_at=T0 + timedelta(seconds=2)))
        j.remove("c", 1)

    with Journal(path) as reopened:
        entries = reopened.entries()
        # Recording again after reopen still returns the first fingerprint.
        again = reopened.record_result("b", 1, Outcome.DONE, False, "", {})

    assert [(e.task_id, e.state) for e in entries] == [
        ("a", EntryState.RUNNING),
        ("b", EntryState.FINISHED),
    ]
    assert entries[1].fingerprint == fp == again
    assert entries[1].result == {"s": [1]}
    assert entries[0].lease_token == TOKEN
    assert entries[0].payload == record().payload


def test_begin_resume_counts_durably_and_every_entry_starts_at_zero(path: Path) -> None:
    with Journal(path) as j:
        j.add(record("a"))
        j.add(record("b", created_at=T0 + timedelta(seconds=1)))
        j.mark_running("a", 1)
        assert j.get("a", 1).resumes == 0  # type: ignore[union-attr]

        assert j.begin_resume("a", 1) == 1
        assert j.begin_resume("a", 1) == 2

    with Journal(path) as reopened:
        counts = {e.task_id: e.resumes for e in reopened.entries()}
        # The counter survives a result being recorded (the finished entry keeps it).
        reopened.record_result("a", 1, Outcome.FAILED, True, "gave up", {})
        finished = reopened.get("a", 1)

    assert counts == {"a": 2, "b": 0}
    assert finished is not None and finished.resumes == 2
    assert finished.state is EntryState.FINISHED


def test_each_run_of_an_attempt_numbers_its_log_lines_in_a_range_of_its_own() -> None:
    assert [log_seq_base(n) for n in (0, 1, 2)] == [0, 2**32, 2**33]
    # However often it is resumed, seqs stay within what the wire takes.
    assert log_seq_base(2**40) + 2**32 <= 2**62


def test_begin_resume_of_an_unknown_entry_raises(journal: Journal) -> None:
    with pytest.raises(UnknownEntry):
        journal.begin_resume("nope", 1)


# The schema of the first release: no resume counter.
_OLD_SCHEMA = """
CREATE TABLE entries (
    task_id TEXT NOT NULL, attempt INTEGER NOT NULL, lease_id TEXT NOT NULL,
    lease_token TEXT NOT NULL, device_id TEXT NOT NULL, kind TEXT NOT NULL, goal TEXT,
    workflow TEXT, payload TEXT NOT NULL, lease_s REAL NOT NULL, state TEXT NOT NULL,
    outcome TEXT, retryable INTEGER NOT NULL DEFAULT 0, reason TEXT NOT NULL DEFAULT '',
    result TEXT NOT NULL DEFAULT '{}', fingerprint TEXT, created_at TEXT NOT NULL,
    PRIMARY KEY (task_id, attempt)
)
"""


def test_a_journal_of_the_old_format_reads_with_zero_resumes_and_counts_on(path: Path) -> None:
    import sqlite3

    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.execute(_OLD_SCHEMA)
    conn.execute(
        "INSERT INTO entries (task_id, attempt, lease_id, lease_token, device_id, kind, goal, "
        "payload, lease_s, state, created_at) VALUES (?, 1, 'l', ?, 'sim-0', 'goal', 'g', "
        "'{}', 30.0, 'running', ?)",
        ("old-task", TOKEN, T0.isoformat()),
    )
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()

    with capture_logs() as logs, Journal(path) as j:
        [old] = j.entries()
        assert (old.task_id, old.state, old.resumes) == ("old-task", EntryState.RUNNING, 0)
        assert j.begin_resume("old-task", 1) == 1
        j.add(record("new"))
        assert j.get("new", 1).resumes == 0  # type: ignore[union-attr]

    assert not [e for e in logs if e["event"] == "journal_corrupt_recovered"]
    assert not _corrupt_siblings(path)
    with Journal(path) as reopened:
        assert reopened.get("old-task", 1).resumes == 1  # type: ignore[union-attr]


def test_a_torn_resume_commit_leaves_the_previous_count(path: Path, tmp_path: Path) -> None:
    """The agent dies while the counter's commit is being written (torn WAL
    frame): the reopened journal has the entry with the count before, never a
    garbled one, and does not move the file aside."""
    import shutil

    with Journal(path) as j:
        j.add(record())
        j.mark_running("task-1", 1)
        assert j.begin_resume("task-1", 1) == 1
        assert j.begin_resume("task-1", 1) == 2
        # A crash now: copy the files as they are on disk, WAL and all.
        crashed = tmp_path / "crashed" / path.name
        crashed.parent.mkdir()
        shutil.copy(path, crashed)
        wal = path.with_name(path.name + "-wal")
        assert wal.exists() and wal.stat().st_size > 200
        crashed_wal = crashed.with_name(crashed.name + "-wal")
        shutil.copy(wal, crashed_wal)
    os.truncate(crashed_wal, crashed_wal.stat().st_size - 100)

    with capture_logs() as logs, Journal(crashed) as reopened:
        entry = reopened.get("task-1", 1)

    assert entry is not None and entry.resumes == 1
    assert not [e for e in logs if e["event"] == "journal_corrupt_recovered"]


def test_journal_file_is_private_to_the_owner(path: Path) -> None:
    with Journal(path) as j:
        j.add(record())

        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_an_existing_wider_file_is_tightened_to_0600(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.touch(mode=0o644)
    os.chmod(path, 0o644)

    with Journal(path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def _corrupt_siblings(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if ".corrupt-" in p.name)


def _populate(path: Path, n: int = 40) -> None:
    with Journal(path) as j:
        for i in range(n):
            j.add(record(f"task-{i}", payload={"blob": "x" * 300}))


def test_a_journal_truncated_to_half_is_moved_aside_and_started_fresh(path: Path) -> None:
    _populate(path)
    os.truncate(path, os.path.getsize(path) // 2)

    with capture_logs() as logs, Journal(path) as j:
        assert j.entries() == []
        j.add(record())
        assert j.get("task-1", 1) is not None

    events = [e for e in logs if e["event"] == "journal_corrupt_recovered"]
    assert len(events) == 1 and events[0]["log_level"] == "warning"
    moved = _corrupt_siblings(path)
    assert [str(p) for p in moved] == [events[0]["moved_to"]]
    assert moved[0].name.startswith("journal.sqlite3.corrupt-")


def test_a_journal_of_garbage_is_moved_aside_and_started_fresh(path: Path) -> None:
    _populate(path, n=3)
    path.write_bytes(os.urandom(os.path.getsize(path)))

    with capture_logs() as logs, Journal(path) as j:
        assert j.entries() == []

    assert [e["event"] for e in logs].count("journal_corrupt_recovered") == 1
    assert len(_corrupt_siblings(path)) == 1


def test_a_journal_with_a_damaged_schema_page_is_recovered(path: Path) -> None:
    _populate(path)
    with path.open("r+b") as f:
        # Just past the 100-byte file header: the schema b-tree page.
        f.seek(100)
        f.write(b"\xff" * 2000)

    with capture_logs() as logs, Journal(path) as j:
        assert j.entries() == []

    assert "journal_corrupt_recovered" in [e["event"] for e in logs]


def test_recovered_journal_is_still_private(path: Path) -> None:
    _populate(path, n=3)
    path.write_bytes(b"not a database at all" * 100)

    with Journal(path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_healthy_journal_is_not_moved_aside(path: Path) -> None:
    _populate(path, n=3)

    with capture_logs() as logs, Journal(path) as j:
        assert len(j.entries()) == 3

    assert "journal_corrupt_recovered" not in [e["event"] for e in logs]
    assert _corrupt_siblings(path) == []


def test_the_lease_token_never_appears_in_logs_or_repr(path: Path) -> None:
    with capture_logs() as logs:
        with Journal(path) as j:
            j.add(record())
            j.mark_running("task-1", 1)
            j.record_result("task-1", 1, Outcome.DONE, False, "", {})
            text = repr(j.entries()) + repr(j.get("task-1", 1))
            j.remove("task-1", 1)
        path.write_bytes(b"garbage" * 1000)
        Journal(path).close()

    assert TOKEN not in text
    assert logs, "expected some log events to check"
    assert all(TOKEN not in repr(e) for e in logs)


def test_operations_after_close_raise_and_close_is_idempotent(path: Path) -> None:
    j = Journal(path)
    j.close()
    j.close()

    assert j.closed
    with pytest.raises(JournalError):
        j.entries()
    with pytest.raises(JournalError):
        j.add(record())


def test_concurrent_writers_from_threads_all_land(journal: Journal) -> None:
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            barrier.wait()
            for i in range(10):
                journal.add(record(f"t{n}-{i}"))
                journal.mark_running(f"t{n}-{i}", 1)
                journal.record_result(f"t{n}-{i}", 1, Outcome.DONE, False, "", {"i": i})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    entries = journal.entries()
    assert len(entries) == 80
    assert all(e.state is EntryState.FINISHED for e in entries)


def test_in_state_dir_uses_the_standard_file_name(tmp_path: Path) -> None:
    with Journal.in_state_dir(tmp_path / "agent") as j:
        assert j.path == tmp_path / "agent" / "journal.sqlite3"
        assert stat.S_IMODE(os.stat(tmp_path / "agent").st_mode) == 0o700


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"attempt": 0}, "attempt"),
        ({"lease_s": 0.0}, "lease_s"),
        ({"created_at": datetime(2030, 1, 1)}, "created_at"),
        ({"state": EntryState.FINISHED}, "fingerprint"),
        ({"task_id": ""}, "task_id"),
        ({"resumes": -1}, "resumes"),
    ],
)
def test_invalid_records_are_rejected(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        record(**overrides)


def test_an_unusable_path_raises_a_journal_error_and_moves_nothing(tmp_path: Path) -> None:
    (tmp_path / "journal.sqlite3").mkdir()

    with pytest.raises(JournalError):
        Journal(tmp_path / "journal.sqlite3")

    assert _corrupt_siblings(tmp_path / "journal.sqlite3") == []


def test_every_write_is_committed_when_it_returns(path: Path) -> None:
    """Single-statement writes run in autocommit mode: each is its own committed
    transaction, visible to another connection at once, none left open."""
    import sqlite3

    def seen() -> list[tuple[Any, ...]]:
        other = sqlite3.connect(path)
        try:
            return other.execute("SELECT task_id, state, fingerprint FROM entries").fetchall()
        finally:
            other.close()

    with Journal(path) as journal:
        journal.add(record())
        assert seen() == [("task-1", "accepted", None)]
        journal.mark_running("task-1", 1)
        assert seen() == [("task-1", "running", None)]
        stored = journal.finish("task-1", 1, Outcome.DONE, False, "", {})
        assert seen() == [("task-1", "finished", stored.fingerprint)]
        journal.remove("task-1", 1)
        assert seen() == []
        conn = journal._conn
        assert conn is not None and not conn.in_transaction


# --- JournalThread: the agent's journal calls, in order, off the loop ---------------------


async def test_journal_thread_runs_calls_in_order_on_one_thread_off_the_loop() -> None:
    jt = JournalThread()
    ran: list[tuple[int, int]] = []

    def work(i: int) -> int:
        ran.append((i, threading.get_ident()))
        return i * i

    try:
        answers = await asyncio.gather(*(jt.call(work, i) for i in range(50)))
    finally:
        await jt.stop()
    assert answers == [i * i for i in range(50)]
    assert [i for i, _ in ran] == list(range(50))
    threads = {t for _, t in ran}
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_journal_thread_hands_each_caller_its_own_error() -> None:
    jt = JournalThread()

    def fails(i: int) -> int:
        if i % 2:
            raise UnknownEntry(f"task-{i}", 1)
        return i

    try:
        outcomes = await asyncio.gather(
            *(jt.call(fails, i) for i in range(6)), return_exceptions=True
        )
    finally:
        await jt.stop()
    assert outcomes[0::2] == [0, 2, 4]
    for i, exc in zip(range(1, 6, 2), outcomes[1::2], strict=True):
        assert isinstance(exc, UnknownEntry) and exc.fields == {
            "task_id": f"task-{i}",
            "attempt": 1,
        }


async def test_a_cancelled_caller_does_not_stop_its_call_nor_the_next() -> None:
    jt = JournalThread()
    release = threading.Event()
    started = threading.Event()
    ran: list[str] = []

    def blocked() -> str:
        started.set()
        release.wait(10)
        ran.append("first")
        return "first"

    def second() -> str:
        ran.append("second")
        return "second"

    try:
        first = asyncio.ensure_future(jt.call(blocked))
        gone = asyncio.ensure_future(jt.call(second))
        third = asyncio.ensure_future(jt.call(lambda: "third"))
        # The thread holds the first; the other two were queued before it began.
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        gone.cancel()
        release.set()
        assert await first == "first"
        assert await third == "third"
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert ran == ["first", "second"]  # it ran all the same, in its turn
    finally:
        release.set()
        await jt.stop()


async def test_journal_thread_stop_runs_what_is_queued_and_a_later_call_starts_again(
    tmp_path: Path,
) -> None:
    jt = JournalThread()
    journal = Journal(tmp_path / "j.sqlite3")
    try:
        assert await jt.call(journal.add, record()) is True
        # A call queued before the stop runs before the thread ends.
        moved, _ = await asyncio.gather(jt.call(journal.mark_running, "task-1", 1), jt.stop())
        assert moved is True
        # Restarted by the next call: the agent may run again after a stop.
        assert await jt.call(journal.mark_running, "task-1", 1) is False
        stored = await jt.call(journal.finish, "task-1", 1, Outcome.DONE, False, "", {"ok": True})
        assert stored.state is EntryState.FINISHED
        assert await jt.call(journal.remove, "task-1", 1) is True
        assert await jt.call(journal.entries) == []
    finally:
        await jt.stop()
        journal.close()


def test_process_groups_are_recorded_per_entry_and_cleared(journal: Journal) -> None:
    journal.add(record("t1"))
    journal.add(record("t2"))

    journal.add_group("t1", 1, 4242, 99)
    journal.add_group("t1", 1, 4243, None)
    journal.add_group("gone", 1, 1, 1)  # no such entry: nothing happens

    entry = journal.get("t1", 1)
    assert entry is not None and entry.groups == ((4242, 99), (4243, None))
    other = journal.get("t2", 1)
    assert other is not None and other.groups == ()
    journal.clear_groups("t1", 1)
    cleared = journal.get("t1", 1)
    assert cleared is not None and cleared.groups == ()
