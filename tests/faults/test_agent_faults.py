"""Faults of one agent process: paused (SIGSTOP) past its lease, killed between
its journal write and its report, its journal file truncated mid-record.

Invariants: a paused agent's late renewal and result are refused and change
nothing, the retry on another host wins; a killed agent, restarted, recovers
from its journal without crashing and its attempt gets exactly one first-time
terminal report; plus the shared database invariants (``fleetlease.ops.testing.invariants``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from fleetlease.ops.testing.cluster import Cluster, Timings, wait_for
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


def journal_files(cluster: Cluster, host_id: str) -> tuple[Path, Path]:
    directory = cluster.state_dir / "agents" / host_id
    return directory / "journal.sqlite3", directory / "journal.sqlite3-wal"


async def test_agent_paused_past_its_lease_is_refused_and_the_retry_elsewhere_wins(
    make_cluster: MakeCluster,
) -> None:
    cluster = await make_cluster()
    await cluster.start_serve()
    paused = (await cluster.start_agent("h-paused", devices=1)).proc
    [task_id] = await cluster.submit(1, sim={"duration_s": 1.0}, max_attempts=3)
    await cluster.wait_view(
        task_id,
        lambda v: v["state"] == "running" and v["attempts"][0]["host_id"] == "h-paused",
        timeout=30,
        what="attempt 1 running on h-paused",
    )

    paused.signal(signal.SIGSTOP)
    try:
        await cluster.start_agent("h-other", devices=1)
        await cluster.wait_view(
            task_id,
            lambda v: v["attempt"] == 2 and v["attempts"][0]["end_reason"] == "lease_expired",
            timeout=30,
            what="attempt 1 expired and attempt 2 assigned",
        )
    finally:
        paused.signal(signal.SIGCONT)

    # Woken up with its runner finished and its renewal overdue, the paused agent
    # sends whichever comes first; the control plane refuses it.
    def refused() -> bool:
        lost = paused.named("lease_lost", task_id=task_id, attempt=1)
        rejected = paused.named("result_rejected", task_id=task_id, attempt=1)
        return bool(lost or rejected)

    await wait_for(refused, timeout=30, what="the paused agent's late message refused")
    view = await cluster.wait_view(
        task_id, lambda v: v["state"] == "done", timeout=30, what="task done"
    )
    assert view["attempt"] == 2
    assert [a["host_id"] for a in view["attempts"]] == ["h-paused", "h-other"]
    assert view["attempts"][1]["end_reason"] == "done"
    assert not paused.named("result_reported", task_id=task_id, attempt=1)
    assert paused.alive, paused.tail()
    await cluster.assert_invariants()
    lost = paused.named("lease_lost", task_id=task_id, attempt=1)
    print(
        "SIGSTOP past the lease: late "
        + (f"renewal refused ({lost[0]['reason']})" if lost else "result rejected")
    )


@pytest.mark.parametrize("failpoint", ["after_journal_add", "after_result_recorded"])
async def test_agent_killed_between_journal_write_and_report_recovers_with_one_report(
    make_cluster: MakeCluster, failpoint: str
) -> None:
    # Deadlines longer than an agent restart: the restarted agent resumes the
    # attempt (the expiry path is the serve-crash and SIGSTOP tests' business).
    cluster = await make_cluster(timings=Timings(claim_s=15, ack_s=15, lease_s=10))
    await cluster.start_serve()
    crashing = (await cluster.start_agent("h1", devices=1, failpoints=failpoint)).proc
    [task_id] = await cluster.submit(1, sim={"duration_s": 0.2})
    assert await crashing.wait_exit(60) == -signal.SIGKILL

    restarted = (await cluster.start_agent("h1", devices=1)).proc
    await cluster.wait_terminal([task_id], timeout=60)
    view = await cluster.view(task_id)
    assert (view["state"], view["attempt"]) == ("done", 1)
    assert restarted.named("attempt_resumed", task_id=task_id)
    assert cluster.first_reports() == {(task_id, 1): 1}
    assert restarted.alive
    await cluster.assert_invariants()


@pytest.mark.parametrize("damage", ["wal_mid_frame", "database_half"])
async def test_truncated_journal_recovers_without_crash_or_second_report(
    make_cluster: MakeCluster, damage: str
) -> None:
    cluster = await make_cluster()
    await cluster.start_serve()
    crashing = (await cluster.start_agent("h1", devices=1, failpoints="after_result_recorded")).proc
    [task_id] = await cluster.submit(1, sim={"duration_s": 0.2}, max_attempts=3)
    assert await crashing.wait_exit(60) == -signal.SIGKILL

    db, wal = journal_files(cluster, "h1")
    if damage == "wal_mid_frame":
        # The last commit (the recorded result) is torn: SQLite drops it.
        size = wal.stat().st_size
        assert size > 200, "the journal's last commits are expected in its WAL"
        os.truncate(wal, size - 100)
    else:
        for path in (db, wal):
            if path.exists():
                os.truncate(path, path.stat().st_size // 2)

    restarted = (await cluster.start_agent("h1", devices=1)).proc
    await cluster.wait_terminal([task_id], timeout=60)
    assert restarted.alive, restarted.tail()
    view = await cluster.view(task_id)
    assert view["state"] == "done"
    # Whatever the journal lost, each attempt was reported as recorded at most once.
    assert all(n == 1 for n in cluster.first_reports().values())
    assert not crashing.named("result_reported")
    await cluster.assert_invariants()
    print(
        f"journal {damage}: attempts {[(a['number'], a['end_reason']) for a in view['attempts']]}, "
        f"corrupt_recovered={bool(restarted.named('journal_corrupt_recovered'))}"
    )
