"""Fault: a task that kills its agent on every attempt (sim outcome
``kill_agent``: the agent process SIGKILLs itself while running it); a
supervisor restarts the agent *at once* each time (no backoff: the worst case
of a process supervisor).

The restarted agent resumes the attempt from its journal and the
reconciliation confirms it (its lease is long enough to outlive a restart), so
without a bound this would loop forever. The journal counts the resumes of each
attempt (durably, before running it); at ``max_resumes`` (2) the agent no
longer runs it but reports a retryable failure ("agent died 3 times running
this attempt"), and the control plane's retry policy takes over.

Invariant: the task ends ``failed`` after its max attempts and stays failed;
the control plane never crashes or restarts meanwhile (one serve process
throughout) and other work keeps flowing afterwards; the shared database
invariants hold."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import pytest

from fleetlease.ops.testing.cluster import Cluster, Timings
from tests.faults.conftest import MakeCluster

pytestmark = pytest.mark.chaos


async def supervise(cluster: Cluster, host_id: str, deaths: list[int]) -> None:
    """Restart the agent the moment it dies. Counts the deaths."""
    while True:
        proc = cluster.agents[host_id].proc
        code = await proc.wait_exit(3600)
        deaths.append(code)
        await cluster.start_agent(host_id, devices=1, wait=False)


@pytest.mark.timeout(240)
async def test_a_task_that_kills_its_agent_every_time_ends_failed_after_max_attempts(
    make_cluster: MakeCluster,
) -> None:
    # A lease that outlives an agent restart: every restart resumes the attempt
    # (the crash-loop case), none lets it expire.
    cluster = await make_cluster(timings=Timings(claim_s=15, ack_s=15, lease_s=15))
    serve = await cluster.start_serve()
    await cluster.start_agent("h1", devices=1)
    deaths: list[int] = []
    supervisor = asyncio.ensure_future(supervise(cluster, "h1", deaths))
    try:
        [poison] = await cluster.submit(
            1, sim={"duration_s": 0.1, "outcome": "kill_agent"}, max_attempts=2
        )
        view = await cluster.wait_view(
            poison, lambda v: v["state"] == "failed", timeout=180, what="poison task failed"
        )
        assert view["attempt"] == view["max_attempts"] == 2
        # Other work still flows through the same (restarted) agent.
        [healthy] = await cluster.submit(1)
        await cluster.wait_terminal([healthy], timeout=60)
        assert (await cluster.view(healthy))["state"] == "done"
    finally:
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
    assert serve.alive and serve.starts == 1, serve.tail()
    assert not serve.named("control_plane.started")[1:], "the control plane restarted"
    assert (await cluster.view(poison))["state"] == "failed"
    assert view["terminal_reason"] == "agent died 3 times running this attempt", view
    given_up = [
        e
        for run in cluster.agents["h1"].runs
        for e in run.named("attempt_given_up", task_id=poison)
    ]
    assert sorted(e["attempt"] for e in given_up) == [1, 2]
    assert all(code == -signal.SIGKILL for code in deaths), deaths
    await cluster.assert_invariants()
    print(
        f"poison task: failed after {view['attempt']} attempts "
        f"({[a['end_reason'] for a in view['attempts']]}, {view['terminal_reason']!r}), "
        f"agent died {len(deaths)} times"
    )
