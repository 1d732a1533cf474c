"""Faults of PostgreSQL under a running system: an immediate stop (no clean
shutdown, crash recovery at restart) mid-run, and a connection lost during a
COMMIT, both when the backend is terminated before the commit is done and when
the commit is done but its reply never reaches the control plane.

Invariants: every task ends terminal, nothing acknowledged is lost, no device
reserved twice (``fleetlease.ops.testing.invariants``); a COMMIT whose reply was lost surfaces as
``unavailable``, the agent repeats its report with the same fingerprint, and the
outcome is what the database recorded (a replay when the commit was done, the
first recording when it was not), never a guess."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from fleetlease.ops.testing.cluster import Cluster, Timings, wait_for
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


def any_unavailable(cluster: Cluster, marks: dict[str, int]) -> bool:
    return any(
        e.get("code") == "unavailable"
        for h, a in cluster.agents.items()
        for e in a.proc.events()[marks[h] :]
    )


@pytest.mark.timeout(180)
async def test_postgres_stopped_immediately_and_restarted_mid_run_loses_nothing(
    make_cluster: MakeCluster,
) -> None:
    cluster = await make_cluster()
    await cluster.start_serve()
    await asyncio.gather(*(cluster.start_agent(h, devices=3) for h in ("h1", "h2")))
    ids = await cluster.submit(24, sim={"duration_s": 1.0}, max_attempts=5)
    await wait_for(
        lambda: cluster.states(ids),
        lambda s: sum(v == "running" for v in s.values()) >= 4,
        timeout=60,
        what="4 leases out",
    )
    marks = {h: a.proc.mark() for h, a in cluster.agents.items()}
    loop = asyncio.get_running_loop()

    await cluster.stop_pg("immediate")
    down_at = loop.time()
    # The fault lasts until the hosts have felt it (a renewal or a claim answered
    # unavailable) and for longer than a lease, so that leases expire meanwhile.
    outage_s = cluster.timings.lease_s + 1.0
    await wait_for(
        lambda: any_unavailable(cluster, marks) and loop.time() - down_at > outage_s,
        timeout=30,
        what="hosts seeing unavailable for longer than a lease",
    )
    await cluster.start_pg()
    up_at = loop.time()
    restart_marks = {h: a.proc.mark() for h, a in cluster.agents.items()}

    def reported_again() -> bool:
        return any(
            a.proc.named("result_reported", since=restart_marks[h])
            for h, a in cluster.agents.items()
        )

    await wait_for(reported_again, timeout=60, what="a result recorded after the restart")
    recovered = loop.time() - up_at
    await cluster.wait_terminal(ids, timeout=120)
    assert cluster.serves[0].alive, cluster.serves[0].tail()
    assert all(a.proc.alive for a in cluster.agents.values())
    report = await cluster.assert_invariants()
    print(
        f"PostgreSQL -m immediate: down {up_at - down_at:.1f}s, first result "
        f"{recovered:.1f}s after restart; {report.by_state}"
    )


SLOW_COMMIT = [
    "CREATE SEQUENCE fault_commit_seq",
    """CREATE FUNCTION fault_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF nextval('fault_commit_seq') = 1 THEN
            PERFORM pg_sleep(2);
        END IF;
        RETURN NULL;
    END $$""",
    # Deferred: it runs inside the commit (COMMIT, or the end of a statement in
    # autocommit), after every statement of the transaction.
    """CREATE CONSTRAINT TRIGGER fault_slow_commit AFTER UPDATE OF result_fingerprint
    ON tasks DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.result_fingerprint IS NOT NULL)
    EXECUTE FUNCTION fault_slow_commit()""",
]


async def committing_backend(cluster: Cluster) -> int | None:
    """The pid of a backend sleeping inside the slow commit, if any."""
    assert cluster.engine is not None
    async with cluster.engine.connect() as conn:
        pid = (
            await conn.execute(
                # The fault trigger is the only sleeper. The result's commit is a
                # COMMIT, or the end of its write statement in autocommit.
                sa.text("SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep' LIMIT 1")
            )
        ).scalar()
    return None if pid is None else int(pid)


@pytest.mark.parametrize("fault", ["terminate_backend", "reply_lost"])
async def test_a_commit_whose_reply_is_lost_is_resolved_by_reading_back(
    make_cluster: MakeCluster, fault: str
) -> None:
    # A longer lease: the lost commit and the repeated report fit well inside it.
    cluster = await make_cluster(pg_proxy=True, timings=Timings(lease_s=8, ack_s=5))
    assert cluster.engine is not None and cluster.pg_proxy is not None
    async with cluster.engine.begin() as conn:
        for sql in SLOW_COMMIT:
            await conn.execute(sa.text(sql))
    await cluster.start_serve()
    agent = (await cluster.start_agent("h1", devices=1)).proc
    [task_id] = await cluster.submit(1, sim={"duration_s": 0.2})

    pid = await wait_for(
        lambda: committing_backend(cluster), timeout=30, what="the result's COMMIT in progress"
    )
    if fault == "terminate_backend":
        # Killed inside COMMIT: the transaction is rolled back, the reply never sent.
        async with cluster.engine.connect() as conn:
            await conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    else:
        # The control plane's connection is cut; the backend finishes the COMMIT
        # and finds nobody to tell.
        cluster.pg_proxy.reset()

    view = await cluster.wait_view(
        task_id, lambda v: v["state"] == "done", timeout=60, what="task done"
    )
    await agent.wait_event("result_reported", task_id=task_id, timeout=30)
    assert view["attempt"] == 1
    retries = agent.named("result_report_retry", task_id=task_id, code="unavailable")
    assert retries, "the lost reply should have been answered unavailable and retried"
    [reported] = agent.named("result_reported", task_id=task_id)
    # Read back, not guessed: a replay of the recorded result exactly when the
    # commit was done.
    assert reported["replayed"] is (fault == "reply_lost")
    assert view["result"] is not None
    assert cluster.first_reports() == ({} if fault == "reply_lost" else {(task_id, 1): 1})
    assert cluster.serves[0].alive
    await cluster.assert_invariants()
