"""Faults of the message broker and the network to it: nats-server SIGKILLed and
restarted (same port, same JetStream dir) mid-run, and one agent cut off from
NATS (fault proxy blackhole) for longer than its lease, or before its ack is
answered.

Invariants: the control plane and every agent reconnect by themselves (agents
re-register after a jittered delay) and nothing is lost or reported twice; a
partitioned agent stops its runner once its lease is over and the task is
retried on another host; an agent cut off before its ack is answered gives the
ack up at the ack deadline (never starts the runner) and leaves its journal
entry for the next reconciliation, which discards it; plus the shared database
invariants."""

from __future__ import annotations

import asyncio

import pytest

from fleetlease.ops.testing.cluster import Timings, wait_for
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(180)
async def test_nats_killed_and_restarted_mid_run_everyone_reconnects_nothing_lost(
    make_cluster: MakeCluster,
) -> None:
    cluster = await make_cluster()
    serve = await cluster.start_serve()
    hosts = ["h1", "h2", "h3"]
    await asyncio.gather(*(cluster.start_agent(h, devices=3) for h in hosts))
    ids = await cluster.submit(30, sim={"duration_s": 1.0}, max_attempts=5)
    await wait_for(
        lambda: cluster.states(ids),
        lambda s: sum(v == "running" for v in s.values()) >= 4,
        timeout=60,
        what="4 leases out",
    )
    marks = {h: cluster.agents[h].proc.mark() for h in hosts}
    serve_mark = serve.mark()
    loop = asyncio.get_running_loop()

    await cluster.kill_nats()
    await serve.wait_event("nats_disconnected", since=serve_mark, timeout=30)
    await cluster.start_nats()
    up_at = loop.time()

    recovery: dict[str, float] = {}

    async def reregistered(h: str) -> None:
        await cluster.agents[h].proc.wait_event(
            "agent_registered", since=marks[h], reason="nats_reconnected", timeout=60
        )
        recovery[h] = loop.time() - up_at

    await asyncio.gather(serve.wait_event("nats_reconnected", since=serve_mark, timeout=60))
    await asyncio.gather(*(reregistered(h) for h in hosts))
    await cluster.wait_terminal(ids, timeout=120)
    assert serve.alive and all(cluster.agents[h].proc.alive for h in hosts)
    assert all(n == 1 for n in cluster.first_reports().values())
    report = await cluster.assert_invariants()
    print(
        "NATS SIGKILL: agents re-registered "
        + ", ".join(f"{h} {t:.1f}s" for h, t in sorted(recovery.items()))
        + f" after the restart; {report.by_state}"
    )


async def test_agent_partitioned_from_nats_past_its_lease_stops_and_task_runs_elsewhere(
    make_cluster: MakeCluster,
) -> None:
    cluster = await make_cluster()
    await cluster.start_serve()
    cut = await cluster.start_agent("h-cut", devices=1, via_proxy=True)
    assert cut.proxy is not None
    [task_id] = await cluster.submit(1, sim={"duration_s": 4.0}, max_attempts=3)
    await cluster.wait_view(
        task_id,
        lambda v: v["state"] == "running" and v["attempts"][0]["host_id"] == "h-cut",
        timeout=30,
        what="attempt 1 running on h-cut",
    )
    # The agent has the ack's reply and its runner going (cut before that, it
    # would still be waiting for the ack with no runner to stop).
    await cut.proc.wait_event("attempt_started", task_id=task_id, timeout=30)
    mark = cut.proc.mark()

    cut.proxy.blackhole()
    try:
        await cluster.start_agent("h-other", devices=1)
        # Still cut off, the agent gives its lease up and stops the runner.
        lost = await cut.proc.wait_event(
            "lease_lost", task_id=task_id, attempt=1, since=mark, timeout=30
        )
        await cluster.wait_view(
            task_id,
            lambda v: v["attempt"] >= 2 and v["attempts"][0]["end_reason"] == "lease_expired",
            timeout=30,
            what="attempt 1 expired, attempt 2 assigned",
        )
    finally:
        cut.proxy.heal()

    view = await cluster.wait_view(
        task_id, lambda v: v["state"] == "done", timeout=60, what="task done"
    )
    assert view["attempts"][-1]["host_id"] == "h-other"
    assert not cut.proc.named("result_reported", task_id=task_id, attempt=1)
    assert cut.proc.alive, cut.proc.tail()
    await cluster.assert_invariants()
    print(f"partition: h-cut gave its lease up ({lost['reason']}) while cut off")


@pytest.mark.timeout(180)
async def test_agent_cut_off_before_its_ack_is_answered_gives_the_ack_up_at_the_deadline(
    make_cluster: MakeCluster,
) -> None:
    cluster = await make_cluster(timings=Timings(claim_s=30, ack_s=3, lease_s=5))
    await cluster.start_serve()
    cut = await cluster.start_agent("h-cut", devices=1, via_proxy=True)
    assert cut.proxy is not None
    # Every byte between h-cut and NATS arrives 4 s late (more than the ack
    # deadline): the ack h-cut sends for its assignment is still inside the
    # proxy when the link is cut below, so no answer to it ever comes.
    cut.proxy.latency(4.0)
    [task_id] = await cluster.submit(1, sim={"duration_s": 0.5}, max_attempts=3)
    await cut.proc.wait_event("assignment_received", task_id=task_id, attempt=1, timeout=60)
    mark = cut.proc.mark()
    cut.proxy.blackhole()
    try:
        given_up = await cut.proc.wait_event(
            "ack_given_up", task_id=task_id, attempt=1, since=mark, timeout=60
        )
        await cluster.start_agent("h-other", devices=1)
        await cluster.wait_view(
            task_id,
            lambda v: v["attempt"] >= 2 and v["attempts"][0]["end_reason"] == "ack_expired",
            timeout=30,
            what="attempt 1 ack-expired, attempt 2 assigned",
        )
    finally:
        cut.proxy.heal()
    view = await cluster.wait_view(
        task_id, lambda v: v["state"] == "done", timeout=60, what="task done"
    )
    assert not cut.proc.named("attempt_started", task_id=task_id, attempt=1)
    assert not cut.proc.named("attempt_acked", task_id=task_id, attempt=1)
    # The journal entry was left for reconciliation: the next session discards it.
    await cut.proc.terminate()
    restarted = (await cluster.start_agent("h-cut", devices=1)).proc
    discarded = [
        e
        for run in cluster.agents["h-cut"].runs
        for e in run.named("journal_entry_discarded", task_id=task_id, attempt=1)
    ]
    assert discarded, restarted.tail()
    assert view["attempts"][0]["host_id"] == "h-cut"
    assert all(n == 1 for n in cluster.first_reports().values())
    await cluster.assert_invariants()
    print(
        f"ack cut off: h-cut gave the ack up ({given_up['reason']}); "
        f"reconciliation discarded the entry ({discarded[0]['reason']})"
    )
